"""The server's Anthropic Messages API, run against a real backend through Anthropic's own
`anthropic` SDK: answers equal the engine's, the stream's events, tools both ways, stop
sequences, count_tokens, what harnesses send, and errors in Anthropic's shape.

Subclass `MessagesContract` in a test module and override `make_rollout` (a class-scoped
fixture giving `lambda model, max_model_len: rollout.Rollout`).
"""

from __future__ import annotations

import json

import pytest

from rollout.testing.server_contract import KEY, MODEL, ServedBackend, http

PROMPT = [{"role": "user", "content": "def add(a, b):"}]
ADD = {"name": "add", "description": "add two digits", "input_schema": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                     "b": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["a", "b"], "additionalProperties": False}}


def direct(ro, messages, **sampling):
    """The engine's own answer to the chat the Messages call becomes."""
    return ro.generate([{"messages": messages, "sampling": sampling}])[0].unwrap()[0]


class MessagesContract(ServedBackend):
    @pytest.fixture(scope="class")
    @classmethod
    def client(cls, server):
        import anthropic

        return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)

    # --- answers ------------------------------------------------------------------------

    def test_a_message_matches_the_engine(self, client, ro):
        message = client.messages.create(model=MODEL, messages=PROMPT, max_tokens=6,
                                         extra_body={"temperature": 0})
        expected = direct(ro, PROMPT, max_tokens=6, temperature=0)
        assert (message.type, message.role, message.model) == ("message", "assistant", MODEL)
        assert [b.type for b in message.content] == ["text"]
        assert message.content[0].text == expected.text
        assert message.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[
            expected.finish_reason]
        assert message.stop_sequence is None
        assert message.usage.input_tokens + message.usage.cache_read_input_tokens \
            == expected.prompt_tokens
        assert message.usage.output_tokens == expected.completion_tokens

    def test_the_stream_sends_anthropics_events_and_the_same_message(self, client):
        kwargs = dict(model=MODEL, messages=PROMPT, max_tokens=8, extra_body={"temperature": 0})
        whole = client.messages.create(**kwargs)
        with client.messages.stream(**kwargs) as stream:
            events = list(stream)
            final = stream.get_final_message()
        kinds = [event.type for event in events]
        # The prompt's length comes first, where clients read it.
        start = events[0].message.usage
        assert start.input_tokens + start.cache_read_input_tokens == \
            whole.usage.input_tokens + whole.usage.cache_read_input_tokens
        assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
        assert kinds[1] == "content_block_start" and kinds[-3] == "content_block_stop"
        assert kinds.count("content_block_delta") >= 1
        assert final.content[0].text == whole.content[0].text
        assert (final.stop_reason, final.usage.output_tokens) == (
            whole.stop_reason, whole.usage.output_tokens)

    def test_system_as_text_or_blocks_reaches_the_template_alike(self, client, ro):
        kwargs = dict(model=MODEL, messages=PROMPT, max_tokens=1, extra_body={"temperature": 0})
        system = "You write Python."
        as_text = client.messages.create(**kwargs, system=system)
        # Claude Code's attribution line is a label that changes per call, not a prompt.
        as_blocks = client.messages.create(**kwargs, system=[
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1; cch=1f;"},
            {"type": "text", "text": "You write ", "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "Python."}])
        expected = direct(ro, [{"role": "system", "content": system}, *PROMPT],
                          max_tokens=1, temperature=0)
        for message in (as_text, as_blocks):
            assert message.usage.input_tokens + message.usage.cache_read_input_tokens \
                == expected.prompt_tokens

    def test_a_stop_sequence_cuts_the_text_and_is_named(self, client, ro):
        free = direct(ro, PROMPT, max_tokens=12, temperature=0)
        stop = free.text[3:5]
        assert len(stop) == 2 and stop not in free.text[:4], "the model's text gives no stop"
        for stream in (False, True):
            kwargs = dict(model=MODEL, messages=PROMPT, max_tokens=12,
                          extra_body={"temperature": 0}, stop_sequences=["never there", stop])
            if stream:
                with client.messages.stream(**kwargs) as events:
                    message = events.get_final_message()
            else:
                message = client.messages.create(**kwargs)
            assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", stop)
            assert message.content[0].text == free.text[:free.text.index(stop)]

    def test_count_tokens_is_the_prompt_the_engine_reads(self, client):
        kwargs = dict(model=MODEL, messages=PROMPT, system="be brief", tools=[ADD])
        counted = client.messages.count_tokens(**kwargs)
        message = client.messages.create(**kwargs, max_tokens=1, extra_body={"temperature": 0})
        assert counted.input_tokens == message.usage.input_tokens \
            + message.usage.cache_read_input_tokens > 0

    # --- tools ----------------------------------------------------------------------------

    @pytest.mark.parametrize("stream", [False, True])
    def test_a_forced_tool_call_and_its_result_round_trip(self, client, stream):
        kwargs = dict(model=MODEL, max_tokens=128, tools=[ADD])
        asked = [{"role": "user", "content": "what is 2 + 3?"}]
        if stream:
            with client.messages.stream(**kwargs, messages=asked,
                                        tool_choice={"type": "tool", "name": "add"}) as s:
                kinds = [(e.type, getattr(getattr(e, "delta", None), "type", None))
                         for e in s]
                first = s.get_final_message()
            assert ("content_block_delta", "input_json_delta") in kinds
        else:
            first = client.messages.create(**kwargs, messages=asked,
                                           tool_choice={"type": "tool", "name": "add"})
        assert first.stop_reason == "tool_use"
        (call,) = [b for b in first.content if b.type == "tool_use"]
        assert call.name == "add" and call.id and set(call.input) == {"a", "b"}
        assert all(0 <= v <= 9 for v in call.input.values())
        history = asked + [
            {"role": "assistant", "content": [b.model_dump(exclude_none=True)
                                              for b in first.content]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": call.id,
                 "content": [{"type": "text", "text": str(sum(call.input.values()))}]},
                {"type": "text", "text": "so?"}]}]
        final = client.messages.create(**kwargs, messages=history,
                                       tool_choice={"type": "none"})
        assert final.stop_reason in ("end_turn", "max_tokens")
        assert [b.type for b in final.content] == ["text"]
        # The call and its result reached the prompt.
        assert final.usage.input_tokens + final.usage.cache_read_input_tokens > \
            first.usage.input_tokens + first.usage.cache_read_input_tokens + 10

    # --- what harnesses send ---------------------------------------------------------------

    def test_what_claude_code_sends_is_taken(self, server):
        """Fields a harness adds that change nothing for this model are taken: metadata,
        cache_control, thinking, output_config.effort, context edits of thinking blocks,
        Anthropic's server tools, thinking blocks sent back."""
        status, body = http(f"{server.url}/v1/messages", {
            "model": MODEL, "max_tokens": 4096, "temperature": 1, "stream": False,
            "system": [{"type": "text", "text": "You are a coding agent.",
                        "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": [
                             {"type": "text", "text": "hi",
                              "cache_control": {"type": "ephemeral"}}]},
                         {"role": "assistant", "content": [
                             {"type": "thinking", "thinking": "greet back", "signature": "s"},
                             {"type": "text", "text": "Hello."}]},
                         {"role": "user", "content": "What is 2+2?"}],
            "tools": [{**ADD, "cache_control": {"type": "ephemeral"}},
                      {"type": "web_search_20250305", "name": "web_search", "max_uses": 5}],
            "metadata": {"user_id": "user_abc_account__session_123"},
            "thinking": {"type": "enabled", "budget_tokens": 1024},
            "output_config": {"effort": "medium"},
            "context_management": {"edits": [{"type": "clear_thinking_20251015",
                                               "keep": "all"}]}})
        assert status == 200, body
        assert body["type"] == "message" and body["stop_reason"] in (
            "end_turn", "max_tokens", "tool_use")
        assert not [b for b in body["content"] if b["type"] == "thinking"]

    # --- errors ---------------------------------------------------------------------------

    @pytest.mark.parametrize("extra, param", [
        ({"temprature": 0.5}, "temprature"),
        ({"top_k": -3}, "top_k"),
        ({"stop_sequences": "END"}, "stop_sequences"),
        ({"thinking": {"type": "enabled", "budget_tokens": 10}}, "thinking.budget_tokens"),
        ({"context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}},
         "context_management.edits[0].type"),
        ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "tools[0].type"),
        ({"tools": [{"name": "f", "input_schema": {"type": "object"}, "x": 1}]}, "tools[0].x"),
        ({"messages": [{"role": "user", "content": [{"type": "document"}]}]},
         "messages[0].content[0].type"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
            "type": "url", "url": "https://example.com/a.png"}}]}]},
         "messages[0].content[0].source"),
        ({"output_config": {"format": {"type": "json_schema"}}}, "output_config.format"),
    ])
    def test_a_bad_field_is_a_400_in_anthropics_shape_naming_it(self, server, extra, param):
        status, body = http(f"{server.url}/v1/messages", {
            "model": MODEL, "messages": PROMPT, "max_tokens": 4, **extra})
        assert status == 400, body
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        assert body["error"]["message"].startswith(f"{param}:"), body

    def test_the_sdk_raises_typed_errors(self, client, server):
        import anthropic

        with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
            client.messages.create(model=MODEL, messages=PROMPT, max_tokens=0)
        with pytest.raises(anthropic.NotFoundError, match="not served here"):
            client.messages.create(model="claude-opus-9", messages=PROMPT, max_tokens=4)
        wrong = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
        with pytest.raises(anthropic.AuthenticationError):
            wrong.messages.create(model=MODEL, messages=PROMPT, max_tokens=4)
        # The key as a bearer token (ANTHROPIC_AUTH_TOKEN) is taken too.
        bearer = anthropic.Anthropic(base_url=server.url, auth_token=KEY, api_key=None,
                                     max_retries=0)
        assert bearer.messages.create(model=MODEL, messages=PROMPT, max_tokens=1).content

    def test_output_config_format_holds_the_answer_to_a_schema(self, client):
        import jsonschema

        schema = {"type": "object", "properties": {"n": {"type": "integer"}},
                  "required": ["n"], "additionalProperties": False}
        message = client.messages.create(
            model=MODEL, messages=PROMPT, max_tokens=64, extra_body={"temperature": 1.0},
            output_config={"format": {"type": "json_schema", "schema": schema}})
        assert message.stop_reason == "end_turn"
        jsonschema.validate(json.loads(message.content[0].text), schema)
