"""`Service`: what the server, the replica pool and the batch job take requests from, one
request per call; `LocalService`, a `Rollout` of this process behind it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterable
from contextvars import ContextVar
from typing import Protocol

from rollout.api import Rollout
from rollout.front import aborted_completion
from rollout.contract.sampler import ChunkStream
from rollout.contract.schemas import Capabilities, Chunk, Completion, Request
from rollout.service.admission import UNBOUNDED, Gate, Limits
from rollout.weights.receive import LocalUpdate
from rollout.weights.update import WeightUpdate


CALL: ContextVar[str | None] = ContextVar("rollout_call", default=None)
"""The id that a sampler gives each of its calls, carried with the call's request through
pools and servers (over HTTP, in the X-Rollout-Call header) to the service that runs it:
an abort that names the call stops the request even if the abort arrives first."""

STOPPED_CALL_KEEP_S = 600.0  # how long an abort waits for a request that never came


class Service(Protocol):
    name: str  # the model name that the server reports

    async def generate(self, request: Request) -> Completion:
        """The request's Completion, with its own error in it. Raises only when nothing can
        be served (EngineDeadError, NoReplicaError)."""

    def stream(self, request: Request) -> ChunkStream:
        """The request's chunks as they come; its own error is raised from the iteration."""

    async def capabilities(self) -> Capabilities:
        """What the backend behind it supports."""

    async def abort(self, request_ids: list[str], calls: Iterable[str] = ()) -> None:
        """Stop these requests where they run; each returns what it made, with finish
        reason "abort". Ids not running (not yet, or no longer) are ignored; a request of
        one of `calls` (see CALL) that has not arrived yet is stopped when it does."""

    async def health(self) -> dict:
        """What is up; raises when nothing is."""

    async def release(self, tags: list[str] | None) -> None: ...

    async def resume(self, tags: list[str] | None) -> None: ...

    async def begin_update(self, version: int | None, pause: str, timeout: float,
                           adapter: dict | None = None) -> WeightUpdate:
        """Start a weight update (see `rollout.weights`); `timeout`: the
        longest wait for the trainer's next bucket before the update fails. With `adapter`
        ({name, config}), the update loads that LoRA adapter instead of the weights."""

    async def unload_adapter(self, name: str) -> None:
        """Unload LoRA adapter `name`; InvalidRequestError where none has that name."""

    def adapters(self) -> dict[str, int | None]:
        """The LoRA adapters loaded, with their versions."""

    def state(self) -> dict:
        """What the metrics read, without waiting: requests `running` and `waiting`,
        `weight_version`, `weights_dirty`, and `replicas` (each with `replica`, `healthy`,
        `restarts`, `running`)."""

    async def close(self) -> None: ...


class LocalService:
    """A Rollout in this process: every request goes straight to its engine loop, once
    `limits` give it a turn (by default none are set: the caller bounds what it sends)."""

    def __init__(self, rollout: Rollout, name: str, limits: Limits = UNBOUNDED):
        self.rollout = rollout
        self.encoder = rollout.encoder  # the server's sessions continue prompts with it
        self.name = name
        self.gate = Gate(limits)
        self.stopped = StoppedCalls()

    async def generate(self, request: Request) -> Completion:
        call = CALL.get()
        async with self.gate.turn():
            # An abort that came before named the call; one from now on finds the id
            # (the rollout registers the request at once).
            if self.stopped.take(call):
                return aborted_completion(request)
            return await self.rollout.agenerate(request)

    def stream(self, request: Request) -> ChunkStream:
        call = CALL.get()
        return GatedStream(self.gate, self.rollout.stream(request), request,
                           lambda: self.stopped.take(call))

    def state(self) -> dict:
        return {"running": self.gate.running, "waiting": self.gate.waiting,
                "weight_version": self.rollout.weight_version,
                "weights_dirty": self.rollout.weights_dirty, "replicas": []}

    async def capabilities(self) -> Capabilities:
        return self.rollout.capabilities

    async def abort(self, request_ids: list[str], calls: Iterable[str] = ()) -> None:
        self.stopped.add(calls)
        self.rollout.abort(request_ids)

    async def health(self) -> dict:
        # Off the loop: a backend's stats may ask its engine (vLLM's server: its /metrics).
        return await asyncio.to_thread(self.rollout.health)

    async def release(self, tags: list[str] | None) -> None:
        await asyncio.to_thread(self.rollout.release, tags)

    async def resume(self, tags: list[str] | None) -> None:
        await asyncio.to_thread(self.rollout.resume, tags)

    async def begin_update(self, version: int | None, pause: str, timeout: float,
                           adapter: dict | None = None) -> WeightUpdate:
        return LocalUpdate(self.rollout, version, pause, timeout, adapter)

    async def unload_adapter(self, name: str) -> None:
        await asyncio.to_thread(self.rollout.unload_adapter, name)

    def adapters(self) -> dict[str, int | None]:
        return dict(self.rollout.adapters)

    async def close(self) -> None:
        await asyncio.to_thread(self.rollout.close)


class WrappedStream:
    """A stream around another: its chunks pass through `_chunks`; `completion` and
    `aclose` are the inner stream's."""

    def __init__(self, stream: ChunkStream):
        self.stream = stream
        self._chunks_iter = None

    @property
    def completion(self) -> Completion | None:
        return self.stream.completion

    def __aiter__(self) -> AsyncIterator[Chunk]:
        self._chunks_iter = self._chunks()
        return self._chunks_iter

    async def _chunks(self) -> AsyncIterator[Chunk]:
        async for chunk in self.stream:
            yield chunk

    async def aclose(self) -> None:
        await self.stream.aclose()
        if self._chunks_iter is not None:
            await self._chunks_iter.aclose()


class GatedStream(WrappedStream):
    """A stream that waits for a turn at the gate before its first chunk, and holds the
    turn until it ends; one `stopped` by then ends at once, aborted."""

    def __init__(self, gate: Gate, stream: ChunkStream, request: Request,
                 stopped: Callable[[], bool]):
        super().__init__(stream)
        self.gate, self.request, self.stopped = gate, request, stopped
        self._aborted: Completion | None = None

    @property
    def completion(self) -> Completion | None:
        return self._aborted or self.stream.completion

    async def _chunks(self) -> AsyncIterator[Chunk]:
        async with self.gate.turn():
            # The inner stream registers its request on its first step, right below.
            if self.stopped():
                self._aborted = aborted_completion(self.request)
                return
            async for chunk in self.stream:
                yield chunk


class StoppedCalls:
    """Calls aborted by their id (CALL), each kept until its request comes, for at most
    STOPPED_CALL_KEEP_S: an abort may overtake its request on the way to the server."""

    def __init__(self):
        self._until: dict[str, float] = {}  # in the order added, so by deadline

    def add(self, calls: Iterable[str]) -> None:
        now = time.monotonic()
        while self._until and next(iter(self._until.values())) <= now:
            del self._until[next(iter(self._until))]
        for call in calls:
            self._until.pop(call, None)  # (to the end)
            self._until[call] = now + STOPPED_CALL_KEEP_S

    def take(self, call: str | None) -> bool:
        return call is not None and self._until.pop(call, None) is not None
