"""The vLLM backend through AsyncLLM, its engine core in a child process, against the full
contract suite."""

import pytest
from conftest import ENGINE

import rollout
from rollout.testing import BackendContract


class TestVLLMAsync(BackendContract):
    @pytest.fixture(scope="class")
    @classmethod
    def make_backend(cls):
        return lambda model: rollout.load_backend("vllm", model=str(model), mode="async", **ENGINE)


    def test_cached_tokens_are_vllms_word(self, harness):
        request = {"prompt": "the ka lo " * 40, "sampling": {"temperature": 0.0,
                                                            "max_tokens": 4}}
        [first] = harness.rollout.generate([request])[0].unwrap()
        [again] = harness.rollout.generate([request])[0].unwrap()
        assert first.cached_tokens is not None
        assert 0 < again.cached_tokens <= again.prompt_tokens
