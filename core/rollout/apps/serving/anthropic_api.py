"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`) over the chat
machinery: a call's system prompt, content blocks and tools become a chat call (the same
template, tool parsers and constraints), and its answer becomes content blocks, a
`stop_reason` and, when streamed, Anthropic's event sequence.

What a harness sends that changes nothing here is taken and documented in
docs/serving.md (`metadata`, `cache_control`, `thinking` on a model without thinking,
Anthropic's server tools); what would change sampling and cannot be honoured is refused,
naming the field.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Collection
from typing import Any

import attrs

from rollout.contract.schemas import Completion, Result
from rollout.apps.serving.openai_api import ApiError, OverChat, _short, bad_field, \
    weight_spans

FIELDS = ("model", "messages", "max_tokens", "system", "stop_sequences", "stream",
          "temperature", "top_p", "top_k", "tools", "tool_choice", "metadata", "thinking",
          "output_config", "context_management", "cache_control")
COUNT_FIELDS = ("model", "messages", "system", "tools", "tool_choice", "thinking",
                "output_config", "context_management", "cache_control")
# Only label or route a call at Anthropic: taken on both routes, each checked for its
# type. (`cache_control`, above, changes nothing either: the prefix cache is automatic.)
LABELS = {"service_tier": ("auto", "standard_only"), "speed": ("standard", "fast"),
          "inference_geo": str, "user_profile_id": str, "workspace_id": str}
METADATA_FIELDS = ("user_id",)
REFUSED = {"container": "code execution containers are not offered here",
           "mcp_servers": "MCP servers are not called by this server; give their tools "
                          "as client tools",
           "diagnostics": "cache diagnostics are not offered here"}
THINKING_TYPES = ("enabled", "disabled", "adaptive")
EFFORTS = ("low", "medium", "high", "xhigh", "max")
# Context edits that change nothing for a model that writes no thinking blocks: thinking
# blocks sent back are never rendered here.
CONTEXT_EDITS = ("clear_thinking_20251015",)
BLOCK_FIELDS = {
    "text": {"type", "text", "cache_control", "citations"},
    "image": {"type", "source", "cache_control"},
    "tool_use": {"type", "id", "name", "input", "cache_control"},
    "tool_result": {"type", "tool_use_id", "content", "is_error", "cache_control"},
    "thinking": {"type", "thinking", "signature"},
    "redacted_thinking": {"type", "data"},
    # In a tool search's result: the deferred tool it names is offered from then on.
    "tool_reference": {"type", "tool_name"},
}
TOOL_FIELDS = ("type", "name", "description", "input_schema", "cache_control", "strict",
               "defer_loading")
# Tools that Anthropic's servers run (web search and fetch, code execution): a harness
# offers them for Claude; a model served here is not offered them (docs/serving.md).
SERVER_TOOL = re.compile(r"(web_search|web_fetch|code_execution)_\d{8}$")
# Claude Code's attribution line, with a hash that changes every call: a label, not a
# prompt (as vLLM's server, which leaves it out so that the prefix cache holds).
BILLING_HEADER = "x-anthropic-billing-header"
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 413: "request_too_large",
               429: "rate_limit_error", 529: "overloaded_error"}


