"""Environments: where the first messages come from, what answers the model's turns, when
an episode is done and what it earned. Tools alone need no class of their own
(`Environment(tools=[...])`); a task that needs more subclasses `Environment`.

Environments and tools are found by name through the entry-point groups
`rollout.environments` and `rollout.tools`, or given as `module:object`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from rollout.contract.errors import InvalidRequestError
from rollout.contract.schemas import Message
from rollout.apps.agents.tools import FunctionTool, function_tool

ENVIRONMENTS = "rollout.environments"
TOOLS = "rollout.tools"


@attrs.frozen
class Reply:
    """The environment's answer to an assistant turn that called no tool."""

    messages: tuple[Message, ...] = attrs.field(default=(), converter=tuple)
    done: bool = False
    reward: float | None = None


class Environment:
    """The default answers a final answer (a turn without tool calls) by ending the episode,
    with `reward_fn(row, messages)` as its reward when one is given. Every method may be a
    coroutine."""

    def __init__(self, tools: Sequence[Callable | FunctionTool] = (),
                 reward_fn: Callable[[dict, list[Message]], float] | None = None):
        self.tools = [function_tool(t) for t in tools]
        self.reward_fn = reward_fn

    def start(self, row: dict) -> list[Message | dict]:
        """The first messages, from a dataset row: its `messages`, or its `prompt` (a text
        as a user turn, or a list of messages)."""
        prompt = row.get("messages") if row.get("messages") is not None else row.get("prompt")
        if isinstance(prompt, str):
            return [{"role": "user", "content": prompt}]
        if isinstance(prompt, (list, tuple)):
            return [{k: v for k, v in m.items() if v is not None} if isinstance(m, dict)
                    else m for m in prompt]
        raise InvalidRequestError("row", "has neither messages nor a prompt",
                                  "a row with `messages` or `prompt`")

    def respond(self, row: dict, messages: list[Message]) -> Reply:
        """After an assistant turn without tool calls (the last of `messages`)."""
        reward = None if self.reward_fn is None else self.reward_fn(row, messages)
        return Reply(done=True, reward=reward)

    def sampling(self, row: dict, turn: int, messages: list[Message]) -> dict | None:
        """Sampling fields for this turn over the runner's (say a constraint that forces
        a format); None keeps them."""
        return None


def load_environment(spec: str, **options: Any) -> Environment:
    """An environment by entry-point name or `module:object` (a class, called with
    `options`, or an instance)."""
    found = _load(spec, ENVIRONMENTS, "environment")
    return found(**options) if isinstance(found, type) else found


def load_tool(spec: str) -> FunctionTool:
    """A tool by entry-point name or `module:function`."""
    return function_tool(_load(spec, TOOLS, "tool"))


def _load(spec: str, group: str, what: str):
    from rollout.contract.plugins import installed, load_one

    if ":" in spec:
        module, _, name = spec.partition(":")
        try:
            value = importlib.import_module(module)
            for part in name.split("."):
                value = getattr(value, part)
        except (ImportError, AttributeError) as exc:
            raise InvalidRequestError(what, f"cannot load {spec!r}: {exc}",
                                      "module:object, importable here") from None
        return value
    found = installed(group)
    if spec not in found:
        raise InvalidRequestError(what, f"no {what} named {spec!r}",
                                  ", ".join(found) or f"module:object (no {what} installed)")
    return load_one(what, spec, found[spec])
