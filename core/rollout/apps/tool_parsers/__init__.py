"""Tool-call parsers: from a model's text to the tool calls it made.

Parsers are plugins in the entry-point group `rollout.tool_parsers`, like backends; `hermes`
(`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`) ships with the core. A parser
is a class built without arguments whose `parse(text, tools)` returns a `ParsedMessage`.
Text that looks like a call but is not a valid one (bad JSON, an unknown tool, a block left
open) is reported in `errors`, never passed off as a final answer.

A parser that has a call format gives `constraint(tools, held, choice, parallel)`: the
structural tag that holds calls in that format under `tool_choice` "auto" (free text, a
call held from its opening tag on), "required" (calls only) or a named tool (one call),
as vLLM's server builds it; `held` says whose arguments hold to their schema. For a parser
without one, "required" and a named tool are a JSON constraint instead (`forced`), which
holds for any model.
"""

from __future__ import annotations

import functools
import json
import uuid
from collections.abc import Sequence
from typing import Protocol

import attrs

from rollout.contract.schemas import Tool, ToolCall

GROUP = "rollout.tool_parsers"
DEFAULT_PARSER = "hermes"


@attrs.frozen
class ToolCallError:
    text: str  # the text that looked like a call
    reason: str


@attrs.frozen
class ParsedMessage:
    """A sample's text split into what the model said and the tool calls it made."""

    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    errors: tuple[ToolCallError, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.errors


class ToolParser(Protocol):
    def parse(self, text: str, tools: Sequence[Tool] | None) -> ParsedMessage: ...

    # Optional: the structural tag (StructuredOutputs.structural_tag) that holds calls.
    # def constraint(self, tools: Sequence[Tool], held: Sequence[bool], choice: str,
    #                parallel: bool) -> dict


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def make_call(data, tools: Sequence[Tool] | None, arguments_key: str = "arguments"
              ) -> ToolCall | str:
    """A ToolCall from a decoded `{"name", arguments_key}` object, or why it is none."""
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return 'not an object with a "name"'
    names = [t.name for t in tools or ()]
    if tools is not None and data["name"] not in names:
        return f"unknown tool {data['name']!r} (tools: {', '.join(names) or 'none'})"
    arguments = data.get(arguments_key, {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments, strict=False)
        except ValueError:
            return f"{arguments_key} is not valid JSON"
    if not isinstance(arguments, dict):
        return f"{arguments_key} is not an object"
    return ToolCall(id=new_call_id(), name=data["name"],
                    arguments=json.dumps(arguments, ensure_ascii=False))


def available_tool_parsers() -> list[str]:
    from rollout.contract.plugins import installed

    return list(installed(GROUP))


def load_tool_parser(name: str = DEFAULT_PARSER) -> ToolParser:
    """The tool-call parser called `name` (InvalidRequestError if none is installed)."""
    return _parser_class(name)()


@functools.cache
def _parser_class(name: str) -> type[ToolParser]:
    """Looked up once a process: every request with tools asks for its parser, and a scan of
    the entry points reads each installed distribution's metadata from disk (under the
    soak's load, 29% of the front server's busy time before it was cached)."""
    from rollout.contract.errors import InvalidRequestError
    from rollout.contract.plugins import installed, load_one

    found = installed(GROUP)
    if name not in found:
        raise InvalidRequestError("tool_call_parser", f"no tool-call parser named {name!r}",
                                  ", ".join(found) or "none installed")
    return load_one("tool-call parser", name, found[name])
