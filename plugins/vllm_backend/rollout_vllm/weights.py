"""Preparing weight updates for vLLM.

vLLM fuses q/k/v and gate/up projections, and one reload call must carry every piece of a
fused parameter: split across calls, the weights come out wrong with no error. So tensors
are regrouped by decoder layer, after the checks of `rollout.weights.checkpoint`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

from rollout.weights.buckets import Bucket
from rollout.weights.checkpoint import checked_tensors

LAYER = re.compile(r"^(.*?\blayers\.\d+)\.")


def _group_of(name: str) -> str:
    match = LAYER.match(name)
    return match.group(1) if match else name


def layer_groups(buckets: Iterable[Bucket], shapes: dict[str, tuple[int, ...]],
                 max_bytes: int) -> Iterator[dict]:
    """Checked tensors regrouped so that no decoder layer is split between two groups;
    groups are merged up to about `max_bytes`."""
    group: dict = {}
    size, last = 0, None
    for name, tensor in checked_tensors(buckets, shapes):
        key = _group_of(name)
        if group and key != last and size >= max_bytes:
            yield group
            group, size = {}, 0
        group[name] = tensor.contiguous()
        size += tensor.numel() * tensor.element_size()
        last = key
    if group:
        yield group
