"""What a model folder's checkpoint holds, read without loading it, and the check of new
weights against it. Engines react badly to wrong weights (vLLM is left unusable, SGLang
ignores unknown names and crashes on a wrong shape), so backends check before sending."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from rollout.weights.buckets import Bucket, iter_unpacked
from rollout.contract.errors import InvalidRequestError

if TYPE_CHECKING:
    import torch


def checkpoint_shapes(model_dir: str | Path) -> dict[str, tuple[int, ...]]:
    """Parameter names and shapes from the safetensors headers (no tensor is loaded)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
        shapes.update({k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"})
    return shapes


def checked_tensors(buckets: Iterable[Bucket], shapes: dict[str, tuple[int, ...]]
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """The buckets' tensors, each checked against the checkpoint's names and shapes."""
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
        yield name, tensor
