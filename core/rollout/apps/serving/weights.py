"""Weight updates into a served backend: begin, one message per bucket, end.

The trainer's process sends each bucket's layout as JSON and its bytes by a transport:
shared memory on one host (`ShmSender`: every replica copies the bytes out before it
answers, so the trainer reuses its buffer for the next bucket), or a gloo group that the
trainer (rank 0) and every replica join for the update (`group` step), across hosts. `LocalUpdate` feeds the received buckets to
`Rollout.update_weights` on a thread of its own (one per update, not per bucket); a
trainer that stops sending fails the update after `BUCKET_WAIT_S`, which leaves the
backend dirty (it refuses requests) until a full update succeeds.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
import uuid
from collections.abc import Iterable
from typing import Protocol

from rollout.api import Rollout, check_update
from rollout.contract.errors import InvalidRequestError, RolloutError, RolloutTimeoutError
from rollout.kit.buckets import DEFAULT_BUCKET_BYTES, Bucket, iter_groups, layout, unpack
from rollout.kit.process import free_port
from rollout.kit.transfer.collective import (broadcast_announced, close, open_group, open_with,
                                             receive_bucket, require, unique_group_name)
from rollout.kit.transfer.cuda_ipc import CudaIpcSender, receive_cuda_ipc
from rollout.kit.transfer.cuda_ipc import require as require_cuda_ipc
from rollout.kit.transfer.nodes import same_node, this_node
from rollout.kit.transfer.shm import ShmSender, receive_shm

BUCKET_WAIT_S = 120.0  # the longest a backend waits for a trainer's next bucket
# nccl: GPUs on both sides; cuda_ipc: one GPU shared with an engine (neither run on CPU CI)
TRANSPORTS = ("shm", "gloo", "nccl", "cuda_ipc")
# what a trainer may ask for: "auto" is shm where every receiver is on the trainer's node,
# gloo otherwise
CHOICES = ("auto",) + TRANSPORTS
SENDERS = {"shm": ShmSender, "cuda_ipc": CudaIpcSender}  # the rest go through a group
GROUP_FIELDS = ("host", "port", "name", "world_size", "first_rank", "backend")
_END = object()
log = logging.getLogger("rollout.weights")
# Copies out of shared memory or CUDA IPC all run on this one thread: torch gives each
# thread that runs its parallel kernels a team of worker threads (one per core) for as long
# as the thread lives, so copies on whichever executor thread was free grew a server by a
# core's worth of threads per update (15 a push on a 16-core machine). A collective
# receive stays on the default executor: it waits for the other ranks.
_RECEIVING = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rollout-receive")


async def _receiving(fn, *args):
    return await asyncio.get_running_loop().run_in_executor(_RECEIVING, fn, *args)


class WeightUpdate(Protocol):
    """One update in progress on a service."""

    receivers: int  # the ranks it brings to a collective group
    nodes: frozenset[str]  # where its receivers run (rollout.kit.transfer.nodes)

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


def require_transport(transport: str) -> None:
    """Raise, before anything is sent, where this process cannot use `transport`."""
    if transport not in CHOICES:
        raise InvalidRequestError("transport", f"got {transport!r}", ", ".join(CHOICES))
    if transport == "auto":
        require("gloo")
    elif transport == "cuda_ipc":
        require_cuda_ipc()
    elif transport not in SENDERS:
        require(transport)


def check_update_options(version, pause, timeout=BUCKET_WAIT_S) -> None:
    check_update(version, pause)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise InvalidRequestError("timeout", f"got {timeout!r}", "seconds > 0")


class _Receiver:
    """A receiver's membership in the trainer's collective group, for one update."""

    timeout: float
    _group = None

    async def join(self, group: dict) -> None:
        g = check_group(group)
        require(g["backend"])
        self._group = await asyncio.to_thread(
            open_group, g["host"], g["port"], g["first_rank"], g["world_size"], g["name"],
            g["backend"], self.timeout)

    async def _receive(self, message: dict) -> Bucket:
        """One bucket's bytes, by the transport its message names (a collective one needs
        the group joined first)."""
        transport = message.get("transport") if isinstance(message, dict) else None
        if transport not in TRANSPORTS:
            raise InvalidRequestError("bucket.transport", f"got {transport!r}",
                                      ", ".join(TRANSPORTS))
        if transport == "shm":
            return await _receiving(receive_shm, message)
        if transport == "cuda_ipc":
            return await _receiving(receive_cuda_ipc, message)
        if self._group is None or self._group.kind != transport:
            raise InvalidRequestError("bucket.transport", f"{transport} before the group "
                                      "step", f"shm, or {transport} in the trainer's group")
        return await asyncio.to_thread(receive_bucket, self._group, message, self.timeout)

    def _leave(self) -> None:
        if self._group is not None:
            close(self._group)
            self._group = None


class LocalUpdate(_Receiver):
    def __init__(self, rollout: Rollout, version: int | None, pause: str,
                 timeout: float = BUCKET_WAIT_S):
        check_update_options(version, pause, timeout)
        self.version = version
        self.timeout = timeout  # the longest wait for the trainer's next bucket
        self.receivers = 1
        self.nodes = frozenset({this_node()})
        self._queue: queue.Queue = queue.Queue(maxsize=1)
        self._done: concurrent.futures.Future = concurrent.futures.Future()
        threading.Thread(target=self._run, args=(rollout, pause), daemon=True,
                         name="rollout-weight-update").start()

    def _run(self, rollout: Rollout, pause: str) -> None:
        try:
            rollout.update_weights(self._buckets(), version=self.version, pause=pause)
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the update
            self._done.set_exception(exc)
        else:
            self._done.set_result(self.version)

    def _buckets(self):
        while True:
            try:
                item = self._queue.get(timeout=self.timeout)
            except queue.Empty:
                raise RolloutTimeoutError(
                    f"no weight bucket came for {self.timeout:g} s (the trainer stopped "
                    "sending)") from None
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def _put(self, item) -> None:
        deadline = time.monotonic() + BUCKET_WAIT_S
        while not self._done.done():
            try:
                self._queue.put(item, timeout=0.05)
                return
            except queue.Full:
                if time.monotonic() > deadline:
                    raise RolloutTimeoutError(f"the backend took no bucket for "
                                              f"{BUCKET_WAIT_S:.0f} s") from None
        self._done.result()  # raises what ended the update
        raise RolloutError("the weight update has already ended")

    async def send(self, message: dict) -> None:
        if self._done.done():
            self._done.result()
        bucket = await self._receive(message)
        await asyncio.to_thread(self._put, bucket)

    async def end(self) -> int | None:
        try:
            await asyncio.to_thread(self._put, _END)
            return await asyncio.wait_for(asyncio.wrap_future(self._done), BUCKET_WAIT_S)
        finally:
            self._leave()

    async def cancel(self, reason: str) -> None:
        if not self._done.done():
            await asyncio.to_thread(self._put, RolloutError(f"update cancelled: {reason}"))
        try:
            await asyncio.wait_for(asyncio.wrap_future(self._done), BUCKET_WAIT_S)
        except Exception:  # noqa: BLE001 - the failure is what cancelling means
            pass
        finally:
            self._leave()


class OpenUpdates:
    """A server's open weight update (one at most), by id, with when its trainer last sent
    a step. One whose trainer went quiet for longer than its timeout has failed (the
    backend is dirty): it is cancelled, and no longer stands in the way of a new one."""

    def __init__(self):
        self._open: dict[str, list] = {}  # id -> [update (None while it begins), timeout, last]

    async def begin(self, service, version, pause, timeout
                    ) -> tuple[str, WeightUpdate] | None:
        """A new update's id and the update; None while another is open."""
        for update_id, (update, quiet_after, last) in list(self._open.items()):
            if update is not None and time.monotonic() - last > quiet_after:
                del self._open[update_id]
                await update.cancel("the trainer stopped sending")
        if self._open:
            return None
        update_id = uuid.uuid4().hex
        self._open[update_id] = [None, timeout, time.monotonic()]
        try:
            update = await service.begin_update(version, pause, timeout)
        except BaseException:
            del self._open[update_id]
            raise
        self._open[update_id] = [update, timeout, time.monotonic()]
        return update_id, update

    def get(self, update_id) -> WeightUpdate | None:
        return self._open.get(update_id, [None])[0] if isinstance(update_id, str) else None

    def touch(self, update_id: str) -> None:
        self._open[update_id][2] = time.monotonic()

    def close(self, update_id: str) -> None:
        self._open.pop(update_id, None)


