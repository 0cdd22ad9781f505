"""vLLM's own serving benchmark, completions and chat, against `rollout serve` on the HF
and the vLLM backends (engine and async modes): every request succeeds."""

import sys

import pytest
from conftest import ENGINE

from rollout.testing.vllm_bench import check_vllm_bench


@pytest.mark.parametrize(("backend", "options"), [
    ("hf", {}), ("vllm", ENGINE), ("vllm", {**ENGINE, "mode": "async"})])
def test_vllm_serving_benchmark_has_no_failed_request(tiny_model, backend, options):
    check_vllm_bench(sys.executable, backend, str(tiny_model), options)
