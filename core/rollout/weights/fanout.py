"""The fan-out of a weight update: over every replica of a pool at once (`PoolUpdate`),
each replica's part stepped over HTTP (`RemoteUpdate`), and the pool's own kept copy
(`KeepingUpdate` into `KeptWeights` / `KeptAdapter`), from which a replica that comes back
is caught up."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import attrs

from rollout.contract.errors import RolloutError
from rollout.weights.buckets import unpack
from rollout.weights.receive import Receiver
from rollout.weights.transports.nodes import this_node

# A replica of the pool: its `service` (with `url` and `begin_update`) is what an update uses.
Replica = Any


class Pool(Protocol):
    """What an update needs of the pool it runs over."""

    kept: KeptWeights | None  # the pool's own copy of the weights, where it keeps one
    kept_adapters: dict[str, KeptAdapter]  # the LoRA adapters it pushed, always kept

    async def updated(self, replicas: list[Replica], version: int | None) -> None:
        """The update ended on `replicas`: they serve `version` from now on."""

    async def adapter_loaded(self, replicas: list[Replica], name: str) -> None:
        """Adapter `name` (kept) was loaded into `replicas`."""

    def update_ended(self) -> None:
        """The update is over (ended or cancelled): another may begin."""


log = logging.getLogger("rollout.pool")


class PoolUpdate:
    """A weight update on every replica at once. A replica that fails drops out of it (it
    is dirty, or gone, and takes no requests); the others go on. `end` returns when all
    have the new version, or raises naming the ones that failed. Where the pool keeps
    weights, it receives them too, as one more receiver."""

    def __init__(self, pool: Pool, version: int | None, timeout: float,
                 adapter: dict | None = None):
        self.pool = pool
        self.version = version
        self.adapter = adapter  # {name, config}: the update loads this LoRA adapter
        self.updates: dict[Replica, object] = {}  # the replicas still in the update
        self.failed: dict[str, str] = {}  # url -> why
        self.keeping = None if adapter is None and pool.kept is None else \
            KeepingUpdate(self._keep_weights if adapter is None else self._keep_adapter,
                          timeout)
        self._open = True  # holds the pool's update lock until it ends or is cancelled

    async def each(self, replicas: list[Replica], call) -> None:
        results = await asyncio.gather(*(call(r) for r in replicas), return_exceptions=True)
        for replica, result in zip(replicas, results):
            if isinstance(result, BaseException):
                self.failed[replica.service.url] = str(result) or repr(result)
                self.updates.pop(replica, None)
            elif replica not in self.updates:
                self.updates[replica] = result
        if not self.updates:
            raise RolloutError("the weight update failed on every replica: " + self._why())

    def _why(self) -> str:
        return "; ".join(f"{url}: {why}" for url, why in self.failed.items())

    @property
    def receivers(self) -> int:
        return sum(u.receivers for u in self.updates.values()) + (self.keeping is not None)

    @property
    def nodes(self) -> frozenset[str]:
        keeping = () if self.keeping is None else (self.keeping.nodes,)
        return frozenset().union(*(u.nodes for u in self.updates.values()), *keeping)

    async def join(self, group: dict) -> None:
        """Every replica joins, each from its own first rank (the ranks are handed out
        before anyone joins: a replica that fails leaves the group short, and the
        others then fail within the group's timeout)."""
        first, ranks = group["first_rank"], {}
        if self.keeping is not None:
            keeper_rank, first = first, first + 1
        for replica, update in self.updates.items():
            ranks[replica], first = first, first + update.receivers
        await asyncio.gather(
            self.each(list(self.updates), lambda r: self.updates[r].join(
                {**group, "first_rank": ranks[r]})),
            self._keep(lambda k: k.join({**group, "first_rank": keeper_rank})))

    async def send(self, message: dict) -> None:
        await asyncio.gather(self.each(list(self.updates), lambda r: self.updates[r].send(
            message)), self._keep(lambda k: k.send(message)))

    async def _keep(self, step) -> None:
        """A step of the pool's own copy; where it fails, the pool keeps no copy of this
        version (a restarted replica then waits for the next update), and the replicas'
        update goes on."""
        if self.keeping is None:
            return
        try:
            await step(self.keeping)
        except Exception as exc:  # noqa: BLE001 - logged; the replicas matter
            log.warning("the pool could not keep weight version %s: %r", self.version, exc)
            await self.keeping.cancel(repr(exc))
            self.keeping = None

    def _keep_weights(self, tensors: dict) -> None:
        self.pool.kept.tensors.update(tensors)
        self.pool.kept.version = self.version

    def _keep_adapter(self, tensors: dict) -> None:
        self.pool.kept_adapters[self.adapter["name"]] = KeptAdapter(
            self.adapter["config"], self.version, tensors)

    async def end(self) -> int | None:
        try:
            await self.each(list(self.updates), lambda r: self.updates[r].end())
            await self._keep(lambda k: k.end())
            if self.adapter is None:
                await self.pool.updated(list(self.updates), self.version)
            elif self.keeping is not None:
                await self.pool.adapter_loaded(list(self.updates), self.adapter["name"])
            else:  # not kept: no replica serves it (none would come back with it)
                raise RolloutError(f"the pool could not keep adapter {self.adapter['name']!r}")
        finally:
            self._close()
        if self.failed:
            raise RolloutError(f"weights updated on {len(self.updates)} replicas, failed on "
                               f"{len(self.failed)}: {self._why()}")
        return self.version

    async def cancel(self, reason: str) -> None:
        try:
            await asyncio.gather(*(u.cancel(reason) for u in self.updates.values()),
                                 self._keep(lambda k: k.cancel(reason)),
                                 return_exceptions=True)
        finally:
            self._close()

    def _close(self) -> None:
        if self._open:
            self._open = False
            self.pool.update_ended()


class KeptWeights:
    """The weights a pool last pushed, by name, kept in the pool's process so that a
    replica restarted on its checkpoint is brought to the pool's version before it serves.
    Costs one copy of the model in memory (two while an update stages its tensors)."""

    def __init__(self):
        self.tensors: dict = {}
        self.version: int | None = None


@attrs.frozen
class KeptAdapter:
    """A LoRA adapter a pool pushed, kept for replicas that come back without it."""

    config: dict
    version: int | None
    tensors: dict


class KeepingUpdate(Receiver):
    """The pool's own part in an update: one more receiver, which keeps what it receives
    and, when the update ends, hands it to `keep` (the weights' tensors, or an adapter)."""

    receivers = 1

    def __init__(self, keep, timeout: float):
        self.keep, self.timeout = keep, timeout
        self.nodes = frozenset({this_node()})
        self.staged: dict = {}

    async def send(self, message: dict) -> None:
        # In host memory: a copy kept on a GPU would take the engines' memory.
        self.staged.update((n, t.cpu()) for n, t in unpack(await self._receive(message)))

    async def end(self) -> None:
        self.keep(self.staged)
        self.staged = {}
        self._leave()

    async def cancel(self, reason: str) -> None:
        self.staged = {}
        self._leave()


# A server's control route: (path, JSON body) -> its JSON answer, its failure raised typed.
Control = Callable[[str, dict], Awaitable[dict]]


class RemoteUpdate:
    """A weight update open on a server, by the id the server gave it."""

    def __init__(self, control: Control, update_id: str, receivers: int, nodes=()):
        self.control = control
        self.id = update_id
        self.receivers = receivers  # the ranks its server brings to a collective group
        self.nodes = frozenset(nodes)  # none from an older server: not known to be here

    @classmethod
    async def begin(cls, control: Control, version: int | None, pause: str,
                    timeout: float, adapter: dict | None = None) -> RemoteUpdate:
        body = {"version": version, "pause": pause, "timeout": timeout}
        data = await control("/rollout/weights/begin",
                             body if adapter is None else {**body, "adapter": adapter})
        return cls(control, data["update"], data["receivers"], data.get("nodes", ()))

    async def join(self, group: dict) -> None:
        await self.control("/rollout/weights/group", {"update": self.id, **group})

    async def send(self, message: dict) -> None:
        await self.control("/rollout/weights/bucket", {"update": self.id, "bucket": message})

    async def end(self) -> int | None:
        return (await self.control("/rollout/weights/end", {"update": self.id}))["version"]

    async def cancel(self, reason: str) -> None:
        await self.control("/rollout/weights/cancel", {"update": self.id, "reason": reason})