class KeptWeights:
    """The weights a pool last pushed, by name, kept in the pool's process so that a
    replica restarted on its checkpoint is brought to the pool's version before it serves.
    Costs one copy of the model in memory (two while an update stages its tensors)."""

    def __init__(self):
        self.tensors: dict = {}
        self.version: int | None = None


class KeepingUpdate(_Receiver):
    """`KeptWeights`' part in an update: one more receiver, which keeps what it receives
    and takes it as the kept weights only when the update ends."""

    receivers = 1

    def __init__(self, kept: KeptWeights, version: int | None, timeout: float):
        self.kept, self.version, self.timeout = kept, version, timeout
        self.nodes = frozenset({this_node()})
        self.staged: dict = {}

    async def send(self, message: dict) -> None:
        # In host memory: a copy kept on a GPU would take the engines' memory.
        self.staged.update((n, t.cpu()) for n, t in unpack(await self._receive(message)))

    async def end(self) -> int | None:
        self.kept.tensors.update(self.staged)
        self.kept.version, self.staged = self.version, {}
        self._leave()
        return self.version

    async def cancel(self, reason: str) -> None:
        self.staged = {}
        self._leave()


async def push_weights(update: WeightUpdate, named_tensors: Iterable,
                       bucket_bytes: int | None = None, transport: str = "auto",
                       address: str = "127.0.0.1", timeout: float = BUCKET_WAIT_S
                       ) -> int | None:
    """The trainer's side: each bucket's layout to the receivers, its bytes by `transport`
    (for gloo, the receivers reach this process's store at `address`), then end. Any
    failure cancels the update (the receivers are then dirty, not half-updated)."""
    groups = iter_groups(named_tensors, bucket_bytes or DEFAULT_BUCKET_BYTES)
    if transport == "auto":
        transport = choose_transport(update)
    try:
        if transport in SENDERS:
            await _push_by_sender(update, groups, SENDERS[transport])
        else:
            await _push_by_group(update, groups, transport, address, timeout)
    except BaseException as exc:
        await update.cancel(repr(exc))
        raise
    return await update.end()


