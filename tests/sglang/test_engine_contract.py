"""The SGLang backend, in-process sglang.Engine, against the full contract suite."""

import pytest
from conftest import ENGINE

import rollout
from rollout.testing import BackendContract


class TestSGLangEngine(BackendContract):
    @pytest.fixture(scope="class")
    @classmethod
    def make_backend(cls):
        return lambda model: rollout.load_backend("sglang", model=str(model), mode="engine",
                                                  **ENGINE)
