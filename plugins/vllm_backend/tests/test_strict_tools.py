"""Strict tools through `rollout serve` in front of the vLLM backend: the Hypothesis-made
schemas of rollout.testing.strict_tools, as on the HF backend (tests/test_serve_openai.py)."""

import pytest

from rollout.testing.strict_tools import StrictToolsContract


class TestVLLMStrictTools(StrictToolsContract):
    @pytest.fixture(scope="class")
    @classmethod
    def make_rollout(cls, shared_vllm):
        return lambda model: shared_vllm("engine")  # the tiny model's 2048 tokens
