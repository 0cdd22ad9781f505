"""A weight update's protocol and its checks: what the trainer's side calls on a service
(begin, one message per bucket, end), and the fields it may carry. Light: no torch."""

from __future__ import annotations

from typing import Protocol

from rollout.contract.errors import InvalidRequestError
from rollout.lifecycle import PAUSES  # what a weight update does to running requests
BUCKET_WAIT_S = 120.0  # the longest a backend waits for a trainer's next bucket
# nccl: GPUs on both sides; cuda_ipc: one GPU shared with an engine (neither run on CPU CI)
TRANSPORTS = ("shm", "gloo", "nccl", "cuda_ipc")
# what a trainer may ask for: "auto" is shm where every receiver is on the trainer's node,
# gloo otherwise
CHOICES = ("auto",) + TRANSPORTS
GROUP_FIELDS = ("host", "port", "name", "world_size", "first_rank", "backend")


class WeightUpdate(Protocol):
    """One update in progress on a service."""

    receivers: int  # the ranks it brings to a collective group
    nodes: frozenset[str]  # where its receivers run (rollout.weights.transports.nodes)

    async def join(self, group: dict) -> None:
        """Join the trainer's group (`GROUP_FIELDS`) from rank `first_rank` on."""

    async def send(self, message: dict) -> None:
        """Load one bucket (a `ShmSender.put` message, or a layout whose bytes the
        trainer broadcasts in the group); returns when the bytes are here."""

    async def end(self) -> int | None:
        """Finish; returns the new weight version. Raises what failed the update."""

    async def cancel(self, reason: str) -> None:
        """Give up: the backend is left dirty until a full update succeeds."""


def check_group(group) -> dict:
    """A `group` step's body, checked: it names where the trainer's store listens."""
    if not isinstance(group, dict) or set(group) - set(GROUP_FIELDS) - {"update"}:
        raise InvalidRequestError("group", f"got {group!r:.120}",
                                  "an object with " + ", ".join(GROUP_FIELDS))
    for field in GROUP_FIELDS:
        value = group.get(field)
        kind = str if field in ("host", "name", "backend") else int
        if not isinstance(value, kind) or isinstance(value, bool) or (
                kind is int and value < (1 if field == "world_size" else 0)):
            raise InvalidRequestError(f"group.{field}", f"got {value!r}",
                                      "a string" if kind is str else "an integer >= 0")
    return {field: group[field] for field in GROUP_FIELDS}


def check_update(version, pause) -> None:
    """A weight update's version and pause, checked before anything moves."""
    if version is not None and (not isinstance(version, int) or isinstance(version, bool)):
        raise InvalidRequestError("version", f"got {version!r}", "an integer or null")
    if pause not in PAUSES:
        raise InvalidRequestError("pause", f"got {pause!r}", ", ".join(PAUSES))


def check_adapter(adapter) -> dict | None:
    """An update's `adapter`: the LoRA adapter it loads instead of the weights, as
    {name, config} (its LoraConfig as a dict); None for the weights."""
    if adapter is None:
        return None
    if not isinstance(adapter, dict) or set(adapter) - {"name", "config"}:
        raise InvalidRequestError("adapter", f"got {adapter!r:.120}",
                                  "an object with name and config")
    name, config = adapter.get("name"), adapter.get("config")
    if not isinstance(name, str) or not name:
        raise InvalidRequestError("adapter.name", f"got {name!r}", "a non-empty string")
    if not isinstance(config, dict):
        raise InvalidRequestError("adapter.config", f"got {config!r:.120}",
                                  "a LoraConfig as an object (r, lora_alpha, ...)")
    return {"name": name, "config": config}


def check_update_options(version, pause, timeout=BUCKET_WAIT_S) -> None:
    check_update(version, pause)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise InvalidRequestError("timeout", f"got {timeout!r}", "seconds > 0")
