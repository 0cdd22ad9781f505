"""Hermes-style tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
one block per call, anywhere in the text (Qwen, Hermes and this project's tiny model)."""

from __future__ import annotations

import json
from collections.abc import Sequence

from rollout.contract.schemas import Tool
from rollout.apps.tool_parsers import ParsedMessage, ToolCallError, make_call
from rollout.apps.tool_parsers.strict import loads

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_JSON = json.JSONDecoder(strict=False)  # a raw control character in a string: itself


class HermesParser:
    def constraint(self, tools: Sequence[Tool], held: Sequence[bool], choice: str = "auto",
                   parallel: bool = True) -> dict:
        """The structural tag that holds calls to `tools` in this format, as vLLM's server
        builds it for this parser: under `choice` "auto" free text, and a call after each
        `<tool_call>`; under "required" one call or more and nothing else; under "named"
        (`tools` is that one tool) one call. `parallel` False: the first call ends the
        sample. A call's arguments hold to its tool's schema where `held`, else are any JSON."""
        tags = [{"type": "tag", "begin": f'{OPEN}{newline}{{"name": {json.dumps(t.name)}, '
                                         '"arguments": ',
                 "content": {"type": "json_schema",
                             "json_schema": t.parameters if holds else True},
                 "end": f"}}{newline}{CLOSE}"}
                for t, holds in zip(tools, held) for newline in ("\n", "")]
        if choice == "auto":
            calls = {"type": "triggered_tags", "triggers": [OPEN], "tags": tags}
        else:
            calls = {"type": "tags_with_separator", "tags": tags, "separator": "",
                     "at_least_one": True}
        if choice == "named" or not parallel:
            calls["stop_after_first"] = True
        return {"type": "structural_tag", "format": calls}

    def parse(self, text: str, tools: Sequence[Tool] | None) -> ParsedMessage:
        """Calls, and the rest as content: the text around the blocks, and blocks that are
        no call (each also in `errors`, with why) where they stand."""
        calls, errors, kept, start = [], [], [], 0
        for begin, end, body, closed in _blocks(text):
            kept.append(text[start:begin])
            start = end
            reason = _read(body, closed, tools)
            if isinstance(reason, str):
                errors.append(ToolCallError(text[begin:end], reason))
                kept.append(text[begin:end])
            else:
                calls.append(reason)
        content = ("".join(kept) + text[start:]).strip() if calls or errors else text
        return ParsedMessage(content, tuple(calls), tuple(errors))


def _blocks(text: str):
    """(start, end, body, closed) of each block. A block's JSON is read whole first, so a
    string in it that holds the closing tag does not end it; text that is no JSON value
    before a closing tag ends at the first closing tag (or at the end: never closed)."""
    at = 0
    while (begin := text.find(OPEN, at)) >= 0:
        inner = begin + len(OPEN)
        close = _closing_after_json(text, inner)
        if close is None:
            close = text.find(CLOSE, inner)
        if close < 0:
            yield begin, len(text), text[inner:], False
            return
        yield begin, close + len(CLOSE), text[inner:close], True
        at = close + len(CLOSE)


def _closing_after_json(text: str, at: int) -> int | None:
    """Where the closing tag starts, if one JSON value (with blank space around it) runs
    from `at` up to it."""
    start = len(text) - len(text[at:].lstrip())
    try:
        end = _JSON.raw_decode(text, start)[1]
    except ValueError:
        return None
    close = len(text) - len(text[end:].lstrip())
    return close if text.startswith(CLOSE, close) else None


def _read(body: str, closed: bool, tools: Sequence[Tool] | None):
    """The call in one block, or why it is none."""
    if not closed:
        return f"{OPEN} is never closed"
    try:
        data = loads(body)
    except ValueError as exc:
        return f"not valid JSON: {exc}"
    return make_call(data, tools)
