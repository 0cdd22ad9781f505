"""The vLLM backend through AsyncLLM, its engine core in a child process, against the full
contract suite, with LoRA adapters enabled (the contract's adapter tests run here and in
server mode; the engine-mode class checks that a backend without them refuses them)."""

import pytest
from conftest import ENGINE

import rollout
from rollout.testing import BackendContract

LORA = {"enable_lora": True, "max_loras": 2, "max_lora_rank": 8}


class TestVLLMAsync(BackendContract):
    reference_key = "vllm"  # one engine configuration (conftest.ENGINE) in every mode

    @pytest.fixture(scope="class")
    @classmethod
    def make_backend(cls):
        return lambda model: rollout.load_backend("vllm", model=str(model), mode="async",
                                                  engine_args=LORA, **ENGINE)
