"""The HF backend against the full contract suite, on the real transformers engine."""

import pytest

import rollout
from rollout.testing import BackendContract


class TestHFBackend(BackendContract):
    @pytest.fixture(scope="class")
    @classmethod
    def make_backend(cls):
        # A small batch size makes requests wait for a free row and join running batches;
        # more rows than the 8 samples of the suite's long request, which would otherwise
        # hold every row for its whole length (rows are not preempted).
        return lambda model: rollout.load_backend("hf", model=str(model), batch_size=10)
