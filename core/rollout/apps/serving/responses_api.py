"""OpenAI's Responses API (`/v1/responses`) over the chat machinery: a call's input items,
instructions and tools become a chat call (the same template, tool parsers and
constraints), and its answer becomes output items. `previous_response_id` continues the
conversation of a response kept in a bounded store of recent ones.
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from collections.abc import Collection
from typing import Any

from rollout.contract.schemas import Completion, Result
from rollout.apps.serving.openai_api import UNSUPPORTED_FIELDS, ApiError, OverChat, _short, \
    bad_field, chosen_adapter
from rollout.apps.serving.openai_api import _check_fields as check_fields

STORE_SIZE = 1000  # responses kept for previous_response_id; the oldest goes first
FIELDS = ("model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls",
          "temperature", "top_p", "max_output_tokens", "stream", "previous_response_id",
          "store", "text", "include", "truncation", "seed", "top_k", "stop",
          "repetition_penalty", "presence_penalty", "frequency_penalty", "min_p",
          "ignore_eos", "logit_bias", "structured_outputs", "reasoning", "client_metadata")
# Taken through to the chat call under the same name.
PASSED = ("temperature", "top_p", "parallel_tool_calls", "seed", "top_k", "stop",
          "repetition_penalty", "presence_penalty", "frequency_penalty", "min_p",
          "ignore_eos", "logit_bias", "structured_outputs")
REFUSED = {
    "conversation": ((None,), "conversations are not stored here; send previous_response_id "
                              "or the whole input"),
    "prompt": ((None,), "stored prompts are not supported"),
    "background": ((None, False), "background responses are not supported"),
    "context_management": ((None,), "not supported"),
    "max_tool_calls": ((None,), "not supported; use tool_choice and parallel_tool_calls"),
    "top_logprobs": ((None, 0), "logprobs are not offered on /v1/responses; use "
                                "/v1/chat/completions"),
}


# What a harness sends for a reasoning model, which changes nothing for one without
# reasoning (docs/serving.md): checked, then taken.
REASONING = {"effort": (None, "none", "minimal", "low", "medium", "high", "xhigh"),
             "summary": (None, "auto", "concise", "detailed"),
             "generate_summary": (None, "auto", "concise", "detailed")}
VERBOSITY = (None, "low", "medium", "high")
# `include` asks for extra output: of reasoning items and of tools run elsewhere, none is
# ever made here, so there is nothing to include; logprobs are not offered on this route.
INCLUDABLE = ("reasoning.encrypted_content", "web_search_call.action.sources",
              "web_search_call.results", "file_search_call.results",
              "code_interpreter_call.outputs", "computer_call_output.output.image_url",
              "message.input_image.image_url")
# Tools that OpenAI's servers run, and Codex's namespaces of tools: a harness offers them
# for OpenAI's models; the model served here is not offered them (docs/serving.md).
NOT_OFFERED_TOOLS = ("web_search", "web_search_preview", "file_search", "code_interpreter",
                     "image_generation", "mcp", "namespace")


class ResponseStore:
    """The last `size` responses: their conversation (for previous_response_id) and
    their body (for GET /v1/responses/{id}). The least recently stored goes first."""

    def __init__(self, size: int = STORE_SIZE):
        self.size = size
        self._kept: OrderedDict[str, tuple[list[dict], dict]] = OrderedDict()

    def put(self, response_id: str, messages: list[dict], body: dict) -> None:
        self._kept[response_id] = (messages, body)
        while len(self._kept) > self.size:
            self._kept.popitem(last=False)

    def get(self, response_id: Any, param: str = "previous_response_id"
            ) -> tuple[list[dict], dict]:
        if not isinstance(response_id, str) or response_id not in self._kept:
            raise ApiError(404, f"response {_short(response_id)} is not stored here: unknown, "
                           "stored with store=false, or evicted (this server keeps the last "
                           f"{self.size} responses); send the whole conversation as input",
                           param=param, code="previous_response_not_found")
        return self._kept[response_id]


class ResponsesCall(OverChat):
    """One /v1/responses call: the chat call it runs as, and its answer as a response."""

    renames = ((r"^messages", "input"), (r"^max_tokens", "max_output_tokens"),
               (r"^response_format", "text.format"),
               (r"^tools\[(\d+)\]\.function", r"tools[\1]"))

    def __init__(self, body: Any, model_name: str, tool_parser: str, store: ResponseStore,
                 adapters: Collection[str] = ()):
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object")
        _check_fields(body)
        adapter = chosen_adapter(body, model_name, adapters)
        self.body = body
        self.store = store
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.stream = bool(body.get("stream"))
        earlier = []
        if body.get("previous_response_id") is not None:
            earlier = list(store.get(body["previous_response_id"])[0])
        self.history = earlier + _messages(body.get("input"))
        instructions = body.get("instructions")
        if instructions is not None and not isinstance(instructions, str):
            raise bad_field("instructions", f"got {_short(instructions)}", "a string")
        system = [{"role": "system", "content": instructions}] if instructions else []
        chat = {"model": adapter or model_name, "messages": system + self.history,
                **{k: body[k] for k in PASSED if body.get(k) is not None}}
        if body.get("max_output_tokens") is not None:
            chat["max_tokens"] = body["max_output_tokens"]
        tools = _tools(body["tools"]) if body.get("tools") is not None else []
        if tools:
            chat["tools"] = tools
        choice = body.get("tool_choice")
        if choice is not None and (tools or choice not in ("auto", "none")):
            chat["tool_choice"] = _tool_choice(choice)  # (auto among no tools: none)
        fmt = _format(body.get("text"))
        if fmt is not None:
            chat["response_format"] = fmt
        self.run_as(chat, model_name, tool_parser, adapters)

    # --- the answer ---------------------------------------------------------------------

    def response(self, completion: Completion, message_id: str | None = None) -> dict:
        """The response object for the finished request (stored unless store=false);
        `message_id`: its message item's id, where a stream has given it already."""
        self.check(completion)
        (result,) = completion.results
        message, finish_reason = self.chat.tools.message(result)
        body = self.skeleton("incomplete" if finish_reason == "length" else "completed")
        body["output"] = self.items(message, message_id)
        if finish_reason == "length":
            body["incomplete_details"] = {"reason": "max_output_tokens"}
        if message.get("tool_call_errors"):  # extension: why text is no tool call
            body["tool_call_errors"] = message["tool_call_errors"]
        body["usage"] = _usage(result)
        if self.body.get("store") is not False:
            answer = {k: v for k, v in message.items() if k in ("role", "content", "tool_calls")}
            self.store.put(self.id, self.history + [answer], body)
        return body

    def skeleton(self, status: str) -> dict:
        b = self.body
        return {"id": self.id, "object": "response", "created_at": self.created,
                "status": status, "model": self.chat.model, "output": [],
                "error": None, "incomplete_details": None,
                "instructions": b.get("instructions"),
                "previous_response_id": b.get("previous_response_id"),
                "tools": b.get("tools") or [], "tool_choice": b.get("tool_choice", "auto"),
                "parallel_tool_calls": b.get("parallel_tool_calls", True),
                "temperature": b.get("temperature"), "top_p": b.get("top_p"),
                "max_output_tokens": b.get("max_output_tokens"),
                "text": b.get("text") or {"format": {"type": "text"}},
                "truncation": b.get("truncation") or "disabled",
                "store": b.get("store") is not False, "metadata": b.get("metadata") or {},
                "usage": None}

    def items(self, message: dict, message_id: str | None = None) -> list[dict]:
        items = []
        if message.get("content"):
            items.append(message_item(message["content"], item_id=message_id))
        for call in message.get("tool_calls") or ():
            items.append({"type": "function_call", "id": f"fc_{uuid.uuid4().hex}",
                          "call_id": call["id"], "name": call["function"]["name"],
                          "arguments": call["function"]["arguments"], "status": "completed"})
        return items


