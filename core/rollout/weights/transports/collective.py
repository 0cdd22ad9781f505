"""The trainer's side of a collective group with an engine (rank 0 sends, the engine's
ranks receive), in plain torch: the trainer needs no engine installed.

The group is built as SGLang's `init_custom_process_group` builds its side, which is what
torch does for `new_group` on a `tcp://` rendezvous: a TCP store on the master's address,
wrapped in `PrefixStore(group_name)`, then torch's own per-group and per-device prefixes.
A plain `init_process_group` would use other store keys, and both sides would wait out
their timeouts. Every wait here is bounded by `timeout_s`.
"""

from __future__ import annotations

import datetime
import uuid
from typing import TYPE_CHECKING

import attrs

from rollout.weights.buckets import Bucket, metas_from_layout, unpack

if TYPE_CHECKING:
    import torch

BACKENDS = ("gloo", "nccl")  # nccl: CUDA tensors, a GPU in every process of the group


class ReceiverGaveUp(RuntimeError):
    """The receiver said it will not receive what was broadcast (`wait_all`'s `stop`)."""


def unique_group_name() -> str:
    """A group name used once: an engine refuses a name it has seen, and the trainer then
    waits out the rendezvous timeout."""
    return f"rollout-{uuid.uuid4().hex}"


@attrs.define
class Group:
    name: str
    rank: int
    world_size: int
    timeout_s: float
    backend: object  # torch's ProcessGroupGloo (or ProcessGroupNCCL)
    store: object  # kept alive with the group: rank 0 serves it
    kind: str = "gloo"  # one of BACKENDS


