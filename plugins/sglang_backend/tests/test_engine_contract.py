"""The SGLang backend, in-process sglang.Engine, against the full contract suite."""

import pytest
from conftest import ENGINE

import rollout
from rollout.testing import BackendContract


# Adapters on (with SGLang's LoRA layers in the model), so that the suite's adapter tests
# run here; test_lora runs the server mode's. Base rows compute what they do without
# LoRA (a row without an adapter gets no delta), so the references are shared.
LORA = {"enable_lora": True, "max_lora_rank": 8}


class TestSGLangEngine(BackendContract):
    reference_key = "sglang"  # one engine configuration (conftest.ENGINE) in every mode

    @pytest.fixture(scope="class")
    @classmethod
    def make_backend(cls):
        return lambda model: rollout.load_backend("sglang", model=str(model), mode="engine",
                                                  engine_args=LORA, **ENGINE)

    def test_raw_logprobs_it_cannot_give_are_refused(self, harness):
        # SGLang's logprobs come after penalties; their raw values are recomputed by a
        # prefill, which knows no constraint: that one case is refused, not approximated.
        refused, fine = harness.rollout.generate([
            {"prompt": "the ka lo", "sampling": {"logprobs": 1, "repetition_penalty": 1.2,
                                                 "structured_outputs": {"regex": "ka"}}},
            {"prompt": "the ka lo", "sampling": {"logprobs": 1, "repetition_penalty": 1.2,
                                                 "max_tokens": 4}}])
        assert refused.error.field == "sampling.logprobs"
        assert len(fine.unwrap()[0].logprobs) == fine.unwrap()[0].completion_tokens
