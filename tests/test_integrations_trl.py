"""`rollout.integrations.trl`'s reading of TRL's sampling config, which holds without TRL
installed (the trainer itself runs in the vLLM and SGLang environments' tests)."""

from types import SimpleNamespace

import pytest

import rollout
from rollout.contract import convert
from rollout.integrations.trl import sampling_fields

# GRPOConfig's defaults for the fields read (TRL 1.16).
DEFAULTS = dict(temperature=1.0, top_p=1.0, top_k=0, min_p=None, repetition_penalty=1.0,
                max_completion_length=256, generation_kwargs=None,
                vllm_structured_outputs_regex=None)


def fields(**args):
    return sampling_fields(SimpleNamespace(args=SimpleNamespace(**{**DEFAULTS, **args})))


def test_trl_defaults_mean_no_limits_and_ask_for_the_sampled_tokens_logprobs():
    assert fields() == {"temperature": 1.0, "top_p": 1.0, "top_k": None, "min_p": 0.0,
                        "repetition_penalty": 1.0, "max_tokens": 256, "logprobs": 0}
    rollout.SamplingParams(**fields())  # a valid request


def test_set_fields_the_regex_and_generation_kwargs_are_honoured():
    got = fields(top_k=20, min_p=0.05, vllm_structured_outputs_regex=r"\d+",
                 generation_kwargs={"top_p": 0.9, "stop": ["\n"]})
    assert got["top_k"] == 20 and got["min_p"] == 0.05
    assert got["top_p"] == 0.9 and got["stop"] == ["\n"]  # generation_kwargs win, as in TRL
    assert got["structured_outputs"] == {"regex": r"\d+"}


def test_a_generation_kwarg_rollout_does_not_know_is_refused_by_name():
    request = {"prompt_token_ids": [1, 2], "sampling": fields(generation_kwargs={"num_beams": 4})}
    with pytest.raises(rollout.InvalidRequestError, match="num_beams"):
        convert.structure(request, rollout.Request)


def test_no_completion_limit_is_refused_by_name():
    with pytest.raises(rollout.InvalidRequestError, match="max_completion_length"):
        fields(max_completion_length=None)
