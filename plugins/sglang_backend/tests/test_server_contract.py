"""The SGLang backend, native HTTP server in a child process, against the full contract
suite."""

import pytest
from conftest import ENGINE, KeepsWhatSGLangHeldBack

import rollout
from rollout.testing import BackendContract


class TestSGLangServer(BackendContract, KeepsWhatSGLangHeldBack):
    reference_key = "sglang"  # one engine configuration (conftest.ENGINE) in every mode

    @pytest.fixture(scope="class")
    @classmethod
    def make_backend(cls):
        return lambda model: rollout.load_backend("sglang", model=str(model), mode="server",
                                                  **ENGINE)
