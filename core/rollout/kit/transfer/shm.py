"""Shared memory on one host: the sender writes a bucket into a file under /dev/shm, the
receiver copies it out before it answers, so the sender may reuse the file at once (an
engine that kept views into a reused buffer would load the next bucket's bytes)."""

from __future__ import annotations

import os
import re
import uuid
from pathlib import Path

from rollout.contract.errors import InvalidRequestError
from rollout.kit.buckets import Bucket, layout, metas_from_layout

SHM_DIR = Path("/dev/shm")
NAME = re.compile(r"^rollout-weights-[0-9a-f]{32}$")  # the only files a receiver opens


class ShmSender:
    """One shared-memory file per sender, grown to the largest bucket and reused."""

    def __init__(self):
        self.path = SHM_DIR / f"rollout-weights-{uuid.uuid4().hex}"
        self._size = 0

    def put(self, bucket: Bucket) -> dict:
        """Write the bucket's bytes; returns the message that tells a receiver where."""
        import torch

        if bucket.nbytes > self._size:
            with open(self.path, "wb") as f:
                f.truncate(bucket.nbytes)
            self._size = bucket.nbytes
        if bucket.nbytes:
            target = torch.from_file(str(self.path), shared=True, size=bucket.nbytes,
                                     dtype=torch.uint8)
            target.copy_(bucket.data.reshape(-1).cpu())
        return {"transport": "shm", "name": self.path.name, **layout(bucket)}

    def close(self) -> None:
        self.path.unlink(missing_ok=True)

    def __enter__(self) -> ShmSender:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def receive_shm(message: dict) -> Bucket:
    """The bucket a `ShmSender.put` message names, copied into this process's memory."""
    import torch

    nbytes, metas = metas_from_layout(message)
    name = str(message.get("name", ""))
    if not NAME.match(name):
        raise InvalidRequestError("name", f"got {name!r}", "rollout-weights-<32 hex digits>")
    path = SHM_DIR / name
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        raise InvalidRequestError("name", f"{name!r} does not exist in {SHM_DIR} (another "
                                  "host, or the sender closed it)", "a live sender's file") from None
    if size < nbytes:
        raise InvalidRequestError("nbytes", f"{nbytes} announced, {size} in {name!r}",
                                  "at most the file's size")
    data = torch.empty(nbytes, dtype=torch.uint8)
    if nbytes:
        data.copy_(torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8))
    return Bucket(metas, data)