def choose_transport(update: WeightUpdate) -> str:
    """Shared memory where every receiver runs on this node, else a gloo group."""
    transport = "shm" if same_node(update.nodes) else "gloo"
    log.info("weights go by %s to %d receivers on nodes %s", transport, update.receivers,
             ", ".join(sorted(update.nodes)) or "unknown")
    return transport


async def _push_by_sender(update: WeightUpdate, groups, sender_class) -> None:
    """One reused buffer (a shared-memory file, a CUDA buffer); every receiver copies a
    bucket out before it answers, so the next one may overwrite it."""
    with sender_class() as sender:
        for group in groups:
            await update.send(sender.put_tensors(group))


async def _push_by_group(update: WeightUpdate, groups, backend: str, address: str,
                         timeout: float) -> None:
    loop = asyncio.get_running_loop()
    spec = {"host": address, "port": free_port(), "name": unique_group_name(),
            "world_size": 1 + update.receivers, "first_rank": 1, "backend": backend}
    group = await asyncio.to_thread(
        open_with, lambda: asyncio.run_coroutine_threadsafe(update.join(spec), loop).result(),
        address, spec["port"], spec["world_size"], spec["name"], timeout, timeout, backend)
    try:
        for named in groups:
            bucket = Bucket.of(named)  # its layout; the tensors go as they are, one by one
            sending = asyncio.run_coroutine_threadsafe(update.send(
                {"transport": backend, **layout(bucket.tensors, bucket.nbytes)}), loop)
            await asyncio.to_thread(broadcast_announced, group,
                                    [t for _, t in unpack(bucket)], sending, timeout)
            await asyncio.wrap_future(sending)
    finally:
        close(group)
