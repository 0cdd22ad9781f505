"""The vLLM backend, OpenAI server in a child process, against the full contract suite."""

import pytest
from conftest import ENGINE

import rollout
from rollout.testing import BackendContract, WeightTestsOnly


class TestVLLMServer(BackendContract):
    @pytest.fixture(scope="class")
    @classmethod
    def make_backend(cls):
        return lambda model: rollout.load_backend("vllm", model=str(model), mode="server", **ENGINE)


class TestVLLMServerGloo(WeightTestsOnly, BackendContract):
    """The same server, weights through vLLM's weight-transfer routes and a gloo group."""

    @pytest.fixture(scope="class")
    @classmethod
    def make_backend(cls):
        return lambda model: rollout.load_backend("vllm", model=str(model), mode="server",
                                                  weight_transport="gloo", **ENGINE)
