"""Backend options refused before any engine starts."""

import pytest

import rollout


@pytest.mark.parametrize(("options", "field"), [
    ({"mode": "cluster"}, "mode"),
    ({"engine_args": {"incremental_streaming_output": False}},
     "engine_args.incremental_streaming_output"),
    ({"weight_transport": "nccl"}, "weight_transport"),
    ({"mode": "engine", "weight_transport": "gloo"}, "weight_transport"),
    ({"image_cache_mb": -1}, "image_cache_mb"),
    ({"image_cache_mb": 1.5}, "image_cache_mb"),
    ({"image_cache_mb": True}, "image_cache_mb"),
    ({"engine_args": "{context_length: 2048}"}, "engine_args"),  # YAML, where -o takes JSON
    ({"stream_interval": 0}, "stream_interval"),
    ({"stream_interval": "8"}, "stream_interval"),
    ({"engine_args": {"stream_interval": 16}}, "engine_args.stream_interval"),
    ({"nice": -1}, "nice"),
    ({"nice": 19.0}, "nice"),
])
def test_a_bad_option_is_refused_naming_it(tiny_model, options, field):
    with pytest.raises(rollout.InvalidRequestError) as caught:
        rollout.load_backend("sglang", model=str(tiny_model), **options)
    assert caught.value.field == field
