"""Shared memory on one host: the sender writes a bucket into a file under /dev/shm, the
receiver copies it out (`receive_shm`), or loads it from views it drops (`map_shm`), before
it answers, so the sender may reuse the file at once (an engine that kept views into a
reused buffer would load the next bucket's bytes)."""

from __future__ import annotations

import os
import re
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from rollout.contract.errors import InvalidRequestError
from rollout.weights.buckets import Bucket, layout, metas_from_layout, pack_into, packed_layout

if TYPE_CHECKING:
    import torch

SHM_DIR = Path("/dev/shm")
# The only files a receiver opens; the sender's pid lets a later sender remove the files
# of one that was killed before it could.
NAME = re.compile(r"^rollout-weights-(\d+)-[0-9a-f]{32}$")


class ShmSender:
    """One shared-memory file per sender, grown to the largest bucket and reused, and
    mapped once: writing through a fresh mapping faults on every page, which cost 6x the
    copy itself (and a fresh file's pages 12x)."""

    def __init__(self):
        _remove_orphans()
        self.path = SHM_DIR / f"rollout-weights-{os.getpid()}-{uuid.uuid4().hex}"
        self._map: torch.Tensor | None = None

    def _mapped(self, nbytes: int) -> torch.Tensor:
        import torch

        if self._map is None or nbytes > self._map.numel():
            # Grown only between buckets: every receiver has answered for the last one.
            self._map = None
            with open(self.path, "wb") as f:
                f.truncate(nbytes)
            self._map = torch.from_file(str(self.path), shared=True, size=nbytes,
                                        dtype=torch.uint8)
        return self._map[:nbytes]

    def put(self, bucket: Bucket) -> dict:
        """Write the bucket's bytes; returns the message that tells a receiver where."""
        if bucket.nbytes:
            self._mapped(bucket.nbytes).copy_(bucket.data.reshape(-1).cpu())
        return self._message(bucket.tensors, bucket.nbytes)

    def put_tensors(self, named: list[tuple[str, torch.Tensor]]) -> dict:
        """Pack (name, tensor) pairs straight into the file: one copy, not two."""
        metas, nbytes = packed_layout(named)
        if nbytes:
            pack_into(self._mapped(nbytes), metas, [(n, t.cpu()) for n, t in named])
        return self._message(metas, nbytes)

    def _message(self, metas, nbytes: int) -> dict:
        return {"transport": "shm", "name": self.path.name, **layout(metas, nbytes)}

    def close(self) -> None:
        self._map = None
        self.path.unlink(missing_ok=True)

    def __enter__(self) -> ShmSender:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _remove_orphans() -> None:
    """Files of senders that died without removing them (a trainer killed mid-update)."""
    for path in SHM_DIR.glob("rollout-weights-*"):
        match = NAME.match(path.name)
        if match and not _alive(int(match.group(1))):
            path.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def receive_shm(message: dict) -> Bucket:
    """The bucket a `ShmSender.put` message names, copied into this process's memory."""
    import torch

    mapped = map_shm(message)
    data = torch.empty(mapped.nbytes, dtype=torch.uint8)
    if mapped.nbytes:
        data.copy_(mapped.data)
    return Bucket(mapped.tensors, data)


def map_shm(message: dict) -> Bucket:
    """The bucket a `ShmSender.put` message names, as views into the sender's file (no
    copy, checked as `receive_shm` checks). The sender reuses its file once the receiver
    answers: a receiver must be done with every view before it answers (and keep none)."""
    import torch

    nbytes, metas = metas_from_layout(message)
    name = str(message.get("name", ""))
    if not NAME.match(name):
        raise InvalidRequestError("name", f"got {name!r}",
                                  "rollout-weights-<pid>-<32 hex digits>")
    path = SHM_DIR / name
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        raise InvalidRequestError("name", f"{name!r} does not exist in {SHM_DIR} (another "
                                  "host, or the sender closed it)", "a live sender's file") from None
    if size < nbytes:
        raise InvalidRequestError("nbytes", f"{nbytes} announced, {size} in {name!r}",
                                  "at most the file's size")
    data = torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8) \
        if nbytes else torch.empty(0, dtype=torch.uint8)
    return Bucket(metas, data)
