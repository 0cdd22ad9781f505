"""The HF backend against the full contract suite, on the real transformers engine."""

import pytest

import rollout
from rollout.testing import BackendContract


class TestHFBackend(BackendContract):
    @pytest.fixture(scope="class")
    @classmethod
    def make_backend(cls):
        # A small batch size makes the suite cross batch boundaries too.
        return lambda model: rollout.load_backend("hf", model=str(model), batch_size=3)
