"""`ReplicaPool`: one `Service` over several replicas, balanced by least requests in flight.

A request goes to the healthy replica with the fewest requests in flight, and the count
drops as soon as that request finishes, so replicas stuck on long responses get fewer new
ones. The requests of one session (`Request.session_id`) go to the replica its first
request went to, while that replica is healthy, so later turns reuse its prefix cache.
Each replica takes at most `max_in_flight` requests; the rest wait here for the first free
slot. A health monitor takes a replica out of rotation when its process dies or it stops
answering; its requests in flight are sent again to a healthy replica (a stream only if it
has yielded nothing yet: tokens already given out cannot be taken back). With none left,
calls fail with NoReplicaError.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Protocol

from rollout.contract.errors import EngineDeadError, NoReplicaError, RolloutError
from rollout.contract.schemas import Chunk, Completion, Request
from rollout.apps.serving.client import ReplicaDown, RemoteService

MAX_SESSIONS = 100_000  # sessions remembered (least recently used forgotten first)
MAX_SENDS = 3  # a request that took down this many replicas fails instead of another
HEALTH_STRIKES = 2  # failed health checks in a row before a running replica is taken out


class ReplicaProcess(Protocol):
    def alive(self) -> bool: ...

    def stop(self) -> None: ...


class Replica:
    def __init__(self, service: RemoteService, process: ReplicaProcess | None = None):
        self.service = service
        self.process = process
        self.in_flight = 0
        self.healthy = True
        self.down_reason = ""
        self.failed_checks = 0
        self.calls: set = set()  # its requests' futures and streams; cancelled if it dies


class ReplicaPool:
    def __init__(self, replicas: list[Replica], name: str, max_in_flight: int = 64,
                 health_interval: float = 1.0):
        self.replicas = replicas
        self.name = name
        self.max_in_flight = max_in_flight
        self.health_interval = health_interval
        self._changed: asyncio.Condition | None = None
        self._monitor: asyncio.Task | None = None
        self._sessions: OrderedDict[str, Replica] = OrderedDict()  # session id -> replica

    async def start(self) -> ReplicaPool:
        self._changed = asyncio.Condition()
        self._monitor = asyncio.create_task(self._watch())
        return self

    # --- requests ---------------------------------------------------------------------

    async def generate(self, request: Request) -> Completion:
        for _ in range(MAX_SENDS):
            replica = await self._acquire(request.session_id)
            call = asyncio.ensure_future(replica.service.generate(request))
            replica.calls.add(call)
            try:
                await asyncio.wait({call})
            finally:
                replica.calls.discard(call)
                call.cancel()
                await self._release(replica)
            if call.cancelled():  # its replica was taken out of rotation
                continue
            try:
                return call.result()
            except ReplicaDown as exc:
                await self._take_out(replica, str(exc))
            except RolloutError as exc:
                return Completion(request.id, error=exc)
        return Completion(request.id, error=EngineDeadError(
            f"the replicas serving this request stopped {MAX_SENDS} times"))

    def stream(self, request: Request) -> PoolStream:
        return PoolStream(self, request)

    async def _acquire(self, session: str | None = None) -> Replica:
        """The session's replica while it is healthy; else the healthy replica with the
        fewest requests in flight (which a new session is pinned to)."""
        async with self._changed:
            while True:
                up = [r for r in self.replicas if r.healthy]
                if not up:
                    raise NoReplicaError(self._no_replica_message())
                pinned = self._sessions.get(session) if session else None
                if pinned is not None and pinned.healthy:
                    self._sessions.move_to_end(session)
                    choices = [pinned]
                else:
                    choices = up
                free = [r for r in choices if r.in_flight < self.max_in_flight]
                if free:
                    best = min(free, key=lambda r: r.in_flight)
                    best.in_flight += 1
                    if session and best is not pinned:
                        self._sessions[session] = best
                        if len(self._sessions) > MAX_SESSIONS:
                            self._sessions.popitem(last=False)  # the least recently used
                    return best
                await self._changed.wait()

    async def _release(self, replica: Replica) -> None:
        async with self._changed:
            replica.in_flight -= 1
            self._changed.notify()

    def _no_replica_message(self) -> str:
        reasons = "; ".join(f"{r.service.url}: {r.down_reason}" for r in self.replicas)
        return f"no healthy replica left ({reasons})"

    # --- health -----------------------------------------------------------------------

    async def _take_out(self, replica: Replica, reason: str) -> None:
        async with self._changed:
            if replica.healthy:
                replica.healthy = False
                replica.down_reason = reason
                for call in list(replica.calls):  # sent again by their callers
                    call.cancel()
            self._changed.notify_all()

    async def _put_back(self, replica: Replica) -> None:
        async with self._changed:
            replica.healthy, replica.down_reason = True, ""
            self._changed.notify_all()

    async def _check(self, replica: Replica) -> None:
        if replica.process is not None and not await asyncio.to_thread(replica.process.alive):
            await self._take_out(replica, "its process exited")
            return
        try:
            await replica.service.health()
        except RolloutError as exc:
            replica.failed_checks += 1
            if replica.failed_checks >= HEALTH_STRIKES:
                await self._take_out(replica, str(exc))
        else:
            replica.failed_checks = 0
            if not replica.healthy:
                await self._put_back(replica)

    async def _watch(self) -> None:
        while True:
            await asyncio.gather(*(self._check(r) for r in self.replicas))
            await asyncio.sleep(self.health_interval)

    async def health(self) -> dict:
        states = [{"url": r.service.url, "healthy": r.healthy, "in_flight": r.in_flight,
                   **({"down": r.down_reason} if not r.healthy else {})}
                  for r in self.replicas]
        if not any(r.healthy for r in self.replicas):
            raise NoReplicaError(self._no_replica_message())
        return {"replicas": states, "healthy": sum(r.healthy for r in self.replicas)}

    async def close(self, stop_replicas: bool = True) -> None:
        if self._monitor is not None:
            self._monitor.cancel()
        for replica in self.replicas:
            await replica.service.close()
            if stop_replicas and replica.process is not None:
                await asyncio.to_thread(replica.process.stop)


class PoolStream:
    """One request streamed from a replica of the pool, chunk by chunk as the replica makes
    them. A replica that fails before the first chunk is taken out and the request goes to
    another; one that fails later fails the request with EngineDeadError."""

    def __init__(self, pool: ReplicaPool, request: Request):
        self.pool = pool
        self.request = request
        self.completion: Completion | None = None
        self._chunks_iter: AsyncIterator[Chunk] | None = None

    def __aiter__(self) -> AsyncIterator[Chunk]:
        self._chunks_iter = self._chunks()
        return self._chunks_iter

    async def _chunks(self) -> AsyncIterator[Chunk]:
        pool, yielded = self.pool, False
        for _ in range(MAX_SENDS):
            replica = await pool._acquire(self.request.session_id)
            stream = replica.service.stream(self.request)
            replica.calls.add(stream)
            try:
                async for chunk in stream:
                    yielded = True
                    yield chunk
                self.completion = stream.completion
                return
            except ReplicaDown as exc:
                await pool._take_out(replica, str(exc))
                if yielded:
                    raise EngineDeadError(f"the replica serving this stream stopped: {exc}") \
                        from None
            finally:
                replica.calls.discard(stream)
                await stream.aclose()
                await pool._release(replica)
        raise EngineDeadError(f"the replicas serving this request stopped {MAX_SENDS} times")

    async def aclose(self) -> None:
        if self._chunks_iter is not None:
            await self._chunks_iter.aclose()
