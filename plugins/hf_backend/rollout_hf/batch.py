"""The rows that decode together, their KV cache and logits processor, which rows join
and leave.

Rows are left-padded: every row's tokens sit at the right end of the cache, `mask` marks
the real ones, and each row's positions count only its own tokens. So rows of any prompt
length, and rows that joined at any step, decode side by side in one forward pass.
Joining pads the shorter cache on the left and concatenates along the batch; leaving
selects rows and then drops the left columns no remaining row uses.

Only plain `DynamicLayer`s are touched (a `DynamicCache()` made without a config has
nothing else), through `cache.layers[i].keys/values`, which transformers 5.19 and 5.23
both have.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from rollout.kit.sampler import LogitsProcessor, Row

from rollout_hf.vision import prefill_inputs


class Batch:
    def __init__(self, rows: list[Row] | None = None, cache: DynamicCache | None = None,
                 mask: torch.Tensor | None = None, deltas: torch.Tensor | None = None):
        self.rows: list[Row] = rows or []
        self.cache = cache
        self.mask = mask  # [rows, width]: 1 where the cache holds one of the row's tokens
        # [rows, 1]: a position offset per row (M-RoPE after images, vision.py); None: all 0
        self.deltas = deltas
        self.next_ids: torch.Tensor | None = None  # [rows]: chosen, not yet in the cache
        self.processor: LogitsProcessor | None = None  # None: no row uses one
        self.processor_stale = False  # rows joined: rebuild the processor for the batch

    def __len__(self) -> int:
        return len(self.rows)

    def decode(self, model) -> torch.Tensor:
        """Feed each row its last chosen token; the next-token logits [rows, vocab]."""
        mask = torch.cat([self.mask, self.mask.new_ones(len(self.rows), 1)], dim=-1)
        positions = self.mask.sum(dim=-1, keepdim=True)  # tokens the row has so far
        if self.deltas is not None:
            positions = positions + self.deltas
        out = model(input_ids=self.next_ids[:, None], attention_mask=mask,
                    position_ids=positions, past_key_values=self.cache, use_cache=True,
                    logits_to_keep=1)
        self.mask = mask
        return out.logits[:, -1, :].float()

    def join(self, other: Batch) -> None:
        """Take `other`'s rows (after this batch's own) and their cache."""
        if not self.rows:
            self.rows, self.cache, self.mask = other.rows, other.cache, other.mask
            self.deltas = other.deltas
            return
        if self.deltas is not None or other.deltas is not None:
            self.deltas = torch.cat([_deltas(self), _deltas(other)])
        width = max(self.mask.shape[1], other.mask.shape[1])
        for mine, theirs in zip(self.cache.layers, other.cache.layers, strict=True):
            if mine.keys is None or mine.keys.numel() == 0:
                continue  # a layer that keeps no cache of its own (KV sharing)
            mine.keys = torch.cat([_left_pad(mine.keys, width, 2),
                                   _left_pad(theirs.keys, width, 2)])
            mine.values = torch.cat([_left_pad(mine.values, width, 2),
                                     _left_pad(theirs.values, width, 2)])
        self.mask = torch.cat([_left_pad(self.mask, width, 1), _left_pad(other.mask, width, 1)])
        self.rows = self.rows + other.rows

    def keep(self, keep: list[int]) -> None:
        """Keep only the rows at `keep` (and their next tokens), in that order."""
        if len(keep) == len(self.rows):
            return
        if not keep:
            self.rows, self.cache, self.mask, self.next_ids = [], None, None, None
            self.deltas = None
            return
        index = torch.tensor(keep, device=self.mask.device)
        used = self.mask[index].any(dim=0)
        start = int(used.nonzero()[0, 0])  # left columns no remaining row uses any more
        for layer in self.cache.layers:
            if layer.keys is not None and layer.keys.numel():
                layer.keys = layer.keys[index, :, start:]
                layer.values = layer.values[index, :, start:]
        self.mask = self.mask[index, start:]
        if self.next_ids is not None:
            self.next_ids = self.next_ids[index]
        if self.deltas is not None:
            self.deltas = self.deltas[index]
        self.rows = [self.rows[i] for i in keep]


def prefill(model, rows: list[Row], pad_id: int, device: torch.device, every: bool = False,
            ) -> tuple[Batch, torch.Tensor, torch.Tensor | None]:
    """Run the prompts of new rows; their batch, next-token logits [rows, vocab] and, with
    `every`, the logits at every position [rows, width, vocab] (left-padded), to score the
    prompts."""
    width = max(len(r.prompt) for r in rows)
    input_ids = torch.tensor([[pad_id] * (width - len(r.prompt)) + r.prompt for r in rows],
                             device=device)
    mask = torch.tensor([[0] * (width - len(r.prompt)) + [1] * len(r.prompt) for r in rows],
                        device=device)
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    deltas, images = None, {}
    if any(getattr(r.owner, "vision", None) is not None for r in rows):
        positions, deltas, images = prefill_inputs(model, rows, input_ids, mask)
    cache = DynamicCache()
    out = model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                past_key_values=cache, use_cache=True, logits_to_keep=0 if every else 1,
                **images)
    return (Batch(list(rows), cache, mask, deltas), out.logits[:, -1, :].float(),
            out.logits if every else None)


def _deltas(batch: Batch) -> torch.Tensor:
    if batch.deltas is not None:
        return batch.deltas
    return torch.zeros(len(batch.rows), 1, dtype=torch.long, device=batch.mask.device)


def _left_pad(tensor: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    missing = width - tensor.shape[dim]
    if missing == 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)
