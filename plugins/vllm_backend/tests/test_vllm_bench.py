"""vLLM's own serving benchmark, completions and chat, against `rollout serve` on the HF
and the vLLM backends: every request succeeds. (The vLLM backend's default mode, `engine`;
the others run the same concurrency through the contract suite.)"""

import sys

import pytest
from conftest import ENGINE

from rollout.testing.vllm_bench import check_vllm_bench


@pytest.mark.parametrize(("backend", "options"), [("hf", {}), ("vllm", ENGINE)])
def test_vllm_serving_benchmark_has_no_failed_request(tiny_model, backend, options):
    check_vllm_bench(sys.executable, backend, str(tiny_model), options)
