"""Texts from tokens (rollout.kit.text) with the tiny model's real tokenizer: stop strings
by the contract's rule, and streamed pieces that always join to the final text."""

import pytest
from transformers import AutoTokenizer

from rollout import SamplingParams
from rollout.kit.text import TextStream, final_text, first_stop


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return AutoTokenizer.from_pretrained(tiny_model)


def decode_with(tokenizer):
    return lambda ids: tokenizer.decode(list(ids), skip_special_tokens=True)


def test_the_stop_that_ends_first_wins_and_only_past_the_held_text():
    assert first_stop("abcdef", ["de", "bc"]) == (1, 3)
    assert first_stop("abcdef", ["cdef", "de"]) == (3, 5)
    assert first_stop("abcabc", ["bc"], after=3) == (4, 6)  # the first "bc" ends too early
    assert first_stop("abc", ["x"]) is None


@pytest.mark.parametrize("sampling", [
    SamplingParams(max_tokens=64),
    SamplingParams(max_tokens=64, stop=("ka lo",)),
    SamplingParams(max_tokens=64, stop=("ka lo", "mi"), include_stop_str_in_output=True),
    SamplingParams(max_tokens=64, stop=("the",), min_tokens=3),
])
def test_streamed_pieces_join_to_the_final_text(tokenizer, sampling):
    decode = decode_with(tokenizer)
    tokens = tokenizer("the ka lo mi ne su the ka lo def x(): return print").input_ids
    stream = TextStream(decode, sampling)
    pieces = [stream.add([t]) for t in tokens]
    pieces.append(stream.finish())
    assert "".join(pieces) == final_text(decode, tokens, sampling)


def test_text_that_may_start_a_stop_string_is_held_back(tokenizer):
    decode = decode_with(tokenizer)
    stream = TextStream(decode, SamplingParams(max_tokens=64, stop=("ka lo",)))
    shown = "".join(stream.add([t]) for t in tokenizer("the ka").input_ids)
    assert "ka" not in shown  # "ka" may begin "ka lo"
    shown += "".join(stream.add([t]) for t in tokenizer(" lo mi").input_ids)
    assert shown + stream.finish() == "the "
