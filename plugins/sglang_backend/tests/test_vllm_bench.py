"""vLLM's own serving benchmark, completions and chat, against `rollout serve` on the
SGLang backend: every request succeeds. vLLM lives in its own environment: scripts/test.sh
names its Python in ROLLOUT_VLLM_PYTHON."""

import os

import pytest
from conftest import ENGINE

from rollout.testing.vllm_bench import check_vllm_bench

BENCH_PYTHON = os.environ.get("ROLLOUT_VLLM_PYTHON")


@pytest.mark.skipif(not BENCH_PYTHON, reason="ROLLOUT_VLLM_PYTHON (a Python with vLLM) unset")
def test_vllm_serving_benchmark_has_no_failed_request(tiny_model):
    check_vllm_bench(BENCH_PYTHON, "sglang", str(tiny_model), ENGINE)
