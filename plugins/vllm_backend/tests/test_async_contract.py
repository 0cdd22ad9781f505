"""The vLLM backend through AsyncLLM, its engine core in a child process, against the full
contract suite."""

import pytest
from conftest import ENGINE

import rollout
from rollout.testing import BackendContract


class TestVLLMAsync(BackendContract):
    reference_key = "vllm"  # one engine configuration (conftest.ENGINE) in every mode

    @pytest.fixture(scope="class")
    @classmethod
    def make_backend(cls):
        return lambda model: rollout.load_backend("vllm", model=str(model), mode="async", **ENGINE)