def error_body(error: ApiError) -> dict:
    """An error in Anthropic's shape (the SDKs read `error.type` and `error.message`)."""
    kind = ERROR_TYPES.get(error.status, "api_error" if error.status >= 500 else
                           "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


class MessagesCall(OverChat):
    """One /v1/messages call: the chat call it runs as, and its answer as a message.
    `count`: a count_tokens call (its fields, and one token made to read the prompt's
    length from the engine)."""

    renames = ((r"^stop\b", "stop_sequences"), (r"^response_format", "output_config.format"),
               (r"^tools\[(\d+)\]\.function\.parameters", r"tools[\1].input_schema"),
               (r"^tools\[(\d+)\]\.function", r"tools[\1]"))

    def __init__(self, body: Any, model_name: str, tool_parser: str,
                 adapters: Collection[str] = (), count: bool = False):
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object")
        _check_fields(body, COUNT_FIELDS if count else FIELDS)
        self.body = body
        self.id = f"msg_{uuid.uuid4().hex}"
        self.stream = not count and _flag(body, "stream")
        self.stops = _stop_sequences(body.get("stop_sequences"))
        chat: dict[str, Any] = {"model": body.get("model"),
                                "messages": _system(body.get("system"))
                                + _messages(body.get("messages"))}
        if count:
            chat["max_tokens"] = 1
        else:
            max_tokens = body.get("max_tokens")
            if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) \
                    or max_tokens < 1:
                raise bad_field("max_tokens", "missing" if max_tokens is None else
                                f"got {_short(max_tokens)}", "an integer >= 1")
            chat["max_tokens"] = max_tokens
            chat.update({k: body[k] for k in ("temperature", "top_p", "top_k")
                         if body.get(k) is not None})
        if self.stops:
            # The matched sequence is read off the text's end, then cut (stop_sequence).
            chat.update(stop=self.stops, include_stop_str_in_output=True)
        _thinking(body.get("thinking"), chat["max_tokens"] if not count else None)
        fmt = _output_config(body.get("output_config"))
        if fmt is not None:
            chat["response_format"] = fmt
        _context_management(body.get("context_management"))
        tools = _tools(body.get("tools"), _referenced(body.get("messages")))
        if tools:
            chat["tools"] = tools
        chat.update(_tool_choice(body.get("tool_choice"), tools))
        self.run_as(chat, model_name, tool_parser, adapters)
        self.model = self.chat.model

    # --- the answer ---------------------------------------------------------------------

    def content(self, completion: Completion) -> tuple[list[dict], str | None, str | None,
                                                       Result]:
        """(content blocks, stop_reason, stop_sequence, result) of the finished call."""
        self.check(completion)
        result, stop = self.cut_stop(completion.results[0])
        message, finish_reason = self.chat.tools.message(result)
        blocks = [{"type": "text", "text": message["content"]}] if message["content"] else []
        for call in message.get("tool_calls", ()):
            blocks.append({"type": "tool_use", "id": call["id"],
                           "name": call["function"]["name"],
                           "input": json.loads(call["function"]["arguments"])})
        return blocks, _stop_reason(finish_reason, stop, blocks), stop, result

    def cut_stop(self, result: Result) -> tuple[Result, str | None]:
        """The result without the stop sequence it ended on, and that sequence."""
        if result.finish_reason == "stop":
            for stop in self.stops:
                if result.text.endswith(stop):
                    return attrs.evolve(result, text=result.text[:-len(stop)]), stop
        return result, None

    def answer(self, result: Result):
        return self.chat.answer(self.cut_stop(result)[0])

    def message(self, completion: Completion) -> dict:
        blocks, reason, stop, result = self.content(completion)
        # An empty answer is one empty text block, as Anthropic's own (clients read
        # content[0]).
        return {**self.skeleton(), "content": blocks or [{"type": "text", "text": ""}],
                "stop_reason": reason, "stop_sequence": stop, "usage": usage(result),
                "weight_versions": weight_spans(result)}

    def skeleton(self, prompt_tokens: int = 0, cached: int = 0) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "content": [],
                "model": self.model, "stop_reason": None, "stop_sequence": None,
                "usage": {"input_tokens": prompt_tokens - cached, "output_tokens": 0,
                          "cache_read_input_tokens": cached,
                          "cache_creation_input_tokens": 0}}

    @property
    def streams_text(self) -> bool:
        """Whether text goes out as it is made (no tool calls to read from it)."""
        return self.chat.tools.mode == "none"

    @property
    def held_back(self) -> int:
        """Characters a stream keeps back while they may begin a stop sequence."""
        return max(map(len, self.stops), default=0)


def _stop_reason(finish_reason: str, stop: str | None, blocks: list[dict]) -> str | None:
    """As Anthropic's: a cut answer is `max_tokens`; any call, forced or not, `tool_use`.
    An aborted one has none."""
    if finish_reason == "length":
        return "max_tokens"
    if finish_reason == "abort":
        return None
    if stop is not None:
        return "stop_sequence"
    return "tool_use" if any(b["type"] == "tool_use" for b in blocks) else "end_turn"


def usage(result: Result) -> dict:
    """As Anthropic counts: input_tokens leaves out what the prefix cache gave."""
    cached = result.cached_tokens or 0
    return {"input_tokens": result.prompt_tokens - cached, "output_tokens":
            result.completion_tokens, "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": 0}


def events(call: MessagesCall, completion: Completion, streamed: int) -> list[tuple[str, dict]]:
    """The events that end a stream: the rest of the text (after the `streamed`
    characters sent as they came), each tool call, `message_delta` and `message_stop`."""
    blocks, reason, stop, result = call.content(completion)
    out: list[tuple[str, dict]] = []
    index = 0
    for block in blocks:
        if block["type"] == "text":
            rest = block["text"][streamed:]
            if not streamed:
                out.append(block_start(index, {"type": "text", "text": ""}))
            if rest:
                out.append(delta(index, {"type": "text_delta", "text": rest}))
        else:
            out.append(block_start(index, {**block, "input": {}}))
            out.append(delta(index, {"type": "input_json_delta",
                                     "partial_json": json.dumps(block["input"])}))
        out.append(("content_block_stop", {"type": "content_block_stop", "index": index}))
        index += 1
    out.append(("message_delta", {"type": "message_delta", "delta": {
        "stop_reason": reason, "stop_sequence": stop}, "usage": usage(result),
        "weight_versions": weight_spans(result)}))
    out.append(("message_stop", {"type": "message_stop"}))
    return out


