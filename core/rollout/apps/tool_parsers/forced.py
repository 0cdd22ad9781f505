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
from rollout.apps.tool_parsers.strict import loads


def required_constraint(tools: Sequence[Tool], parallel: bool = True) -> StructuredOutputs:
    defs, call = {}, []
    for i, t in enumerate(tools):
        parameters = t.parameters
        if _has_ref(parameters):
            # Its `$ref`s point into its own schema: it moves under the array's $defs,
            # and they follow it there.
            defs[f"tool{i}"] = _moved(parameters, f"#/$defs/tool{i}")
            parameters = {"$ref": f"#/$defs/tool{i}"}
        call.append({"type": "object", "properties": {"name": {"const": t.name},
                                                      "parameters": parameters},
                     "required": ["name", "parameters"], "additionalProperties": False})
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": call}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return StructuredOutputs(json=schema)


def _has_ref(node) -> bool:
    if isinstance(node, dict):
        return "$ref" in node or any(_has_ref(v) for v in node.values())
    return isinstance(node, list) and any(_has_ref(v) for v in node)


def _moved(node, base: str):
    """`node` with its local `$ref`s ("#", "#/...") rebased at `base`."""
    if isinstance(node, list):
        return [_moved(v, base) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: _moved(v, base) for k, v in node.items()}
    ref = node.get("$ref")
    if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
        out["$ref"] = base + ref[1:]
    return out


def named_constraint(tool: Tool) -> StructuredOutputs:
    return StructuredOutputs(json=tool.parameters)


def parse_required(text: str, tools: Sequence[Tool]) -> ParsedMessage:
    try:
        data = loads(text)
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
        arguments = loads(text)
    except ValueError as exc:
        return ParsedMessage(text, errors=(ToolCallError(text, f"not valid JSON: {exc}"),))
    if not isinstance(arguments, dict):
        return ParsedMessage(text, errors=(ToolCallError(text, "arguments are not an object"),))
    call = ToolCall(id=new_call_id(), name=tool.name,
                    arguments=json.dumps(arguments, ensure_ascii=False))
    return ParsedMessage("", (call,))
