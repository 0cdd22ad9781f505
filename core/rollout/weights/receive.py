"""The receiving side of a weight update, in the process that serves a backend: the
buckets' bytes taken off a transport, and fed to `Rollout.update_weights` (`LocalUpdate`,
on a thread of its own, one per update); a server's open update (`OpenUpdates`); and the
copy a pool keeps for a restarted replica (`KeptWeights`). A trainer that stops sending
fails the update after its timeout, which leaves the backend dirty (it refuses requests)
until a full update succeeds."""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
import time
import uuid


from rollout.contract.errors import InvalidRequestError, RolloutError, RolloutTimeoutError
from rollout.contract.sampler import Sampler
from rollout.weights.buckets import Bucket
from rollout.weights.transports.collective import close, open_group, receive_bucket, require
from rollout.weights.transports.cuda_ipc import receive_cuda_ipc
from rollout.weights.transports.nodes import this_node
from rollout.weights.transports.shm import receive_shm
from rollout.weights.update import BUCKET_WAIT_S, TRANSPORTS, WeightUpdate, check_adapter, \
    check_group, check_update_options

_END = object()
# Copies out of shared memory or CUDA IPC all run on this one thread: torch gives each
# thread that runs its parallel kernels a team of worker threads (one per core) for as long
# as the thread lives, so copies on whichever executor thread was free grew a server by a
# core's worth of threads per update (15 a push on a 16-core machine). A collective
# receive stays on the default executor: it waits for the other ranks.
_RECEIVING = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rollout-receive")


async def _receiving(fn, *args):
    return await asyncio.get_running_loop().run_in_executor(_RECEIVING, fn, *args)


class Receiver:
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


class LocalUpdate(Receiver):
    """An update of a Rollout in this process: of its weights, or with `adapter`
    ({name, config}) of that LoRA adapter."""

    def __init__(self, rollout: Sampler, version: int | None, pause: str,
                 timeout: float = BUCKET_WAIT_S, adapter: dict | None = None):
        check_update_options(version, pause, timeout)
        self.adapter = check_adapter(adapter)
        self.version = version
        self.timeout = timeout  # the longest wait for the trainer's next bucket
        self.receivers = 1
        self.nodes = frozenset({this_node()})
        self._queue: queue.Queue = queue.Queue(maxsize=1)
        self._done: concurrent.futures.Future = concurrent.futures.Future()
        threading.Thread(target=self._run, args=(rollout, pause), daemon=True,
                         name="rollout-weight-update").start()

    def _run(self, rollout: Sampler, pause: str) -> None:
        try:
            if self.adapter is None:
                rollout.update_weights(self._buckets(), version=self.version, pause=pause)
            else:
                rollout.load_adapter(self.adapter["name"], self._buckets(),
                                     self.adapter["config"], version=self.version, pause=pause)
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

    async def begin(self, service, version, pause, timeout, adapter=None
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
            update = await service.begin_update(version, pause, timeout, adapter)
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
