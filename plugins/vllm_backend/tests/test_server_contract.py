"""The vLLM backend, OpenAI server in a child process, against the full contract suite,
with LoRA adapters enabled (the contract's adapter tests run through the server's routes)."""

import pytest
from conftest import ENGINE
from test_async_contract import LORA

import rollout
from rollout.testing import BackendContract, WeightTestsOnly


class TestVLLMServer(BackendContract):
    reference_key = "vllm"  # one engine configuration (conftest.ENGINE) in every mode

    @pytest.fixture(scope="class")
    @classmethod
    def make_backend(cls):
        return lambda model: rollout.load_backend("vllm", model=str(model), mode="server",
                                                  engine_args=LORA, **ENGINE)


class TestVLLMServerShm(WeightTestsOnly, BackendContract):
    """The same server, weights through shared memory and `/collective_rpc` (the default,
    `weight_transport="gloo"`, goes through vLLM's weight-transfer routes)."""

    reference_key = "vllm"  # one engine configuration (conftest.ENGINE) in every mode

    @pytest.fixture(scope="class")
    @classmethod
    def make_backend(cls):
        return lambda model: rollout.load_backend("vllm", model=str(model), mode="server",
                                                  weight_transport="shm", **ENGINE)