def block_start(index: int, block: dict) -> tuple[str, dict]:
    return "content_block_start", {"type": "content_block_start", "index": index,
                                   "content_block": block}


def delta(index: int, change: dict) -> tuple[str, dict]:
    return "content_block_delta", {"type": "content_block_delta", "index": index,
                                   "delta": change}


# --- the call's fields, as a chat call's ---------------------------------------------------


def _check_fields(body: dict, fields: tuple[str, ...]) -> None:
    for name, value in body.items():
        if name in LABELS:
            allowed = LABELS[name]
            if not (isinstance(value, str) if allowed is str else value in allowed):
                raise bad_field(name, f"got {_short(value)}",
                                "a string" if allowed is str else ", ".join(allowed))
        elif name in REFUSED:
            if value is not None:
                raise bad_field(name, REFUSED[name], "left out")
        elif name not in fields:
            why = "not taken by count_tokens" if name in FIELDS else "unknown field"
            raise bad_field(name, why, ", ".join([*fields, *LABELS]))
    metadata = body.get("metadata")
    if metadata is not None and (not isinstance(metadata, dict)
                                 or set(metadata) - set(METADATA_FIELDS)):
        raise bad_field("metadata", f"got {_short(metadata)}", '{"user_id": "..."}')
    control = body.get("cache_control")
    if control is not None and (not isinstance(control, dict) or control.get("type")
                                != "ephemeral"):
        raise bad_field("cache_control", f"got {_short(control)}", '{"type": "ephemeral"}')


def _flag(body: dict, name: str) -> bool:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise bad_field(name, f"got {_short(value)}", "true or false")
    return bool(value)


def _stop_sequences(given: Any) -> list[str]:
    if given is None:
        return []
    if not isinstance(given, list) or not all(isinstance(s, str) and s for s in given):
        raise bad_field("stop_sequences", f"got {_short(given)}", "a list of non-empty strings")
    return given


def _system(system: Any, where: str = "system") -> list[dict]:
    """`system`, a string or text blocks, as one system message (none if empty)."""
    if system is None or system == "":
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": system}]
    if not isinstance(system, list):
        raise bad_field(where, f"got {_short(system)}", "a string, or a list of text blocks")
    texts = []
    for i, block in enumerate(system):
        _check_block(block, f"{where}[{i}]", ("text",))
        if not block["text"].startswith(BILLING_HEADER):
            texts.append(block["text"])
    return [{"role": "system", "content": "".join(texts)}] if texts else []


def _messages(given: Any) -> list[dict]:
    if not isinstance(given, list) or not given:
        raise bad_field("messages", "missing" if given is None else f"got {_short(given)}",
                        "a non-empty list of messages")
    out: list[dict] = []
    for i, message in enumerate(given):
        where = f"messages[{i}]"
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ("user", "assistant", "system") or set(message) - {"role", "content"}:
            raise bad_field(where, f"got {_short(message)}",
                            '{"role": "user", "assistant" or "system", "content"}')
        content = message.get("content")
        if role == "system":  # where Claude Code puts its context: a system message there
            out.extend(_system(content, f"{where}.content"))
        elif isinstance(content, str):
            out.append({"role": role, "content": content})
        elif isinstance(content, list):
            out.extend(_user_turn(content, where) if role == "user"
                       else [_assistant_turn(content, where)])
        else:
            raise bad_field(f"{where}.content", f"got {_short(content)}",
                            "a string, or a list of content blocks")
    return out


def _user_turn(blocks: list, where: str) -> list[dict]:
    """A user turn's blocks, in order: each tool result a tool message, the text and
    images between them user messages."""
    out: list[dict] = []
    parts: list[dict] = []
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        kind = _check_block(block, at, ("text", "image", "tool_result"))
        if kind == "tool_result":
            if parts:
                out.append({"role": "user", "content": parts})
                parts = []
            out.extend(_tool_result(block, at))
        elif kind == "image" or block["text"]:  # (empty text left out, as vLLM's server)
            parts.append(_part(block, at))
    if parts:
        out.append({"role": "user", "content": parts})
    return out


