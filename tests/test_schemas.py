import enum

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout import InvalidRequestError, Message, Request, SamplingParams, TextPart
from rollout.contract import convert
from rollout.testing.strategies import CORRUPTIONS, requests


@given(requests())
def test_valid_requests_round_trip(data):
    request = convert.structure(data, Request)
    assert convert.structure(convert.unstructure(request), Request) == request
    assert convert.from_json(convert.to_json(request), Request) == request


@settings(max_examples=200)
@given(requests(), st.sampled_from(sorted(CORRUPTIONS)))
def test_invalid_requests_name_the_field(data, name):
    field, corrupt = CORRUPTIONS[name]
    with pytest.raises(InvalidRequestError) as info:
        convert.structure(corrupt(data), Request)
    assert info.value.field.startswith(field), (info.value.field, field)
    assert info.value.field in str(info.value)


def test_errors_say_what_is_allowed():
    with pytest.raises(InvalidRequestError) as info:
        convert.structure({"prompt": "x", "sampling": {"top_p": 2}}, Request)
    assert info.value.field == "sampling.top_p"
    assert info.value.allowed == "a number in (0, 1]"
    with pytest.raises(InvalidRequestError) as info:
        convert.structure({"prompt": "x", "sampling": {"temprature": 1}}, Request)
    assert "temperature" in info.value.allowed


def test_bools_and_floats_are_not_silently_coerced():
    for sampling, field in [({"max_tokens": True}, "sampling.max_tokens"),
                            ({"ignore_eos": "false"}, "sampling.ignore_eos"),
                            ({"n": 1.5}, "sampling.n")]:
        with pytest.raises(InvalidRequestError) as info:
            convert.structure({"prompt": "x", "sampling": sampling}, Request)
        assert info.value.field == field


def test_message_content_as_parts_and_tool_calls():
    data = {"messages": [
        {"role": "user", "content": [{"type": "text", "text": "what is "},
                                     {"type": "image", "image": "data:image/png;base64,AA=="},
                                     {"type": "text", "text": "this?"}]},
        {"role": "assistant", "content": "",
         "tool_calls": [{"id": "c1", "name": "look", "arguments": "{\"x\": 1}"}]},
        {"role": "tool", "content": "a cat", "tool_call_id": "c1"},
    ]}
    request = convert.structure(data, Request)
    first = request.messages[0]
    assert first.text == "what is this?"
    assert [p.type for p in first.content] == ["text", "image", "text"]
    assert len(first.images) == 1
    assert request.messages[1].tool_calls[0].name == "look"
    assert convert.unstructure(request)["messages"][2]["tool_call_id"] == "c1"


def test_python_construction_validates_too():
    with pytest.raises(InvalidRequestError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(InvalidRequestError, match="exactly one"):
        Request(prompt="a", prompt_token_ids=[1])
    assert Message("user", [TextPart("hi")]).text == "hi"
    assert Request(prompt="a").id != Request(prompt="a").id


def test_non_mapping_request():
    with pytest.raises(InvalidRequestError, match="mapping"):
        convert.structure("hello", Request)


def test_completion_errors_serialize():
    from rollout import Completion

    error = InvalidRequestError("sampling.n", "bad", "an integer >= 1")
    data = convert.unstructure(Completion("r1", error=error))
    assert data["error"] == {"kind": "invalid_request", "message": str(error),
                             "field": "sampling.n", "detail": "bad",
                             "allowed": "an integer >= 1"}
    back = convert.structure(data, Completion)
    assert isinstance(back.error, InvalidRequestError)
    assert (back.error.field, back.error.detail, back.error.allowed) == (
        "sampling.n", "bad", "an integer >= 1")
    assert str(back.error) == str(error)
    with pytest.raises(InvalidRequestError):
        back.unwrap()


def test_prompt_logprobs_are_bounded_and_one_per_prompt_token():
    from rollout.contract.schemas import PROMPT_LOGPROBS_MAX, Result, SamplingParams

    assert SamplingParams(prompt_logprobs=PROMPT_LOGPROBS_MAX).prompt_logprobs == 100
    for bad in (-1, PROMPT_LOGPROBS_MAX + 1, True, 1.0):
        with pytest.raises(InvalidRequestError) as caught:
            SamplingParams(prompt_logprobs=bad)
        assert caught.value.field == "prompt_logprobs"
    fields = dict(request_id="r", index=0, token_ids=(1,), text="", finish_reason="length",
                  prompt_tokens=3, prompt_token_ids=(4, 5, 6))
    assert Result(**fields, prompt_logprobs=(None, -1.0, -2.0)).prompt_logprobs[1:] == (-1.0,
                                                                                        -2.0)
    with pytest.raises(InvalidRequestError) as caught:
        Result(**fields, prompt_logprobs=(None, -1.0))
    assert caught.value.field == "prompt_logprobs"


def test_token_ids_are_checked_item_by_item():
    # Plain ints take the fast path; anything else gets the error naming its item.
    request = convert.structure({"prompt_token_ids": [5, 0, 7],
                                 "sampling": {"stop_token_ids": (2,)}}, Request)
    assert request.prompt_token_ids == (5, 0, 7) and request.sampling.stop_token_ids == (2,)
    for ids, field in [([1, True], "prompt_token_ids[1]"), ([1, 2.0], "prompt_token_ids[1]"),
                       ([1, "3"], "prompt_token_ids[1]"), ("12", "prompt_token_ids[0]"),
                       ([4, -1], "prompt_token_ids")]:
        with pytest.raises(InvalidRequestError) as info:
            convert.structure({"prompt_token_ids": ids}, Request)
        assert info.value.field == field, ids
    with pytest.raises(InvalidRequestError) as info:
        convert.structure({"prompt": "x", "sampling": {"stop_token_ids": [1, False]}}, Request)
    assert info.value.field == "sampling.stop_token_ids[1]"
    # From Python: an int subclass is an integer, a bool is not.
    class Token(enum.IntEnum):
        A = 3

    assert Request(prompt_token_ids=[Token.A, 4]).prompt_token_ids == (3, 4)
    for bad in ([1, True], [1, -2]):
        with pytest.raises(InvalidRequestError, match="prompt_token_ids"):
            Request(prompt_token_ids=bad)


def test_a_backends_default_logprobs_mode_is_one_it_gives():
    from rollout import Capabilities

    assert Capabilities().logprobs_mode == "raw"
    fixed = Capabilities(unsupported={"logprobs_mode.raw": "fixed at start"},
                         logprobs_mode="processed")
    assert not fixed.supports("logprobs_mode.raw") and fixed.supports("logprobs_mode.processed")
    with pytest.raises(InvalidRequestError, match="logprobs_mode"):
        Capabilities(unsupported={"logprobs_mode.raw": "fixed at start"})
    with pytest.raises(InvalidRequestError) as refused:
        SamplingParams(logprobs_mode="processed_logits")
    assert refused.value.field == "logprobs_mode" and "raw, processed" in str(refused.value)
