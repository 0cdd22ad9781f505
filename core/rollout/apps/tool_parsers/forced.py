"""`tool_choice` "required" or a named tool, enforced by a JSON-schema constraint.

"required": the sample is a JSON array of `{"name", "parameters"}` objects, one per call,
each valid against its tool's schema; a named tool: the sample is that tool's arguments.
Both parse without a model-specific format, so they hold for any model.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from rollout.contract.schemas import StructuredOutputs, Tool, ToolCall
from rollout.apps.tool_parsers import ParsedMessage, ToolCallError, make_call, new_call_id


def required_constraint(tools: Sequence[Tool], parallel: bool = True) -> StructuredOutputs:
    call = [{"type": "object", "properties": {"name": {"const": t.name},
                                              "parameters": t.parameters},
             "required": ["name", "parameters"], "additionalProperties": False}
            for t in tools]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": call}}
    if not parallel:
        schema["maxItems"] = 1
    return StructuredOutputs(json=schema)


def named_constraint(tool: Tool) -> StructuredOutputs:
    return StructuredOutputs(json=tool.parameters)


def parse_required(text: str, tools: Sequence[Tool]) -> ParsedMessage:
    try:
        data = json.loads(text)
    except ValueError as exc:  # cut short by max_tokens
        return ParsedMessage(text, errors=(ToolCallError(text, f"not valid JSON: {exc}"),))
    if not isinstance(data, list):
        return ParsedMessage(text, errors=(ToolCallError(text, "not a list of calls"),))
    calls, errors = [], []
    for item in data:
        call = make_call(item, tools, arguments_key="parameters")
        if isinstance(call, str):
            errors.append(ToolCallError(json.dumps(item), call))
        else:
            calls.append(call)
    return ParsedMessage("", tuple(calls), tuple(errors))


def parse_named(text: str, tool: Tool) -> ParsedMessage:
    try:
        arguments = json.loads(text)
    except ValueError as exc:
        return ParsedMessage(text, errors=(ToolCallError(text, f"not valid JSON: {exc}"),))
    if not isinstance(arguments, dict):
        return ParsedMessage(text, errors=(ToolCallError(text, "arguments are not an object"),))
    call = ToolCall(id=new_call_id(), name=tool.name,
                    arguments=json.dumps(arguments, ensure_ascii=False))
    return ParsedMessage("", (call,))
