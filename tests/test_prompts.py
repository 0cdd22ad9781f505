"""The prompt encoder renders tools and tool calls with the model's chat template, and a
template that would drop them is an error naming the field."""

import pytest
from transformers import AutoTokenizer

from rollout import InvalidRequestError, Request
from rollout.contract import convert
from rollout.kit.prompts import PromptEncoder

ADD = {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}
CALLED = [{"role": "user", "content": "add 1"},
          {"role": "assistant", "content": "", "tool_calls": [
              {"id": "c1", "name": "add", "arguments": '{"a": 1}'}]},
          {"role": "tool", "tool_call_id": "c1", "content": "1"}]


@pytest.fixture
def tokenizer(tiny_model):
    return AutoTokenizer.from_pretrained(str(tiny_model))


def encode(tokenizer, **request) -> str:
    ids = PromptEncoder(tokenizer, len(tokenizer), 2048).encode(convert.structure(request, Request))
    return tokenizer.decode(ids)


def test_tools_and_calls_reach_the_template(tokenizer):
    text = encode(tokenizer, messages=CALLED, tools=[ADD])
    assert '"name": "add"' in text.split("</tools>")[0]  # the definition
    assert '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>' in text
    assert "<tool_response>1</tool_response>" in text


def test_malformed_arguments_are_rendered_as_the_model_wrote_them(tokenizer):
    messages = [CALLED[0], {**CALLED[1], "tool_calls": [
        {"id": "c1", "name": "add", "arguments": '{"a": 1'}]}]
    assert '"arguments": {"a": 1}</tool_call>' in encode(tokenizer, messages=messages)


@pytest.mark.parametrize(("request_", "field"), [
    ({"messages": CALLED[:1], "tools": [ADD]}, "tools"),
    ({"messages": CALLED}, "messages[1].tool_calls"),
])
def test_a_template_without_tools_is_an_error(tokenizer, request_, field):
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(InvalidRequestError) as info:
        encode(tokenizer, **request_)
    assert info.value.field == field and "does not render" in str(info.value)


def test_a_template_that_raises_is_an_error_naming_messages(tokenizer):
    tokenizer.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(InvalidRequestError) as info:
        encode(tokenizer, messages=CALLED[:1])
    assert info.value.field == "messages" and "roles must alternate" in str(info.value)


@pytest.mark.parametrize("model", ["tiny_model", "real_model"])
def test_texts_are_decoded_as_the_tokenizer_decodes_them(model, request):
    """Streams decode through the Rust tokenizer directly; the text must be transformers'
    own, special tokens and characters split across tokens included."""
    from hypothesis import given, settings, strategies as st

    tokenizer = AutoTokenizer.from_pretrained(str(request.getfixturevalue(model)))
    encoder = PromptEncoder(tokenizer, len(tokenizer), 2048)
    assert encoder._decode.__code__ is not PromptEncoder(object(), 1, 1)._decode.__code__
    specials = sorted(tokenizer.all_special_ids)

    @settings(max_examples=300, deadline=None)
    @given(st.lists(st.one_of(st.integers(0, len(tokenizer) - 1), st.sampled_from(specials)),
                    max_size=12))
    def decoded_alike(ids):
        assert encoder.decode(ids) == tokenizer.decode(ids, skip_special_tokens=True)

    decoded_alike()
