"""The Anthropic Messages API of the server, in front of the real HF backend on the tiny
model, through the `anthropic` SDK (rollout.testing.messages_contract)."""

import pytest

import rollout
from rollout.testing.messages_contract import MessagesContract


class TestHFMessages(MessagesContract):
    @pytest.fixture(scope="class")
    @classmethod
    def make_rollout(cls):
        return lambda model, max_model_len: rollout.load_backend(
            "hf", model=model, max_model_len=max_model_len)
