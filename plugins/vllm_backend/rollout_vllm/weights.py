"""Preparing weight updates for vLLM.

vLLM fuses q/k/v and gate/up projections, and one reload call must carry every piece of a
fused parameter: split across calls, the weights come out wrong with no error. So tensors
are regrouped by decoder layer. A reload that fails leaves vLLM's model unusable, so names
and shapes are checked against the checkpoint before anything is sent.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

from rollout import InvalidRequestError
from rollout.buckets import Bucket, iter_unpacked

LAYER = re.compile(r"^(.*?\blayers\.\d+)\.")


def checkpoint_shapes(model_dir: str) -> dict[str, tuple[int, ...]]:
    """Parameter names and shapes read from the safetensors headers (no tensor is loaded)."""
    shapes = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
        shapes.update({k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"})
    return shapes


def _group_of(name: str) -> str:
    match = LAYER.match(name)
    return match.group(1) if match else name


def layer_groups(buckets: Iterable[Bucket], shapes: dict[str, tuple[int, ...]],
                 max_bytes: int) -> Iterator[dict]:
    """Checked tensors regrouped so that no decoder layer is split between two groups;
    groups are merged up to about `max_bytes`."""
    group: dict = {}
    size, last = 0, None
    for name, tensor in iter_unpacked(buckets):
        if name not in shapes:
            raise InvalidRequestError("weights", f"unknown parameter {name!r}",
                                      "the checkpoint's parameter names")
        if tuple(tensor.shape) != shapes[name]:
            raise InvalidRequestError("weights", f"{name!r} has shape {tuple(tensor.shape)}",
                                      f"shape {shapes[name]}")
        key = _group_of(name)
        if group and key != last and size >= max_bytes:
            yield group
            group, size = {}, 0
        group[name] = tensor.contiguous()
        size += tensor.numel() * tensor.element_size()
        last = key
    if group:
        yield group


def to_bytes(group: dict) -> bytes:
    from safetensors.torch import save

    return save(group)
