"""CUDA IPC on one GPU: for an engine on the trainer's own GPU, where a collective cannot
run (NCCL puts at most one rank on a GPU). The sender packs a bucket into one CUDA buffer
of its own, grown to the largest bucket and reused; the message carries the buffer's IPC
handle as JSON (never pickle). The receiver opens the handle and copies the bytes into its
own memory before it answers, so the sender may reuse the buffer at once (the same hazard
as a reused shared-memory file).

Written against torch's own IPC calls (`UntypedStorage._share_cuda_` and
`_new_shared_cuda`, which `torch.multiprocessing` uses); it needs a GPU and has not run on
this project's CPU CI. Where this process sees no GPU it is refused with the reason.
"""

from __future__ import annotations

import base64
from typing import TYPE_CHECKING

from rollout.contract.errors import InvalidRequestError, UnsupportedError
from rollout.weights.buckets import Bucket, layout, metas_from_layout, pack_into, packed_layout

if TYPE_CHECKING:
    import torch

# What `_share_cuda_` returns, in order; the bytes ones travel as base64.
HANDLE_FIELDS = ("device", "handle", "size", "offset", "ref_counter_handle",
                 "ref_counter_offset", "event_handle", "event_sync_required")


def require() -> None:
    """Raise where this process cannot send or receive CUDA IPC handles."""
    import torch

    if not torch.cuda.is_available():
        raise UnsupportedError("cuda_ipc", "it shares CUDA memory and this process sees no "
                               "GPU; use shm on one host, or gloo")


class CudaIpcSender:
    """One CUDA buffer per sender, on `device`, grown to the largest bucket and reused."""

    def __init__(self, device: int | None = None):
        import torch

        require()
        self.device = torch.device("cuda", torch.cuda.current_device() if device is None
                                   else device)
        self._buffer: torch.Tensor | None = None

    def put_tensors(self, named: list[tuple[str, torch.Tensor]]) -> dict:
        """Pack (name, tensor) pairs into the buffer; returns the message for a receiver."""
        import torch

        metas, nbytes = packed_layout(named)
        if self._buffer is None or self._buffer.numel() < nbytes:
            self._buffer = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=self.device)
        pack_into(self._buffer[:nbytes], metas, named)  # copy_ moves them to the GPU
        torch.cuda.current_stream(self.device).synchronize()  # the bytes are there to read
        shared = self._buffer.untyped_storage()._share_cuda_()
        handle = {field: _encode(value) for field, value in zip(HANDLE_FIELDS, shared)}
        uuid = str(torch.cuda.get_device_properties(self.device).uuid)
        return {"transport": "cuda_ipc", "ipc": {**handle, "device_uuid": uuid},
                **layout(metas, nbytes)}

    def close(self) -> None:
        self._buffer = None

    def __enter__(self) -> CudaIpcSender:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def receive_cuda_ipc(message: dict) -> Bucket:
    """The bucket a `CudaIpcSender` message names, copied into this process's memory on
    the same GPU (found by its UUID: the two processes may number their GPUs differently)."""
    import torch

    require()
    nbytes, metas = metas_from_layout(message)
    ipc = message.get("ipc")
    if not isinstance(ipc, dict) or set(HANDLE_FIELDS) - set(ipc):
        raise InvalidRequestError("ipc", f"got {ipc!r:.120}",
                                  "an object with " + ", ".join(HANDLE_FIELDS))
    device = _local_device(str(ipc.get("device_uuid")))
    args = [_decode(ipc[field]) for field in HANDLE_FIELDS]
    args[0] = device
    if args[2] < nbytes:
        raise InvalidRequestError("nbytes", f"{nbytes} announced, {args[2]} shared",
                                  "at most the shared buffer's size")
    with torch.cuda.device(device):
        storage = torch.UntypedStorage._new_shared_cuda(*args)
        shared = torch.empty(0, dtype=torch.uint8, device=f"cuda:{device}")
        shared.set_(storage, 0, (nbytes,), (1,))
        data = shared.clone()  # ours before we answer: the sender reuses its buffer
        torch.cuda.current_stream(device).synchronize()
    return Bucket(metas, data)


def _local_device(uuid: str) -> int:
    import torch

    for index in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(index).uuid) == uuid:
            return index
    raise InvalidRequestError("ipc.device_uuid", f"no GPU {uuid} in this process",
                              "a GPU this process sees (CUDA IPC works on one host)")


def _encode(value):
    return {"b64": base64.b64encode(value).decode()} if isinstance(value, bytes) else value


def _decode(value):
    if isinstance(value, dict) and isinstance(value.get("b64"), str):
        return base64.b64decode(value["b64"])
    if isinstance(value, (int, bool)):
        return value
    raise InvalidRequestError("ipc", f"got {value!r:.60}", "integers and base64 bytes")
