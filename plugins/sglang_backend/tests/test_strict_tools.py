"""Strict tools through `rollout serve` in front of the SGLang backend: the Hypothesis-made
schemas of rollout.testing.schemas, as on the HF backend (tests/test_serve_openai.py)."""

import pytest
from conftest import ENGINE

import rollout
from rollout.testing.schemas import StrictToolsContract


class TestSGLangStrictTools(StrictToolsContract):
    @pytest.fixture(scope="class")
    @classmethod
    def make_rollout(cls):
        return lambda model: rollout.load_backend(
            "sglang", model=model, mode="server", **ENGINE,
            engine_args={"context_length": 2048})
