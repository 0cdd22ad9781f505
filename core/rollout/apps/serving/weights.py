"""Weight updates into a served backend: begin, one message per bucket, end.

The trainer's process packs buckets, writes each into shared memory (`ShmSender`) and sends
its layout as JSON; every replica copies the bytes out before it answers, so the trainer
reuses its buffer for the next bucket. `LocalUpdate` feeds the received buckets to
`Rollout.update_weights` on a thread of its own (one per update, not per bucket); a
trainer that stops sending fails the update after `BUCKET_WAIT_S`, which leaves the
backend dirty (it refuses requests) until a full update succeeds.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
import time
from collections.abc import Iterable
from typing import Protocol

from rollout.api import PAUSES, Rollout
from rollout.contract.errors import InvalidRequestError, RolloutError, RolloutTimeoutError

BUCKET_WAIT_S = 120.0  # the longest a backend waits for a trainer's next bucket
_END = object()


class WeightUpdate(Protocol):
    """One update in progress on a service."""

    async def send(self, message: dict) -> None:
        """Load one bucket (a `ShmSender.put` message); returns when the bytes are copied."""

    async def end(self) -> int | None:
        """Finish; returns the new weight version. Raises what failed the update."""

    async def cancel(self, reason: str) -> None:
        """Give up: the backend is left dirty until a full update succeeds."""


def check_update_options(version, pause, timeout=BUCKET_WAIT_S) -> None:
    if version is not None and (not isinstance(version, int) or isinstance(version, bool)):
        raise InvalidRequestError("version", f"got {version!r}", "an integer or null")
    if pause not in PAUSES:
        raise InvalidRequestError("pause", f"got {pause!r}", ", ".join(PAUSES))
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise InvalidRequestError("timeout", f"got {timeout!r}", "seconds > 0")


class LocalUpdate:
    def __init__(self, rollout: Rollout, version: int | None, pause: str,
                 timeout: float = BUCKET_WAIT_S):
        check_update_options(version, pause, timeout)
        self.version = version
        self.timeout = timeout  # the longest wait for the trainer's next bucket
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
        from rollout.kit.transfer.shm import receive_shm

        if self._done.done():
            self._done.result()
        if not isinstance(message, dict) or message.get("transport") != "shm":
            raise InvalidRequestError("bucket.transport", f"got {message!r:.80}", "shm")
        bucket = await asyncio.to_thread(receive_shm, message)
        await asyncio.to_thread(self._put, bucket)

    async def end(self) -> int | None:
        await asyncio.to_thread(self._put, _END)
        return await asyncio.wait_for(asyncio.wrap_future(self._done), BUCKET_WAIT_S)

    async def cancel(self, reason: str) -> None:
        if not self._done.done():
            await asyncio.to_thread(self._put, RolloutError(f"update cancelled: {reason}"))
        try:
            await asyncio.wait_for(asyncio.wrap_future(self._done), BUCKET_WAIT_S)
        except Exception:  # noqa: BLE001 - the failure is what cancelling means
            pass


async def push_weights(update: WeightUpdate, named_tensors: Iterable,
                       bucket_bytes: int | None = None) -> int | None:
    """The trainer's side: pack, write to shared memory, send each bucket's layout, end.
    Any failure cancels the update (the receivers are then dirty, not half-updated)."""
    from rollout.kit.buckets import DEFAULT_BUCKET_BYTES, iter_groups
    from rollout.kit.transfer.shm import ShmSender

    with ShmSender() as sender:
        try:
            for group in iter_groups(named_tensors, bucket_bytes or DEFAULT_BUCKET_BYTES):
                await update.send(sender.put_tensors(group))
        except BaseException as exc:
            await update.cancel(repr(exc))
            raise
        return await update.end()