def _timeout(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def open_group(host: str, port: int, rank: int, world_size: int, group_name: str,
               backend: str = "gloo", timeout_s: float = 60.0,
               op_timeout_s: float | None = None) -> Group:
    """Join the group; returns once every rank has (blocks until then, at most
    `timeout_s`). Rank 0 serves the store at host:port. A broadcast then fails after
    `op_timeout_s` (by default `timeout_s`)."""
    import torch.distributed as dist

    require(backend)
    store = dist.TCPStore(host, port, world_size, is_master=rank == 0,
                          timeout=_timeout(timeout_s), wait_for_workers=False)
    # The keys of torch's tcp:// rendezvous + _new_process_group_helper, as SGLang uses them.
    device = device_of(backend)
    keys = dist.PrefixStore(f"{device}/", dist.PrefixStore(f"{group_name}/",
                                                           dist.PrefixStore(group_name, store)))
    if backend == "nccl":  # written for GPUs; not run on this project's CPU-only CI
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = _timeout(op_timeout_s or timeout_s)
        pg = dist.ProcessGroupNCCL(keys, rank, world_size, options)
    else:
        options = dist.ProcessGroupGloo._Options()
        options._timeout = _timeout(timeout_s)
        # Each rank listens on its address towards the store's host (rank 0: that host).
        options._devices = [dist.ProcessGroupGloo.create_device(
            hostname=address_towards(host))]
        pg = dist.ProcessGroupGloo(keys, rank, world_size, options)
        if op_timeout_s is not None:
            pg.set_timeout(_timeout(op_timeout_s))
    return Group(group_name, rank, world_size, op_timeout_s or timeout_s, pg, store,
                 backend)


def require(backend: str) -> None:
    """Raise where this process cannot join a group of `backend`."""
    from rollout.contract.errors import InvalidRequestError, UnsupportedError

    if backend not in BACKENDS:
        raise InvalidRequestError("backend", f"got {backend!r}", ", ".join(BACKENDS))
    if backend == "nccl":
        import torch

        if not torch.cuda.is_available():
            raise UnsupportedError("nccl", "it moves CUDA tensors and this process sees no "
                                   "GPU; use gloo (or shm on one host)")


def device_of(backend: str) -> str:
    """Where the tensors of a group of `backend` live."""
    return "cuda" if backend == "nccl" else "cpu"


def address_towards(host: str) -> str:
    """This machine's address on the route to `host` (itself for a loopback or local one)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((socket.gethostbyname(host), 9))  # picks the route; sends nothing
        return probe.getsockname()[0]


def _tensors(bucket: Bucket) -> list[torch.Tensor]:
    # Views into the bucket, one per tensor: SGLang receives per tensor, each into a
    # tensor of the announced dtype and shape, so the bytes sent equal the bytes announced.
    return [t for _, t in unpack(bucket)]


def start_broadcast(group: Group, tensors: list[torch.Tensor]) -> list:
    """Queue one broadcast per tensor from rank 0; gloo's threads send them while the
    caller does something else (tells the engine what is coming). Returns the works."""
    import torch.distributed as dist

    options = dist.BroadcastOptions()
    options.rootRank, options.rootTensor = 0, 0
    return [group.backend.broadcast([t], options) for t in tensors]


def wait_all(group: Group, works: list, timeout_s: float | None = None, stop=None) -> None:
    """Wait for queued broadcasts, at most `timeout_s` (the group's by default) in all, or
    until `stop()` is true (the receiver said it will not receive), checked every 50 ms.
    Unfinished, the group is unusable: drop every work and close it."""
    import threading
    import time

    timeout_s = group.timeout_s if timeout_s is None else timeout_s
    done, left, lock = threading.Event(), [len(works)], threading.Lock()

    def finished(_):
        with lock:
            left[0] -= 1
            if not left[0]:
                done.set()

    if not works:
        return
    for work in works:
        work.get_future().add_done_callback(finished)
    del work  # a traceback through here must not keep the group's connections open
    deadline = time.monotonic() + timeout_s
    while not done.wait(0.05):
        if stop is not None and stop():
            raise ReceiverGaveUp(f"the receiver of group {group.name!r} gave up")
        if time.monotonic() > deadline:
            raise TimeoutError(f"a broadcast in group {group.name!r} did not finish "
                               f"within {timeout_s:.0f} s")
    for work in works:
        work.wait()  # raises what failed


def broadcast_bucket(group: Group, bucket: Bucket, timeout_s: float | None = None) -> None:
    """Send one bucket from rank 0, one broadcast per tensor (measured faster into SGLang
    than one flat buffer, which SGLang copies apart again)."""
    wait_all(group, start_broadcast(group, _tensors(bucket)), timeout_s)


def receive_bucket(group: Group, message: dict, timeout_s: float | None = None,
                   out: torch.Tensor | None = None) -> Bucket:
    """On a receiving rank: the bucket whose `layout` is `message`, tensor by tensor, into
    `out` (a uint8 buffer the receiver is done with) or a new buffer."""
    import torch
    import torch.distributed as dist

    nbytes, metas = metas_from_layout(message)
    data = out[:nbytes] if out is not None and out.numel() >= nbytes else \
        torch.empty(nbytes, dtype=torch.uint8, device=device_of(group.kind))
    bucket = Bucket(metas, data)
    options = dist.BroadcastOptions()
    options.rootRank, options.rootTensor = 0, 0
    works = [group.backend.broadcast([t], options) for t in _tensors(bucket)]
    wait_all(group, works, timeout_s)
    return bucket


def close(group: Group) -> None:
    """Leave the group. Its connections close when the last reference to it goes: the
    caller drops its works first. Then a peer waiting on a broadcast fails at once; with
    a broadcast of ours still pending, torch waits for it to time out first (at most the
    group's timeout), so close such a group from a thread that may wait."""
    group.backend = None
    group.store = None


# --- the trainer's side of an engine that joins or receives on a call of its own --------

def open_with(announce, host: str, port: int, world_size: int, group_name: str,
              join_timeout_s: float, op_timeout_s: float, backend: str = "gloo") -> Group:
    """Open the group as rank 0 while `announce()` runs: a blocking call that has the other
    ranks join (it returns once they have). Its failure (a name refused, a server down) is
    raised at once; our join then gives up within `join_timeout_s` on its own thread."""
    import threading

    joined: dict = {}

    def join():
        try:
            group = open_group(host, port, 0, world_size, group_name, backend,
                               join_timeout_s, op_timeout_s)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller below
            joined["error"] = exc
            return
        joined["group"] = group
        if joined.get("abandoned"):
            close(group)

    thread = threading.Thread(target=join, name="rollout-group-join", daemon=True)
    thread.start()
    try:
        announce()
    except BaseException:
        joined["abandoned"] = True
        if "group" in joined:
            close(joined.pop("group"))
        raise
    thread.join(join_timeout_s + 10)
    if "group" not in joined:
        raise TimeoutError(f"joining group {group_name!r} failed: "
                           f"{joined.get('error', 'timed out')!r}")
    return joined["group"]


def broadcast_announced(group: Group, tensors: list[torch.Tensor], announced,
                        timeout_s: float | None = None) -> None:
    """Broadcast from rank 0 while the receivers' announcement call (`announced`, a
    concurrent.futures.Future) runs; stop as soon as it fails and raise its error. On any
    failure the group is unusable: leave it (`close_soon`)."""
    works = start_broadcast(group, tensors)
    try:
        wait_all(group, works, timeout_s,
                 stop=lambda: announced.done() and announced.exception() is not None)
    except ReceiverGaveUp:
        works.clear()
        raise announced.exception() from None  # the receiver's refusal says why
    finally:
        works.clear()  # our references to the group go, so its connections can close


def close_soon(group: Group) -> None:
    """Leave the group on a thread of its own: with a broadcast of ours still pending,
    torch waits for it to time out first."""
    import threading

    threading.Thread(target=close, args=(group,), daemon=True,
                     name="rollout-group-close").start()
