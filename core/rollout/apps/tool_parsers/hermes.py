"""Hermes-style tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
one block per call, anywhere in the text (Qwen, Hermes and this project's tiny model)."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

from rollout.contract.schemas import Tool
from rollout.apps.tool_parsers import ParsedMessage, ToolCallError, make_call
from rollout.apps.tool_parsers.strict import loads

OPEN, CLOSE = "<tool_call>", "</tool_call>"
BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(" + re.escape(CLOSE) + r"|$)", re.DOTALL)


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
        for block in BLOCK.finditer(text):
            kept.append(text[start:block.start()])
            start = block.end()
            reason = self._read(block, tools)
            if isinstance(reason, str):
                errors.append(ToolCallError(block.group(0), reason))
                kept.append(block.group(0))
            else:
                calls.append(reason)
        content = ("".join(kept) + text[start:]).strip() if calls or errors else text
        return ParsedMessage(content, tuple(calls), tuple(errors))

    @staticmethod
    def _read(block: re.Match, tools: Sequence[Tool] | None):
        """The call in one block, or why it is none."""
        if not block.group(2):
            return f"{OPEN} is never closed"
        try:
            data = loads(block.group(1))
        except ValueError as exc:
            return f"not valid JSON: {exc}"
        return make_call(data, tools)
