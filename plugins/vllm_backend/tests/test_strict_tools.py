"""Strict tools through `rollout serve` in front of the vLLM backend: the Hypothesis-made
schemas of rollout.testing.schemas, as on the HF backend (tests/test_serve_openai.py)."""

import pytest
from conftest import ENGINE

import rollout
from rollout.testing.schemas import StrictToolsContract


class TestVLLMStrictTools(StrictToolsContract):
    @pytest.fixture(scope="class")
    @classmethod
    def make_rollout(cls):
        return lambda model: rollout.load_backend("vllm", model=model, mode="engine",
                                                  max_model_len=2048, **ENGINE)
