"""The `Service` interface that the server, the replica pool and the batch job share, and
`BackendService`, a backend of this process behind it.

A service takes requests from many callers at once. `BackendService` gathers the requests
that arrive while the backend is busy into the next `generate` call, so a backend without
continuous batching (HF) still gets full batches, and one that has it gets its requests
together.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Protocol

import attrs

from rollout.api import Rollout
from rollout.contract.errors import EngineDeadError, GenerationError, RolloutError
from rollout.contract.schemas import Completion, Request


class Service(Protocol):
    name: str  # the model name that the server reports

    async def generate(self, requests: list[Request]) -> list[Completion]:
        """One Completion per request, in order; a request's own error is in its
        Completion. Raises only when no request can be served (EngineDeadError,
        NoReplicaError)."""

    async def health(self) -> dict:
        """What is up; raises when nothing is."""

    async def close(self) -> None: ...


class BackendService:
    def __init__(self, backend: Rollout, name: str, max_batch: int = 1024,
                 batch_wait_s: float = 0.003):
        self.backend = backend
        self.name = name
        self.max_batch = max_batch
        # A backend with continuous batching takes concurrent calls; another (HF) runs one
        # call at a time, so requests wait here and go in the next call together, and an
        # idle one waits `batch_wait_s` for the rest of a burst (requests sent together
        # over HTTP arrive a little apart) before it starts.
        concurrent = backend.capabilities.concurrent_generate
        self.max_calls = 64 if concurrent else 1
        self.batch_wait_s = 0.0 if concurrent else batch_wait_s
        self._pending: list[tuple[Request, asyncio.Future]] = []
        self._calls = 0
        self._scheduled = False
        self._dead: EngineDeadError | None = None

    async def generate(self, requests: list[Request]) -> list[Completion]:
        if self._dead is not None:
            raise self._dead
        loop = asyncio.get_running_loop()
        futures = []
        for request in requests:
            # Callers pick their own ids; inside one backend call they must be unique.
            inner = attrs.evolve(request, id=uuid.uuid4().hex)
            futures.append(loop.create_future())
            self._pending.append((inner, futures[-1]))
        self._schedule(loop)
        done = await asyncio.gather(*futures)
        return [_renamed(c, r.id) for c, r in zip(done, requests)]

    def _schedule(self, loop: asyncio.AbstractEventLoop) -> None:
        # Not before this loop iteration ends: every request that arrived in it joins.
        if self._pending and self._calls < self.max_calls and not self._scheduled:
            self._scheduled = True
            if self._calls == 0 and self.batch_wait_s:
                loop.call_later(self.batch_wait_s, self._start_call, loop)
            else:
                loop.call_soon(self._start_call, loop)

    def _start_call(self, loop: asyncio.AbstractEventLoop) -> None:
        self._scheduled = False
        batch, self._pending = self._pending[:self.max_batch], self._pending[self.max_batch:]
        if batch:
            self._calls += 1
            loop.create_task(self._call(batch))

    async def _call(self, batch: list[tuple[Request, asyncio.Future]]) -> None:
        try:
            completions = await asyncio.to_thread(self.backend.generate, [r for r, _ in batch])
        except EngineDeadError as exc:
            self._dead = exc
            completions = exc
        except RolloutError as exc:
            completions = [Completion(r.id, error=exc) for r, _ in batch]
        except Exception as exc:  # noqa: BLE001 - a backend bug fails its batch, not the server
            error = GenerationError(f"backend failed: {exc!r}")
            completions = [Completion(r.id, error=error) for r, _ in batch]
        finally:
            self._calls -= 1
            self._schedule(asyncio.get_running_loop())
        for i, (_, future) in enumerate(batch):
            if future.done():
                continue
            if isinstance(completions, EngineDeadError):
                future.set_exception(completions)
            else:
                future.set_result(completions[i])
        if self._dead is not None:  # fail what was waiting for the next call too
            for _, future in self._pending:
                if not future.done():
                    future.set_exception(self._dead)
            self._pending.clear()

    async def health(self) -> dict:
        if self._dead is not None:
            raise self._dead
        return {"backend": self.backend.name, "requests_waiting": len(self._pending),
                "calls_running": self._calls}

    async def close(self) -> None:
        await asyncio.to_thread(self.backend.close)


def _renamed(completion: Completion, request_id: str) -> Completion:
    results = tuple(attrs.evolve(r, request_id=request_id) for r in completion.results)
    return attrs.evolve(completion, request_id=request_id, results=results)