def _assistant_turn(blocks: list, where: str) -> dict:
    """An assistant turn: its text, and its tool_use blocks as tool calls. Thinking blocks
    are left out, as Anthropic's API leaves earlier turns' thinking out of the context."""
    texts: list[str] = []
    calls: list[dict] = []
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        kind = _check_block(block, at, ("text", "tool_use", "thinking", "redacted_thinking"))
        if kind == "text" and block["text"]:  # (empty ones left out, as vLLM's server)
            texts.append(block["text"])
        elif kind == "tool_use":
            if not isinstance(block.get("input"), dict) or not isinstance(block.get("name"), str):
                raise bad_field(at, f"got {_short(block)}",
                                '{"type": "tool_use", "id", "name", "input": {...}}')
            calls.append({"id": block.get("id"), "type": "function", "function": {
                "name": block["name"], "arguments": json.dumps(block["input"])}})
    # Joined by newlines, as a user turn's text parts (and as vLLM's server joins them).
    message: dict = {"role": "assistant", "content": "\n".join(texts)}
    if calls:
        message["tool_calls"] = calls
    return message


def _tool_result(block: dict, where: str) -> list[dict]:
    """A tool message with the result's text; its images follow in a user message (chat
    templates take images from users only)."""
    content = block.get("content")
    images: list[dict] = []
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    elif isinstance(content, list):
        texts = []
        for k, part in enumerate(content):
            at = f"{where}.content[{k}]"
            kind = _check_block(part, at, ("text", "image", "tool_reference"))
            if kind == "text":
                texts.append(part["text"])
            elif kind == "image":
                images.append(_part(part, at))
        text = "\n".join(texts)
    else:
        raise bad_field(f"{where}.content", f"got {_short(content)}",
                        "a string, or a list of text and image blocks")
    if not isinstance(block.get("tool_use_id"), str):
        raise bad_field(f"{where}.tool_use_id", f"got {_short(block.get('tool_use_id'))}",
                        "the id of the tool_use block it answers")
    out = [{"role": "tool", "tool_call_id": block["tool_use_id"], "content": text}]
    if images:
        out.append({"role": "user", "content": images})
    return out


def _check_block(block: Any, where: str, kinds: tuple[str, ...]) -> str:
    kind = block.get("type") if isinstance(block, dict) else None
    if kind not in kinds:
        raise bad_field(f"{where}.type", f"got {_short(kind)}", ", ".join(kinds))
    extra = sorted(set(block) - BLOCK_FIELDS[kind])
    if extra:
        raise bad_field(f"{where}.{extra[0]}", "unknown field",
                        ", ".join(sorted(BLOCK_FIELDS[kind])))
    if kind == "text" and not isinstance(block.get("text"), str):
        raise bad_field(f"{where}.text", f"got {_short(block.get('text'))}", "a string")
    if kind == "text" and block.get("citations"):
        raise bad_field(f"{where}.citations", "citations are not supported", "null or []")
    return kind


def _part(block: dict, where: str) -> dict:
    """A text or image block as a chat content part (images as data: URLs)."""
    if block["type"] == "text":
        return {"type": "text", "text": block["text"]}
    source = block.get("source")
    if not isinstance(source, dict) or source.get("type") != "base64" or not all(
            isinstance(source.get(k), str) for k in ("media_type", "data")):
        raise bad_field(f"{where}.source", f"got {_short(source)}", '{"type": "base64", '
                        '"media_type", "data"} (images are not fetched from URLs)')
    return {"type": "image_url",
            "image_url": {"url": f"data:{source['media_type']};base64,{source['data']}"}}


def _referenced(messages: Any) -> set[str]:
    """The tools that tool_reference blocks in tool results name."""
    names = set()
    for message in messages if isinstance(messages, list) else ():
        content = message.get("content") if isinstance(message, dict) else None
        for block in content if isinstance(content, list) else ():
            if isinstance(block, dict) and block.get("type") == "tool_result" \
                    and isinstance(block.get("content"), list):
                names.update(p.get("tool_name") for p in block["content"]
                             if isinstance(p, dict) and p.get("type") == "tool_reference")
    return names


