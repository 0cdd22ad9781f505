"""Hermes-style tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
one block per call, anywhere in the text (Qwen, Hermes and this project's tiny model)."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

from rollout.contract.schemas import Tool
from rollout.apps.tool_parsers import ParsedMessage, ToolCallError, make_call

OPEN, CLOSE = "<tool_call>", "</tool_call>"
BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(" + re.escape(CLOSE) + r"|$)", re.DOTALL)


class HermesParser:
    def strict_constraint(self, tools: Sequence[Tool], strict: Sequence[bool]) -> dict:
        """Free text; after each `<tool_call>` a call of one of `tools` in this format, its
        arguments valid against the tool's schema where the tool is strict (any object
        otherwise)."""
        tags = [{"type": "tag",
                 "begin": f'{OPEN}\n{{"name": {json.dumps(t.name)}, "arguments": ',
                 "content": {"type": "json_schema",
                             "json_schema": t.parameters if is_strict else {"type": "object"}},
                 "end": f"}}\n{CLOSE}"} for t, is_strict in zip(tools, strict)]
        return {"type": "structural_tag",
                "format": {"type": "triggered_tags", "triggers": [OPEN], "tags": tags}}

    def parse(self, text: str, tools: Sequence[Tool] | None) -> ParsedMessage:
        calls, errors = [], []
        for block in BLOCK.finditer(text):
            if not block.group(2):
                errors.append(ToolCallError(block.group(0), f"{OPEN} is never closed"))
                continue
            try:
                data = json.loads(block.group(1))
            except ValueError as exc:
                errors.append(ToolCallError(block.group(0), f"not valid JSON: {exc}"))
                continue
            call = make_call(data, tools)
            if isinstance(call, str):
                errors.append(ToolCallError(block.group(0), call))
            else:
                calls.append(call)
        content = BLOCK.sub("", text).strip() if calls or errors else text
        return ParsedMessage(content, tuple(calls), tuple(errors))
