"""The trainer's side of a weight update: its tensors packed into buckets, each bucket's
layout sent to the receivers and its bytes by a transport (shared memory on one host, a
gloo or NCCL group across hosts, CUDA IPC on one GPU), then the end."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

from rollout.contract.errors import InvalidRequestError
from rollout.kit.process import free_port
from rollout.weights.buckets import DEFAULT_BUCKET_BYTES, Bucket, iter_groups, layout, unpack
from rollout.weights.transports.collective import broadcast_announced, close, open_with, \
    require, unique_group_name
from rollout.weights.transports.cuda_ipc import CudaIpcSender
from rollout.weights.transports.cuda_ipc import require as require_cuda_ipc
from rollout.weights.transports.nodes import same_node
from rollout.weights.transports.shm import ShmSender
from rollout.weights.update import BUCKET_WAIT_S, CHOICES, WeightUpdate

SENDERS = {"shm": ShmSender, "cuda_ipc": CudaIpcSender}  # the rest go through a group
log = logging.getLogger("rollout.weights")


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
