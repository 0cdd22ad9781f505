"""The example backend of docs/writing-a-backend.md against the full contract suite."""

import pytest

import rollout
from rollout.testing import BackendContract


class TestExampleBackend(BackendContract):
    @pytest.fixture(scope="class")
    @classmethod
    def make_backend(cls):
        return lambda model_dir: rollout.load_backend("example", model=str(model_dir))
