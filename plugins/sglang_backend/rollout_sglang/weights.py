"""Preparing weight updates for SGLang.

SGLang silently ignores unknown names, and a tensor of the wrong shape kills its scheduler
(and, in process, the host). So every tensor is checked against the checkpoint's names and
shapes, read from the safetensors headers, before anything is sent.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

from rollout import InvalidRequestError
from rollout.buckets import Bucket, iter_unpacked


def checkpoint_shapes(model_dir: str) -> dict[str, tuple[int, ...]]:
    """Parameter names and shapes from the safetensors headers (no tensor is loaded)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
        shapes.update({k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"})
    return shapes


def checked_groups(buckets: Iterable[Bucket], shapes: dict[str, tuple[int, ...]],
                   max_bytes: int) -> Iterator[list]:
    """(name, tensor) lists of about `max_bytes`, every tensor checked. SGLang loads each
    tensor into its slice of a fused parameter, so groups may split a layer."""
    group: list = []
    size = 0
    for name, tensor in iter_unpacked(buckets):
        if name not in shapes:
            raise InvalidRequestError("weights", f"unknown parameter {name!r}",
                                      "the checkpoint's parameter names")
        if tuple(tensor.shape) != shapes[name]:
            raise InvalidRequestError("weights", f"{name!r} has shape {tuple(tensor.shape)}",
                                      f"shape {shapes[name]}")
        if not tensor.is_floating_point():
            raise InvalidRequestError("weights", f"{name!r} has dtype {tensor.dtype}",
                                      "a floating-point dtype")
        group.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
        if size >= max_bytes:
            yield group
            group, size = [], 0
    if group:
        yield group


def serialize(group: list, as_text: bool):
    """SGLang's tensor payload (pickle; tensor data travels through shared memory, so the
    receiver must be on this host). `as_text` gives the base64 form the HTTP API takes."""
    from sglang.srt.utils import MultiprocessingSerializer

    return MultiprocessingSerializer.serialize(group, output_str=as_text)
