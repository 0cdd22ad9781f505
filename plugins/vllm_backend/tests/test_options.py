"""A bad backend option is refused before any engine starts, naming the option."""

import pytest

import rollout
from rollout import InvalidRequestError


@pytest.mark.parametrize("options, field", [
    ({"mode": "http"}, "mode"),
    ({"mode": "server", "stream_interval": 0}, "stream_interval"),
    ({"stream_interval": 1.5}, "stream_interval"),
    ({"mode": "server", "weight_transport": "nccl"}, "weight_transport"),
    ({"mode": "async", "weight_transport": "gloo"}, "weight_transport"),  # server mode only
    ({"engine_args": "{max_num_seqs: 4}"}, "engine_args"),  # YAML, not the JSON -o parses
    ({"logprobs_mode": "processed_logits"}, "logprobs_mode"),
    ({"engine_args": {"logprobs_mode": "processed_logprobs"}}, "engine_args.logprobs_mode"),
    ({"nice": -5}, "nice"),  # (a higher priority than ours: not this option's job)
    ({"nice": 20}, "nice"),
    ({"nice": "19"}, "nice"),
])
def test_bad_option_names_the_field(tiny_model, options, field):
    with pytest.raises(InvalidRequestError, match=field) as caught:
        rollout.load_backend("vllm", model=str(tiny_model), **options)
    assert caught.value.field == field