def _tools(given: Any, referenced: set[str] = frozenset()) -> list[dict]:
    """Client tools as chat function tools. As Anthropic's: a tool with `defer_loading`
    is offered only once a tool search's result names it; server tools are left out."""
    if given is None:
        return []
    if not isinstance(given, list):
        raise bad_field("tools", f"got {_short(given)}", "a list of tools")
    out = []
    for i, tool in enumerate(given):
        kind = tool.get("type", "custom") if isinstance(tool, dict) else None
        if isinstance(kind, str) and SERVER_TOOL.match(kind):
            continue
        if kind != "custom":
            raise bad_field(f"tools[{i}].type", f"got {_short(kind)}", 'custom (or left '
                            'out), or a server tool: web_search_*, web_fetch_*, '
                            'code_execution_*')
        extra = sorted(set(tool) - set(TOOL_FIELDS))
        if extra:
            raise bad_field(f"tools[{i}].{extra[0]}", "unknown field", ", ".join(TOOL_FIELDS))
        deferred = tool.get("defer_loading")
        if deferred is not None and not isinstance(deferred, bool):
            raise bad_field(f"tools[{i}].defer_loading", f"got {_short(deferred)}",
                            "true or false")
        if deferred and tool.get("name") not in referenced:
            continue
        function = {"name": tool.get("name"), "parameters": tool.get("input_schema")}
        for key in ("description", "strict"):
            if tool.get(key) is not None:
                function[key] = tool[key]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: Any, tools: list[dict]) -> dict:
    """`tool_choice` as chat's tool_choice and parallel_tool_calls."""
    if choice is None:
        return {}
    kind = choice.get("type") if isinstance(choice, dict) else None
    allowed = '{"type": "auto", "any", "tool" (with "name") or "none"}, and ' \
              '"disable_parallel_tool_use"'
    if kind not in ("auto", "any", "tool", "none") or \
            set(choice) - {"type", "name", "disable_parallel_tool_use"}:
        raise bad_field("tool_choice", f"got {_short(choice)}", allowed)
    parallel = choice.get("disable_parallel_tool_use")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad_field("tool_choice.disable_parallel_tool_use", f"got {_short(parallel)}",
                        "true or false")
    if kind in ("auto", "none") and not tools:
        return {}  # (auto among no tools, say only server tools: none)
    out: dict = {"tool_choice": {"any": "required"}.get(kind, kind)}
    if kind == "tool":
        out["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
    if parallel is not None and kind != "none":
        out["parallel_tool_calls"] = not parallel
    return out


def _thinking(thinking: Any, max_tokens: int | None) -> None:
    """Checked as Anthropic checks it. A model without thinking writes no thinking
    blocks, whatever is asked (docs/serving.md)."""
    if thinking is None:
        return
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    allowed = '{"type": "enabled", "budget_tokens": N >= 1024}, {"type": "adaptive"} or ' \
              '{"type": "disabled"}'
    if kind not in THINKING_TYPES or set(thinking) - {"type", "budget_tokens", "display"}:
        raise bad_field("thinking", f"got {_short(thinking)}", allowed)
    if kind == "enabled":
        budget = thinking.get("budget_tokens")
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1024:
            raise bad_field("thinking.budget_tokens", f"got {_short(budget)}",
                            "an integer >= 1024")
        if max_tokens is not None and budget >= max_tokens:
            raise bad_field("thinking.budget_tokens", f"got {budget}, not below max_tokens "
                            f"({max_tokens})", f"an integer from 1024 to {max_tokens - 1}")


def _output_config(config: Any) -> dict | None:
    """`output_config`: `format` (a JSON schema) as chat's response_format; `effort`
    taken, for a model without thinking it changes nothing."""
    if config is None:
        return None
    if not isinstance(config, dict) or set(config) - {"effort", "format"}:
        raise bad_field("output_config", f"got {_short(config)}", '{"effort", "format"}')
    if config.get("effort") not in (None, *EFFORTS):
        raise bad_field("output_config.effort", f"got {_short(config['effort'])}",
                        ", ".join(EFFORTS))
    fmt = config.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or \
            not isinstance(fmt.get("schema"), dict) or set(fmt) - {"type", "schema"}:
        raise bad_field("output_config.format", f"got {_short(fmt)}",
                        '{"type": "json_schema", "schema": {...}}')
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def _context_management(given: Any) -> None:
    """Context edits the server would make to the prompt: only those that change nothing
    here are taken."""
    if given is None:
        return
    edits = given.get("edits") if isinstance(given, dict) else None
    if not isinstance(edits, list) or set(given) - {"edits"}:
        raise bad_field("context_management", f"got {_short(given)}", '{"edits": [...]}')
    for i, edit in enumerate(edits):
        kind = edit.get("type") if isinstance(edit, dict) else None
        if kind not in CONTEXT_EDITS:
            raise bad_field(f"context_management.edits[{i}].type", f"got {_short(kind)}: "
                            "the prompt is not edited here; send the context to use",
                            ", ".join(CONTEXT_EDITS))
