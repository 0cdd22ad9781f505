"""The server's last guard on JSON answers: an answer that response_format or
structured_outputs.json held, that the grammar ended, and that does not validate fails the
call (500, strict_violation) instead of reaching the client. The engines' grammars make
such an answer impossible, so the answers here are written by hand: this is the error
path no real engine produces on demand."""

import pytest

from rollout import Completion, Result
from rollout.apps.serving.openai_api import ApiError, ChatCall, CompletionsCall

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 3}},
          "required": ["name"], "additionalProperties": False}
FORMATS = {
    "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}},
    "structured_outputs": {"json": SCHEMA},
}


def answer(text: str, finish: str = "stop") -> Completion:
    return Completion("r", (Result("r", 0, (1, 2), text, finish, 3),))


def calls(field: str, **extra):
    yield ChatCall({"messages": [{"role": "user", "content": "hi"}], field: FORMATS[field],
                    **extra}, "m")
    yield CompletionsCall({"prompt": "hi", field: FORMATS[field], **extra}, "m")


@pytest.mark.parametrize("field", FORMATS)
@pytest.mark.parametrize("text", ['{"name": "toolong"}', '{"other": 1}', '{"name": "ab"'])
def test_an_answer_the_grammar_ended_that_does_not_validate_fails_the_call(field, text):
    for call in calls(field):
        with pytest.raises(ApiError) as info:
            call.check(answer(text), 0)
        assert info.value.status == 500 and info.value.code == "strict_violation"
        assert field in info.value.message


@pytest.mark.parametrize("field", FORMATS)
def test_valid_answers_and_answers_cut_elsewhere_go_back(field):
    for call in calls(field):
        call.check(answer('{"name": "ab"}'), 0)
        call.check(answer('{"name": "a', finish="length"), 0)  # the token limit cut it
    for call in calls(field, stop=["}"]):  # a stop string the client chose cut it
        call.check(answer('{"name": "ab"'), 0)


def test_json_object_holds_to_an_object():
    call = ChatCall({"messages": [{"role": "user", "content": "hi"}],
                     "response_format": {"type": "json_object"}}, "m")
    call.check(answer('{"a": [1]}'), 0)
    with pytest.raises(ApiError):
        call.check(answer("[1]"), 0)
