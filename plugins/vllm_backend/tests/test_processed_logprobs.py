"""The vLLM backend started with logprobs_mode="processed" (vLLM fixes the mode at start):
the contract suite's logprob tests, which hold its logprobs to the distribution each token
was drawn from; the rest is test_engine_contract's."""

import pytest
from conftest import ENGINE

import rollout
from rollout.testing import BackendContract, OnPolicyOnly


class TestVLLMProcessedLogprobs(OnPolicyOnly, BackendContract):
    reference_key = "vllm"  # the same weights and greedy tokens as every other mode

    @pytest.fixture(scope="class")
    @classmethod
    def make_backend(cls):
        return lambda model: rollout.load_backend("vllm", model=str(model), mode="engine",
                                                  logprobs_mode="processed", **ENGINE)
