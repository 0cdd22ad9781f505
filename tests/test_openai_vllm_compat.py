"""Request fields read as vLLM's OpenAI server reads them (differences found by the
differential suite, plugins/vllm_backend/tests/test_differential.py)."""

import pytest

from rollout.apps.serving.openai_api import ApiError, ChatCall, CompletionsCall


def chat(**body):
    return ChatCall({"max_tokens": 4, **body}, "tiny")


def test_text_parts_are_joined_by_newlines():
    call = chat(messages=[{"role": "user", "content": [{"type": "text", "text": "first"},
                                                       {"type": "text", "text": "second"}]}])
    assert call.requests[0].messages[0].content == "first\nsecond"


def test_a_developer_message_is_a_system_message():
    call = chat(messages=[{"role": "developer", "content": "Be brief."},
                          {"role": "user", "content": "hi"}])
    assert [m.role for m in call.requests[0].messages] == ["system", "user"]


@pytest.mark.parametrize("make", [
    lambda extra: CompletionsCall({"prompt": "hi", **extra}, "tiny"),
    lambda extra: chat(messages=[{"role": "user", "content": "hi"}], **extra)])
def test_skip_special_tokens_true_only(make):
    assert make({"skip_special_tokens": True}).requests
    with pytest.raises(ApiError) as refused:
        make({"skip_special_tokens": False})
    assert (refused.value.status, refused.value.param) == (400, "skip_special_tokens")