def message_item(text: str, status: str = "completed", item_id: str | None = None) -> dict:
    return {"type": "message", "id": item_id or f"msg_{uuid.uuid4().hex}", "status": status,
            "role": "assistant", "content": [output_text(text)]}


def output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": []}


def _usage(result: Result) -> dict:
    return {"input_tokens": result.prompt_tokens,
            "input_tokens_details": {"cached_tokens": result.cached_tokens or 0},
            "output_tokens": result.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": result.prompt_tokens + result.completion_tokens}


# --- the call's fields, as a chat call's ---------------------------------------------------


def _check_fields(body: dict) -> None:
    check_fields(body, FIELDS, {**UNSUPPORTED_FIELDS, **REFUSED})
    include = body.get("include")
    if include is not None and (not isinstance(include, list) or not all(
            i in INCLUDABLE for i in include)):
        raise bad_field("include", f"got {_short(include)}: no other extra output is "
                        "offered (logprobs are on /v1/chat/completions)",
                        "a list of " + ", ".join(INCLUDABLE))
    reasoning = body.get("reasoning")
    if reasoning is not None and (not isinstance(reasoning, dict) or any(
            reasoning.get(k) not in REASONING.get(k, ()) for k in reasoning)):
        raise bad_field("reasoning", f"got {_short(reasoning)}", "an object with " + "; ".join(
            f"{k}: {', '.join(map(str, v[1:]))}" for k, v in REASONING.items()))
    metadata = body.get("client_metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise bad_field("client_metadata", f"got {_short(metadata)}", "an object")
    if body.get("truncation") not in (None, "disabled"):
        raise bad_field("truncation", f"got {_short(body['truncation'])}: a prompt too long "
                        "for the model is refused, not cut", "disabled")


def _messages(given: Any) -> list[dict]:
    """Input items as chat messages: messages, function calls (joined into the assistant
    turn before them) and their outputs."""
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    if not isinstance(given, list) or not given:
        raise bad_field("input", "missing" if given is None else f"got {_short(given)}",
                        "a string, or a non-empty list of input items")
    messages: list[dict] = []
    for i, item in enumerate(given):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            messages.append(_message(item, where))
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":
                messages.append(last := {"role": "assistant", "content": None})
            last.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = item.get("output")
            if isinstance(output, list):  # parts: their text
                output = "".join(p.get("text", "") for p in output if isinstance(p, dict))
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": output})
        else:
            raise bad_field(f"{where}.type", f"got {_short(kind)}",
                            "message, function_call, function_call_output")
    return messages


def _message(item: dict, where: str) -> dict:
    role = {"developer": "system"}.get(item.get("role"), item.get("role"))
    content = item.get("content")
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in ("input_text", "output_text", "text"):
                parts.append({"type": "text", "text": part.get("text")})
            elif kind == "input_image":
                parts.append({"type": "image_url", "image_url": {"url": part.get("image_url")}})
            elif kind == "refusal":
                parts.append({"type": "text", "text": part.get("refusal")})
            else:
                raise bad_field(f"{where}.content[{j}].type", f"got {_short(kind)}",
                                "input_text, output_text, input_image")
        content = parts if any(p["type"] == "image_url" for p in parts) else \
            "".join(p["text"] or "" for p in parts)
    return {"role": role, "content": content}


def _tools(tools: Any) -> list[dict]:
    """Responses function tools (flat) as chat tools (nested under `function`)."""
    if not isinstance(tools, list):
        raise bad_field("tools", f"got {_short(tools)}", "a list of function tools")
    out = []
    for i, tool in enumerate(tools):
        if isinstance(tool, dict) and tool.get("type") in NOT_OFFERED_TOOLS:
            continue
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise bad_field(f"tools[{i}]", f"got {_short(tool)}: only function tools are "
                            "served here", '{"type": "function", "name", "parameters"}, or '
                            "one of " + ", ".join(NOT_OFFERED_TOOLS) + " (not offered)")
        function = {k: v for k, v in tool.items() if k != "type"}
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _format(text: Any) -> dict | None:
    """`text.format` as chat's response_format."""
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, dict) else None
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"} or \
            text.get("verbosity") not in VERBOSITY:
        raise bad_field("text", f"got {_short(text)}", '{"format": {...}}')
    if fmt is None:
        return None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        schema = {k: fmt.get(k) for k in ("name", "schema", "strict") if k in fmt}
        return {"type": "json_schema", "json_schema": {k: v for k, v in schema.items()
                                                       if k != "strict"}}
    return fmt  # text, json_object (or what chat's check refuses)
