"""verl's sampling_params as rollout's sampling fields (rollout.integrations.verl), with
verl's own length default; no verl needed."""

from types import SimpleNamespace

import pytest

from rollout.contract.errors import InvalidRequestError
from rollout.integrations.verl import sampling

CONFIG = SimpleNamespace(prompt_length=16, response_length=8, max_model_len=None)


def test_verl_fields_map_and_length_defaults_to_what_is_left():
    fields = sampling({"temperature": 0.7, "top_p": 0.9, "top_k": -1, "logprobs": True,
                       "repetition_penalty": 1.1}, prompt_len=12, config=CONFIG)
    assert fields == {"temperature": 0.7, "top_p": 0.9, "repetition_penalty": 1.1,
                      "max_tokens": 8, "logprobs": 0}
    # a long prompt leaves less than response_length within prompt + response length
    assert sampling({}, prompt_len=20, config=CONFIG)["max_tokens"] == 4
    assert "logprobs" not in sampling({"logprobs": False}, 4, CONFIG)


def test_explicit_length_is_capped_by_the_context():
    config = SimpleNamespace(prompt_length=16, response_length=8, max_model_len=24)
    assert sampling({"max_new_tokens": 50}, prompt_len=20, config=config)["max_tokens"] == 4
    with pytest.raises(InvalidRequestError, match="prompt_ids"):
        sampling({"max_tokens": 5}, prompt_len=24, config=config)


def test_unknown_field_is_refused_by_name():
    with pytest.raises(InvalidRequestError, match="sampling_params.best_of") as error:
        sampling({"best_of": 2, "top_p": 1.0}, 4, CONFIG)
    assert "temperature" in error.value.allowed
