"""What vLLM hands back, as chunks: delta outputs of one step or of several that piled up,
the events of a streamed /v1/completions, and a sample's tokens split by the weights that
made them (beside a "keep_kv" update)."""

import math
from types import SimpleNamespace as NS

import pytest

pytest.importorskip("vllm")

from rollout import Chunk, GenerationError, InvalidRequestError, TokenLogprob  # noqa: E402
from rollout_vllm.common import chunks as _chunks  # noqa: E402
from rollout_vllm.engine import Spans  # noqa: E402
from rollout_vllm.kept import KeptRequest  # noqa: E402
from rollout_vllm.server_engine import _sse_chunks  # noqa: E402


def logprobs(*steps):
    """vLLM's per-token logprobs: {token: Logprob(logprob, rank)} per position."""
    return [{t: NS(logprob=lp, rank=rank) for t, lp, rank in step} for step in steps]


def output(*completions, finished=False, cached=None, spans=None):
    return NS(outputs=[NS(index=i, token_ids=list(tokens), logprobs=lps, finish_reason=finish,
                          weight_versions=spans if finish else None)
                       for i, tokens, lps, finish in completions], finished=finished,
              num_cached_tokens=cached)


def test_one_step_gives_a_chunk_per_sample():
    step = output((0, [5], None, None), (1, [7], None, "length"), cached=16)
    assert _chunks([step], None) == [Chunk(0, (5,), cached_tokens=16),
                                     Chunk(1, (7,), finish_reason="length", cached_tokens=16)]


def test_outputs_that_piled_up_merge_per_sample():
    first = output((0, [5], logprobs([(5, -1.0, 2), (9, -0.5, 1)]), None))
    second = output((0, [6], logprobs([(6, -0.1, 1), (3, -2.0, 2)]), "stop"),
                    (1, [4], logprobs([(4, -3.0, 5), (8, -0.2, 1)]), None), finished=True)
    one, two = _chunks([first, second], 1)
    assert one == Chunk(0, (5, 6), (-1.0, -0.1), ((TokenLogprob(9, -0.5),),
                                                  (TokenLogprob(6, -0.1),)), "stop")
    # The chosen token ranks below k: it is in the logprobs, not in the top k.
    assert two == Chunk(1, (4,), (-3.0,), ((TokenLogprob(8, -0.2),),), None)


def test_logprobs_zero_gives_no_top_logprobs():
    step = output((0, [5], logprobs([(5, -1.0, 2), (9, -0.5, 1)]), None))
    assert _chunks([step], 0) == [Chunk(0, (5,), (-1.0,), None)]


def test_an_unknown_finish_reason_is_an_error():
    with pytest.raises(GenerationError, match="error"):
        _chunks([output((0, [], None, "error"), finished=True)], None)


def test_a_streamed_event_gives_its_tokens_logprobs_and_finish():
    event = {"choices": [
        {"index": 1, "token_ids": [7, 8], "finish_reason": "length",
         "logprobs": {"token_logprobs": [-0.5, -99999.0],
                      "top_logprobs": [{"token_id:7": -0.5, "token_id:2": -1.5},
                                       {"token_id:3": -0.1, "token_id:8": -99999.0}]}},
        {"index": 0, "token_ids": [], "finish_reason": None}]}
    (chunk,) = _sse_chunks(event, 1)
    assert chunk.index == 1 and chunk.token_ids == (7, 8) and chunk.finish_reason == "length"
    assert chunk.logprobs[0] == -0.5 and math.isinf(chunk.logprobs[1])
    assert chunk.top_logprobs == ((TokenLogprob(7, -0.5),), (TokenLogprob(3, -0.1),))


def test_a_refusal_mid_stream_names_our_field():
    with pytest.raises(InvalidRequestError) as caught:
        _sse_chunks({"error": {"code": 400, "message": "bad", "param": "top_p"}}, None)
    assert caught.value.field == "sampling.top_p"
    with pytest.raises(GenerationError):
        _sse_chunks({"error": {"code": 500, "message": "boom"}}, None)


def test_a_finished_sample_gives_its_spans_before_its_last_chunk():
    spans = [NS(version="default", start=0, end=3), NS(version="2", start=3, end=5)]
    step = output((0, [5, 6], None, "length"), (1, [7], None, None), spans=spans)
    assert _chunks([step], None) == [Spans(0, [(0, 0, 3), (2, 3, 5)]),
                                     Chunk(0, (5, 6), finish_reason="length"), Chunk(1, (7,))]


def test_tokens_after_an_update_began_are_held_and_split_by_the_weights_that_made_them():
    kept = KeptRequest(updates=1)
    assert kept.take(Chunk(0, (1, 2), (-0.1, -0.2)), holding=False) == [
        Chunk(0, (1, 2), (-0.1, -0.2), weight_update=1)]
    assert kept.take(Chunk(0, (3,), (-0.3,)), holding=True) == []  # made before or after?
    assert kept.take(Spans(0, [(1, 0, 4), (2, 4, 6)]), holding=True) == []
    assert kept.take(Chunk(0, (4, 5, 6), (-0.4, -0.5, -0.6), finish_reason="length",
                           cached_tokens=3), holding=True) == [
        Chunk(0, (3, 4), (-0.3, -0.4), weight_update=1),
        Chunk(0, (5, 6), (-0.5, -0.6), finish_reason="length", cached_tokens=3,
              weight_update=2)]


def test_a_held_sample_whose_spans_miss_tokens_fails_rather_than_drop_them():
    kept = KeptRequest(updates=0)
    kept.take(Spans(0, [(0, 0, 1)]), holding=True)
    with pytest.raises(GenerationError, match="do not cover"):
        kept.take(Chunk(0, (3, 4), finish_reason="stop"), holding=True)
    with pytest.raises(GenerationError, match="did not say"):  # no spans at all
        KeptRequest(updates=0).take(Chunk(1, (3,), finish_reason="stop"), holding=True)
