"""The SGLang backend, native HTTP server in a child process, against the full contract
suite."""

import pytest
from conftest import ENGINE

import rollout
from rollout.testing import BackendContract


class TestSGLangServer(BackendContract):
    @pytest.fixture(scope="class")
    @classmethod
    def make_backend(cls):
        return lambda model: rollout.load_backend("sglang", model=str(model), mode="server",
                                                  **ENGINE)

    def test_cached_tokens_are_sglangs_word(self, harness):
        # The server's meta_info carries cached_tokens as the in-process engine's does.
        request = {"prompt": "the ka lo ka lo ka", "sampling": {"temperature": 0.0,
                                                                 "max_tokens": 4}}
        [first] = harness.rollout.generate([request])[0].unwrap()
        [again] = harness.rollout.generate([request])[0].unwrap()
        assert first.cached_tokens is not None
        assert 0 < again.cached_tokens <= again.prompt_tokens
