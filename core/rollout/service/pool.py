"""`ReplicaPool`: one `Service` over several replicas, balanced by least requests in flight.

A request goes to the healthy replica with the fewest requests in flight, and the count
drops as soon as that request finishes, so replicas stuck on long responses get fewer new
ones. The requests of one session (`Request.session_id`) go to the replica its first
request went to, while that replica is healthy, so later turns reuse its prefix cache.
Each replica takes at most `max_in_flight` requests; the rest wait here for the first free
slot, at most `max_waiting` of them (then OverloadedError). A health monitor
(`rollout.service.health`) takes a replica out of rotation when its process dies or it
stops answering, and has it restarted and caught up (`rollout.service.catch_up`); its
requests in flight are sent again to a healthy replica (a stream only if it has yielded
nothing yet: tokens already given out cannot be taken back). With none left, calls fail
with NoReplicaError.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterable

from rollout.contract.errors import EngineDeadError, InvalidRequestError, NoReplicaError, \
    OverloadedError, RolloutError, UnsupportedError
from rollout.contract.schemas import Capabilities, Chunk, Completion, Request
from rollout.service.admission import overloaded
from rollout.service.catch_up import CatchUp
from rollout.service.client import ReplicaDown
from rollout.service.health import HealthMonitor
from rollout.service.replica import MISSING, Replica
from rollout.weights.lora import no_such_adapter
from rollout.weights.fanout import KeptAdapter, KeptWeights, PoolUpdate

MAX_SESSIONS = 100_000  # sessions remembered (least recently used forgotten first)
MAX_SENDS = 3  # a request that took down this many replicas fails instead of another
# The longest a request waits for a replica to serve again (one restarting, or one behind
# the pool's weights) before it fails with NoReplicaError: a run rides over every replica
# being down at once. The caller's own timeout, where shorter, ends the wait first.
REPLICA_WAIT_S = 120.0


class ReplicaPool:
    def __init__(self, replicas: list[Replica], name: str, max_in_flight: int = 64,
                 health_interval: float = 1.0, keep_weights: bool = False,
                 on_close: Callable[[], None] | None = None, max_waiting: int | None = None):
        self.replicas = replicas
        self.on_close = on_close  # frees what the replicas were placed in (blocking)
        self.name = name
        self.max_in_flight = max_in_flight
        self.max_waiting = max_waiting
        self.waiting = 0  # requests waiting here for a replica's free slot
        self.monitor = HealthMonitor(self, health_interval)
        self.catch_up = CatchUp(self)
        self._changed: asyncio.Condition | None = None
        self._monitor: asyncio.Task | None = None
        self._sessions: OrderedDict[str, Replica] = OrderedDict()  # session id -> replica
        # Set by the pool's first weight update: from then on only replicas at this version
        # serve. A restarted one, at its checkpoint's weights, is brought to it from the
        # weights kept here, or (keep_weights=False) waits for the next update.
        self.weight_version: int | None = None
        self.versioned = False
        self.updates_ended = 0  # a health answer sent before an update ended is stale
        self.kept = KeptWeights() if keep_weights else None
        # LoRA adapters are always kept (megabytes): a replica that comes back gets them all.
        self.kept_adapters: dict[str, KeptAdapter] = {}
        self.updating = asyncio.Lock()  # one weight update at a time, catch-ups included

    async def start(self) -> ReplicaPool:
        self._changed = asyncio.Condition()
        self._monitor = asyncio.create_task(self.monitor.run())
        return self

    # --- requests ---------------------------------------------------------------------

    async def generate(self, request: Request) -> Completion:
        unknown = self._unknown_adapter(request)
        if unknown is not None:
            return Completion(request.id, error=unknown)
        for _ in range(MAX_SENDS):
            replica = await self._acquire(request.session_id, request.adapter)
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
                await self.take_out(replica, str(exc))
            except OverloadedError:  # the replica's own line is full (other clients)
                raise
            except RolloutError as exc:
                return Completion(request.id, error=exc)
        return Completion(request.id, error=EngineDeadError(
            f"the replicas serving this request stopped {MAX_SENDS} times"))

    def stream(self, request: Request) -> PoolStream:
        return PoolStream(self, request)

    def _unknown_adapter(self, request: Request) -> InvalidRequestError | None:
        if request.adapter is None or request.adapter in self.kept_adapters:
            return None
        return no_such_adapter(request.adapter, self.kept_adapters)

    async def _acquire(self, session: str | None = None, adapter: str | None = None
                       ) -> Replica:
        """The session's replica while it is healthy; else the healthy replica with the
        fewest requests in flight (which a new session is pinned to). With `adapter`, only
        replicas that have it at the pool's version."""
        deadline = None
        async with self._changed:
            while True:
                up = [r for r in self.replicas if self._serves(r, adapter)]
                if not up:
                    if not any(self._may_come_back(r) for r in self.replicas):
                        raise NoReplicaError(self._no_replica_message())
                    now = asyncio.get_running_loop().time()
                    if deadline is None:
                        deadline = now + REPLICA_WAIT_S
                        for replica in self.replicas:  # a version seen before an update
                            if replica.healthy and replica.recovering is None:
                                asyncio.ensure_future(self._refresh(replica))
                    try:
                        await asyncio.wait_for(self._changed.wait(), deadline - now)
                    except TimeoutError:
                        raise NoReplicaError(self._no_replica_message()) from None
                    continue
                pinned = self._sessions.get(session) if session else None
                if pinned is not None and self._serves(pinned, adapter):
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
                if self.max_waiting is not None and self.waiting >= self.max_waiting:
                    raise overloaded(self.waiting, self.max_waiting)
                self.waiting += 1
                try:
                    await self._changed.wait()
                finally:
                    self.waiting -= 1

    def _may_come_back(self, replica: Replica) -> bool:
        """Up but behind the pool's weights (an update or a catch-up brings it), dirty (a
        full update cleans it), or restarting."""
        return (replica.healthy or replica.dirty or replica.recovering is not None
                or (replica.restart is not None and replica.restarts_left > 0))

    async def _refresh(self, replica: Replica) -> None:
        """Ask a replica its weight version now, not at the next health check."""
        updates = self.updates_ended
        try:
            state = await replica.service.health()
        except RolloutError:
            return  # the health checks deal with it
        await self.saw_version(replica, state.get("weight_version"), updates)

    async def saw_version(self, replica: Replica, version: int | None, updates: int) -> None:
        if updates != self.updates_ended:  # the answer predates an update's end
            return
        if replica.weight_version != version:
            async with self._changed:
                replica.weight_version = version
                self._changed.notify_all()

    def _serves(self, replica: Replica, adapter: str | None = None) -> bool:
        return replica.healthy and (not self.versioned
                                    or replica.weight_version == self.weight_version) and (
            adapter is None or adapter in self.kept_adapters
            and replica.adapters.get(adapter, MISSING) == self.kept_adapters[adapter].version)

    async def _release(self, replica: Replica) -> None:
        async with self._changed:
            replica.in_flight -= 1
            self._changed.notify()

    def _no_replica_message(self) -> str:
        reasons = "; ".join(f"{r.service.url}: {r.down_reason or self._behind(r)}"
                            for r in self.replicas)
        return f"no healthy replica left ({reasons})"

    def _behind(self, replica: Replica) -> str:
        waits = "it is being brought to it" if self.catch_up.possible(replica) else \
            "it waits for the next update"
        return (f"at weight version {replica.weight_version}, the pool at "
                f"{self.weight_version} ({waits})")

    # --- taken out, put back (by the health monitor, a failed call, an update) ---------

    async def take_out(self, replica: Replica, reason: str) -> None:
        async with self._changed:
            if replica.healthy:
                replica.healthy = False
                replica.down_reason = reason
                for call in list(replica.calls):  # sent again by their callers
                    call.cancel()
            self._changed.notify_all()

    async def put_back(self, replica: Replica) -> None:
        async with self._changed:
            replica.healthy, replica.down_reason = True, ""
            self._changed.notify_all()

    def log_context(self, replica: Replica) -> dict:
        """A log line's context: the replica's name, as in its own log lines."""
        return {"replica": f"replica-{self.replicas.index(replica)}"}

    async def notify(self) -> None:
        """Wake the requests that wait for a replica: what serves may have changed."""
        async with self._changed:
            self._changed.notify_all()

    async def health(self) -> dict:
        states = [{"url": r.service.url, "healthy": r.healthy, "in_flight": r.in_flight,
                   "weight_version": r.weight_version,
                   **({"down": r.down_reason} if not r.healthy else {}),
                   **({"behind": self._behind(r)} if r.healthy and not self._serves(r) else {})}
                  for r in self.replicas]
        if not any(self._serves(r) for r in self.replicas):
            raise NoReplicaError(self._no_replica_message())
        return {"replicas": states, "healthy": sum(self._serves(r) for r in self.replicas),
                "running": sum(r.in_flight for r in self.replicas),
                "weight_version": self.weight_version}

    def state(self) -> dict:
        return {"running": sum(r.in_flight for r in self.replicas), "waiting": self.waiting,
                "weight_version": self.weight_version,
                "weights_dirty": any(r.dirty for r in self.replicas),
                "replicas": [{"replica": str(i), "url": r.service.url,
                              "healthy": self._serves(r), "restarts": r.restarts,
                              "running": r.in_flight} for i, r in enumerate(self.replicas)]}

    # --- lifecycle, on every replica at once ------------------------------------------

    async def capabilities(self) -> Capabilities:
        """The first reachable replica's: every replica runs the same backend."""
        for replica in self._reachable():
            try:
                return await replica.service.capabilities()
            except (ReplicaDown, RolloutError):
                continue
        raise NoReplicaError(self._no_replica_message())

    async def abort(self, request_ids: list[str], calls: Iterable[str] = ()) -> None:
        """On every replica that runs (a request's replica is not tracked by id); one that
        cannot be reached has no request of ours running either."""
        calls = list(calls)
        await asyncio.gather(*(r.service.abort(request_ids, calls) for r in self._reachable()),
                             return_exceptions=True)

    async def release(self, tags: list[str] | None) -> None:
        await _on_each(self._reachable(), lambda r: r.service.release(tags), "release")

    async def resume(self, tags: list[str] | None) -> None:
        await _on_each(self._reachable(), lambda r: r.service.resume(tags), "resume")

    async def begin_update(self, version: int | None, pause: str, timeout: float,
                           adapter: dict | None = None) -> PoolUpdate:
        await asyncio.wait_for(self.updating.acquire(), timeout)  # a catch-up may run
        try:
            update = PoolUpdate(self, version, timeout, adapter)
            await update.each(self._reachable(),
                              lambda r: r.service.begin_update(version, pause, timeout, adapter))
        except BaseException:
            self.updating.release()
            raise
        return update

    async def updated(self, replicas: list[Replica], version: int | None) -> None:
        """An update ended on `replicas`: from now on, only replicas at `version` serve."""
        async with self._changed:
            for replica in replicas:  # each is up and clean: it just loaded them all
                replica.weight_version = version
                replica.healthy, replica.down_reason, replica.failed_checks = True, "", 0
            self.weight_version, self.versioned = version, True
            self.updates_ended += 1
            self._changed.notify_all()

    async def adapter_loaded(self, replicas: list[Replica], name: str) -> None:
        async with self._changed:
            for replica in replicas:
                replica.adapters[name] = self.kept_adapters[name].version
            for replica in set(self.replicas) - set(replicas):
                replica.adapters.pop(name, None)  # it had another version, or none
            self._changed.notify_all()

    def update_ended(self) -> None:
        self.updating.release()

    async def unload_adapter(self, name: str) -> None:
        if name not in self.kept_adapters:
            raise no_such_adapter(name, self.kept_adapters)
        async with self.updating:
            del self.kept_adapters[name]
            having = [r for r in self._reachable()
                      if r.adapters.pop(name, MISSING) is not MISSING]
            if having:
                await _on_each(having, lambda r: r.service.unload_adapter(name),
                               f"unloading adapter {name!r}")

    def adapters(self) -> dict[str, int | None]:
        return {name: kept.version for name, kept in self.kept_adapters.items()}

    async def session(self, session_id: str, pop: bool = False) -> dict:
        """An agent session recorded by the server this pool fronts (`connect(url)`): the
        first replica that has it."""
        refusals = []
        for replica in self.replicas:
            ask = getattr(replica.service, "session", None)  # (a server's client only)
            if ask is None:
                continue
            try:
                return await ask(session_id, pop)
            except (RolloutError, ReplicaDown) as exc:  # not there
                refusals.append(exc)
        raise next((e for e in refusals if isinstance(e, RolloutError)), UnsupportedError(
            "agent sessions", "they are recorded by a rollout serve that agents call over "
            "HTTP; connect to one (ServedRollout.connect)"))

    def _reachable(self) -> list[Replica]:
        """Replicas whose process runs: a dirty one (out of rotation) needs the update most."""
        return [r for r in self.replicas if r.process is None or r.process.alive()]

    async def close(self, stop_replicas: bool = True) -> None:
        if self._monitor is not None:
            self._monitor.cancel()
        for replica in self.replicas:
            if replica.recovering is not None:
                replica.recovering.cancel()
        for replica in self.replicas:
            await replica.service.close()
            if stop_replicas and replica.process is not None:
                await asyncio.to_thread(replica.process.stop)
        if stop_replicas and self.on_close is not None:
            await asyncio.to_thread(self.on_close)


async def _on_each(replicas: list[Replica], call, what: str) -> list:
    """`call` on every replica in parallel; raises naming the replicas it failed on."""
    results = await asyncio.gather(*(call(r) for r in replicas), return_exceptions=True)
    failed = {r.service.url: x for r, x in zip(replicas, results) if isinstance(x, BaseException)}
    if failed or not replicas:
        raise RolloutError(f"{what} failed on {len(failed)} of {len(replicas)} replicas: "
                           + "; ".join(f"{url}: {x}" for url, x in failed.items()))
    return results


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
        unknown = pool._unknown_adapter(self.request)
        if unknown is not None:
            raise unknown
        for _ in range(MAX_SENDS):
            replica = await pool._acquire(self.request.session_id, self.request.adapter)
            stream = replica.service.stream(self.request)
            replica.calls.add(stream)
            try:
                async for chunk in stream:
                    yielded = True
                    yield chunk
                self.completion = stream.completion
                return
            except ReplicaDown as exc:
                await pool.take_out(replica, str(exc))
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
