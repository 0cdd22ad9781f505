"""The HTTP server in front of the SGLang backend (SGLang's own server in a child
process): the same server contract as the other backends', through the official `openai`
client."""

import pytest
from conftest import ENGINE

import rollout
from rollout.testing.server_contract import ServerContract


class TestSGLangServer(ServerContract):
    @pytest.fixture(scope="class")
    @classmethod
    def make_rollout(cls):
        return lambda model, max_model_len: rollout.load_backend(
            "sglang", model=model, mode="server", **ENGINE,
            engine_args={"context_length": max_model_len})
