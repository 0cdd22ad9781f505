"""The HTTP server in front of the vLLM backend (engine and async modes): the same server
contract as the HF backend's, through the official `openai` client."""

import pytest
from conftest import ENGINE

import rollout
from rollout.testing.server_contract import ServerContract


def loader(mode: str):
    return lambda model, max_model_len: rollout.load_backend(
        "vllm", model=model, mode=mode, max_model_len=max_model_len, **ENGINE)


class TestVLLMServer(ServerContract):
    @pytest.fixture(scope="class")
    @classmethod
    def make_rollout(cls):
        return loader("engine")


class TestVLLMAsyncServer(ServerContract):
    @pytest.fixture(scope="class")
    @classmethod
    def make_rollout(cls):
        return loader("async")
