"""Strict tools through `rollout serve` in front of the SGLang backend: the Hypothesis-made
schemas of rollout.testing.strict_tools, as on the HF backend (tests/test_serve_openai.py)."""

import pytest
from conftest import ENGINE

import rollout
from rollout.testing.strict_tools import StrictToolsContract


class TestSGLangStrictTools(StrictToolsContract):
    # An open defect: once in CI a strict json_schema answer had a 1-character string
    # where the schema (rewritten to an exact pattern) asked 4 to 6 (minLength/maxLength).
    # The server's guard now fails such a call (500) instead of returning it; the cause in
    # the grammar is not found yet.
    unheld = {"response_format": "SGLang's xgrammar (0.2.7) was seen to break a string's "
              "length bounds in a response_format json_schema"}

    @pytest.fixture(scope="class")
    @classmethod
    def make_rollout(cls):
        return lambda model: rollout.load_backend(
            "sglang", model=model, mode="server", **ENGINE,
            engine_args={"context_length": 2048})
