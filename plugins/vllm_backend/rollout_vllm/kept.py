"""The chunks of a request that a "keep_kv" weight update may run beside: given out as they
come until an update begins, then held until each sample ends, and given out in runs by
the weights that made them, as vLLM reports them (`Spans`). (Those given out before were
made before the update held the scheduler.)"""

from __future__ import annotations

from collections import Counter

import attrs

from rollout import Chunk, GenerationError
from rollout.kit.weight_spans import runs_of

from rollout_vllm.engine import Spans

PER_TOKEN = ("token_ids", "logprobs", "top_logprobs", "sampling_mask")  # Chunk's fields


class KeptRequest:
    def __init__(self, updates: int):
        self.updates = updates  # the updates made when the request came
        self.given: Counter = Counter()  # tokens given out per sample
        self.held: dict[int, list[Chunk]] = {}  # per sample, since an update began
        self.spans: dict[int, list] = {}

    def take(self, item: Chunk | Spans, holding: bool) -> list[Chunk]:
        """The chunks to give out for the engine's `item`; `holding`: whether an update has
        begun since the request came."""
        if isinstance(item, Spans):
            self.spans[item.index] = item.runs
            return []
        if not holding or not (item.token_ids or item.finish_reason):  # (prompt scores)
            self.given[item.index] += len(item.token_ids)
            return [attrs.evolve(item, weight_update=self.updates)]
        held = self.held.setdefault(item.index, [])
        held.append(item)
        if item.finish_reason is None:
            return []
        del self.held[item.index]
        if not any(chunk.token_ids for chunk in held):  # the finish alone
            return [attrs.evolve(item, weight_update=self.updates)]
        return by_weights(held, self.given[item.index], self.spans.pop(item.index, None))


def by_weights(held: list[Chunk], before: int, runs) -> list[Chunk]:
    """A sample's last chunks (with tokens), after `before` tokens given out, as one chunk
    per run of the weights that made them ((updates, start, end) over the sample's tokens),
    the last with the finish."""
    if runs is None:
        raise GenerationError("a weight update ran beside this sample, and vLLM did not say "
                              "which weights made its tokens")
    last = held[-1]
    whole = {name: None if getattr(last, name) is None else
             [x for chunk in held for x in getattr(chunk, name)] for name in PER_TOKEN}
    pieces = [Chunk(last.index, weight_update=update, **{
        name: value if value is None else value[a:b] for name, value in whole.items()})
        for update, a, b in runs_of(before, before + len(whole["token_ids"]), runs)]
    pieces[-1] = attrs.evolve(pieces[-1], finish_reason=last.finish_reason,
                              cached_tokens=last.cached_tokens,
                              routed_experts=last.routed_experts)
    return pieces
