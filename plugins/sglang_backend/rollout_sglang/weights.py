"""Preparing weight updates for SGLang, after the checks of `rollout.weights.checkpoint` (SGLang
silently ignores unknown names, and a wrong shape kills its scheduler)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from rollout.weights.buckets import Bucket
from rollout.weights.checkpoint import checked_tensors


def checked_groups(buckets: Iterable[Bucket], shapes: dict[str, tuple[int, ...]],
                   max_bytes: int) -> Iterator[list]:
    """(name, tensor) lists of about `max_bytes`, every tensor checked. SGLang loads each
    tensor into its slice of a fused parameter, so groups may split a layer."""
    group: list = []
    size = 0
    for name, tensor in checked_tensors(buckets, shapes):
        group.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
        if size >= max_bytes:
            yield group
            group, size = [], 0
    if group:
        yield group


def serialize(group: list, as_text: bool):
    """SGLang's tensor payload (pickle; tensor data travels through shared memory, so the
    receiver must be on this host). `as_text` gives the base64 form the HTTP API takes, for
    a server that is not this process's child: its tensors travel as named files (torch's
    "file_system" sharing), not as file descriptors. That strategy is the whole process's,
    so the one before is put back: an engine in this process, whose scheduler is its
    child, keeps file descriptors, which need no torch_shm_manager (a connection to it
    timed out on a loaded machine)."""
    import torch.multiprocessing
    from sglang.srt.utils import MultiprocessingSerializer

    if not as_text:
        return MultiprocessingSerializer.serialize(group)
    before = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        return MultiprocessingSerializer.serialize(group, output_str=True)
    finally:
        torch.multiprocessing.set_sharing_strategy(before)


def flattened(tensors: dict) -> dict:
    """Tensors as SGLang's flattened bucket (load_format "flattened_bucket"): one new
    buffer of their bytes, and where each lies in it. One tensor to share with the
    scheduler instead of one per tensor (an adapter has hundreds), and a copy of the
    caller's tensors, which SGLang keeps."""
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    bucket = FlattenedTensorBucket(named_tensors=list(tensors.items()))
    return {"flattened_tensor": bucket.get_flattened_tensor(),
            "metadata": bucket.get_metadata()}
