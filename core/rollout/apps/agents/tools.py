"""Tools as plain Python functions: their JSON schema from the signature and docstring, their
arguments checked against it, each call bounded by a timeout and its result by a length.

A call never raises: every way it can go wrong is an outcome (`OUTCOMES`) with a message the
model can read, and the runner decides whether the trajectory goes on.

A tool returns text, any JSON value, or images: an image (a PIL image, `ImagePart`, or any
image source in an `ImagePart`) or a list of parts (text, images) becomes a tool message
with those parts, which a vision-language model sees.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import sys
import time
import types
import typing
from collections.abc import Callable

import attrs

from rollout.apps.tool_parsers.strict import validate
from rollout.contract.schemas import Content, ImagePart, TextPart, Tool, ToolCall

OUTCOMES = ("ok", "error", "timeout", "unknown_tool", "bad_arguments", "invalid_arguments")
_JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean",
               list: "array", dict: "object", type(None): "null"}


@attrs.frozen
class FunctionTool:
    """A function the model may call, with the schema it is shown."""

    name: str
    description: str
    parameters: dict
    fn: Callable = attrs.field(repr=False)

    @property
    def spec(self) -> Tool:
        return Tool(name=self.name, description=self.description or None,
                    parameters=self.parameters)


def function_tool(fn: Callable | FunctionTool, name: str | None = None,
                  description: str | None = None, parameters: dict | None = None
                  ) -> FunctionTool:
    """A FunctionTool from a sync or async function. Without `parameters`, the schema comes
    from the signature (annotations as JSON types; parameters without a default are
    required) and the docstring (its first paragraph describes the tool; `name: text` lines
    under `Args:` describe the parameters)."""
    if isinstance(fn, FunctionTool):
        return fn
    doc = inspect.getdoc(fn) or ""
    summary, params_doc = _read_docstring(doc)
    return FunctionTool(name=name or fn.__name__, description=description or summary,
                        parameters=parameters or _schema(fn, params_doc), fn=fn)


def _read_docstring(doc: str) -> tuple[str, dict[str, str]]:
    summary = doc.split("\n\n")[0].replace("\n", " ").strip()
    found = re.search(r"^(?:Args|Arguments|Parameters):\s*\n((?:[ \t]+.*\n?)+)", doc, re.M)
    described = {}
    for line in (found.group(1) if found else "").splitlines():
        match = re.match(r"\s*(\w+)(?:\s*\([^)]*\))?\s*:\s*(.+)", line)
        if match:
            described[match.group(1)] = match.group(2).strip()
    return summary, described


def _schema(fn: Callable, described: dict[str, str]) -> dict:
    hints = typing.get_type_hints(fn)
    properties, required = {}, []
    for param in inspect.signature(fn).parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        prop = _json_type(hints.get(param.name))
        if param.name in described:
            prop["description"] = described[param.name]
        properties[param.name] = prop
        if param.default is param.empty:
            required.append(param.name)
    return {"type": "object", "properties": properties, "required": required,
            "additionalProperties": False}


def _json_type(hint) -> dict:
    if hint is None or hint is typing.Any:
        return {}
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = [_json_type(a) for a in typing.get_args(hint)]
        return {"anyOf": options} if all(options) else {}
    if origin is typing.Literal:
        return {"enum": list(typing.get_args(hint))}
    if origin in (list, tuple, set):
        args = typing.get_args(hint)
        return {"type": "array", **({"items": _json_type(args[0])} if args else {})}
    if origin is dict:
        return {"type": "object"}
    return {"type": _JSON_TYPES[hint]} if hint in _JSON_TYPES else {}


@attrs.frozen
class ToolResult:
    """What one call came to: the tool message's content, and how it went."""

    call: ToolCall
    outcome: str  # one of OUTCOMES
    content: Content  # text, or parts when the tool returned images
    detail: str = ""
    seconds: float = 0.0
    truncated: bool = False


async def call_tool(tools: dict[str, FunctionTool], call: ToolCall, timeout: float,
                    max_chars: int | None) -> ToolResult:
    """Run one tool call; never raises (a cancellation excepted)."""
    started = time.monotonic()

    def done(outcome: str, content: Content, detail: str = "") -> ToolResult:
        content, truncated = _truncated(content, max_chars)
        return ToolResult(call, outcome, content, detail or _describe(content),
                          time.monotonic() - started, truncated)

    tool = tools.get(call.name)
    if tool is None:
        return done("unknown_tool", f"error: there is no tool named {call.name!r} "
                    f"(tools: {', '.join(tools) or 'none'})")
    try:
        arguments = json.loads(call.arguments)
    except ValueError as exc:
        return done("bad_arguments", f"error: the arguments are not valid JSON: {exc}")
    problem = validate(arguments, tool.parameters)
    if problem:
        return done("invalid_arguments", f"error: invalid arguments for {call.name}: {problem}")
    try:
        if inspect.iscoroutinefunction(tool.fn):
            value = await asyncio.wait_for(tool.fn(**arguments), timeout)
        else:  # a blocking function runs on a worker thread, never on the engine loop
            value = await asyncio.wait_for(asyncio.to_thread(tool.fn, **arguments), timeout)
    except asyncio.TimeoutError:
        return done("timeout", f"error: {call.name} did not finish within {timeout:g} s")
    except Exception as exc:  # noqa: BLE001 - the tool's failure is the model's to read
        return done("error", f"error: {call.name} raised {type(exc).__name__}: {exc}")
    return done("ok", _content(value))


def _is_image(value) -> bool:
    pil = sys.modules.get("PIL.Image")
    return isinstance(value, ImagePart) or (pil is not None and isinstance(value, pil.Image))


def _content(value) -> Content:
    """A tool's return value as message content: text, or parts where it gave images."""
    if isinstance(value, str):
        return value
    if _is_image(value):
        value = [value]
    if isinstance(value, (list, tuple)) and any(_is_image(v) for v in value):
        return tuple(v if isinstance(v, (ImagePart, TextPart)) else
                     ImagePart(v) if _is_image(v) else
                     TextPart(v if isinstance(v, str) else json.dumps(v, default=str))
                     for v in value)
    return json.dumps(value, default=str)


def _truncated(content: Content, max_chars: int | None) -> tuple[Content, bool]:
    """The content with its text cut to `max_chars` in all (images are kept), and whether
    anything was cut."""
    if max_chars is None:
        return content, False
    if isinstance(content, str):
        if len(content) <= max_chars:
            return content, False
        return (content[:max_chars]
                + f"\n[truncated: {len(content) - max_chars} more characters]"), True
    left, parts, cut = max_chars, [], False
    for part in content:
        if isinstance(part, TextPart):
            text, over = _truncated(part.text, left)
            left, cut = max(0, left - len(part.text)), cut or over
            part = TextPart(text)
        parts.append(part)
    return tuple(parts), cut


def _describe(content: Content) -> str:
    if isinstance(content, str):
        return content
    images = sum(isinstance(p, ImagePart) for p in content)
    return "".join(p.text for p in content if isinstance(p, TextPart)) + f" [{images} image(s)]"


