"""`Service`: what the server, the replica pool and the batch job take requests from, one
request per call; `LocalService`, a `Rollout` of this process behind it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Protocol

from rollout.api import Rollout
from rollout.contract.schemas import Chunk, Completion, Request
from rollout.apps.serving.weights import LocalUpdate, WeightUpdate


class ChunkStream(Protocol):
    """`async for` gives a request's chunks; then `completion` holds the whole of it.
    `aclose()` stops the request if it still runs."""

    completion: Completion | None

    def __aiter__(self) -> AsyncIterator[Chunk]: ...

    async def aclose(self) -> None: ...


class Service(Protocol):
    name: str  # the model name that the server reports

    async def generate(self, request: Request) -> Completion:
        """The request's Completion, with its own error in it. Raises only when nothing can
        be served (EngineDeadError, NoReplicaError)."""

    def stream(self, request: Request) -> ChunkStream:
        """The request's chunks as they come; its own error is raised from the iteration."""

    async def health(self) -> dict:
        """What is up; raises when nothing is."""

    async def release(self, tags: list[str] | None) -> None: ...

    async def resume(self, tags: list[str] | None) -> None: ...

    async def begin_update(self, version: int | None, pause: str,
                           timeout: float) -> WeightUpdate:
        """Start a weight update (see `rollout.apps.serving.weights`); `timeout`: the
        longest wait for the trainer's next bucket before the update fails."""

    async def close(self) -> None: ...


class LocalService:
    """A Rollout in this process: every request goes straight to its engine loop."""

    def __init__(self, rollout: Rollout, name: str):
        self.rollout = rollout
        self.name = name

    async def generate(self, request: Request) -> Completion:
        return await self.rollout.agenerate(request)

    def stream(self, request: Request) -> ChunkStream:
        return self.rollout.stream(request)

    async def health(self) -> dict:
        # Off the loop: a backend's stats may ask its engine (vLLM's server: its /metrics).
        return await asyncio.to_thread(self.rollout.health)

    async def release(self, tags: list[str] | None) -> None:
        await asyncio.to_thread(self.rollout.release, tags)

    async def resume(self, tags: list[str] | None) -> None:
        await asyncio.to_thread(self.rollout.resume, tags)

    async def begin_update(self, version: int | None, pause: str,
                           timeout: float) -> WeightUpdate:
        return LocalUpdate(self.rollout, version, pause, timeout)

    async def close(self) -> None:
        await asyncio.to_thread(self.rollout.close)
