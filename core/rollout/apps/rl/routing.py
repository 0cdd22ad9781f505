"""Routing replay (R3): a trainer's forward pass that sends each token to the experts the
engine sent it to, so a mixture-of-experts policy is scored on the computation that
sampled it (vLLM #28284, SGLang #17434, verl #4880).

`Result.routed_experts` holds, per token the engine ran (the prompt's and the generated
ones but the last), per MoE layer, the expert ids. `routing_ids` lays results out as a
trainer's batch is laid out; inside `replay_routing` every router takes those experts, and
weighs them with its own probabilities (softmax over the experts, gathered at the given
ids, renormalised where the router renormalises its top k), so the router's weights still
get their gradient. A position given -1 routes as the model would. Exact for softmax top-k
routers (Qwen3-MoE, Mixtral and their kin): replaying a model's own routing changes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager

from rollout.kit.moe import routers


def routing_ids(results: Sequence, width: int, left_pad: Sequence[int] | None = None):
    """A LongTensor [len(results), width, layers, top_k] of each result's routed experts,
    the row of result i starting at column `left_pad[i]` (0 by default: right padding),
    -1 wherever a result gives none (padding, a sequence's last token)."""
    import torch

    first = next(r.routed_experts for r in results if r.routed_experts)
    layers, k = len(first[0]), len(first[0][0])
    ids = torch.full((len(results), width, layers, k), -1, dtype=torch.long)
    for i, result in enumerate(results):
        start = left_pad[i] if left_pad is not None else 0
        routed = torch.tensor(result.routed_experts, dtype=torch.long)[:width - start]
        ids[i, start:start + len(routed)] = routed
    return ids


@contextmanager
def replay_routing(model, ids):
    """Inside, the forward passes of `model` over a batch shaped as `ids` ([batch, seq,
    layers, top_k], from `routing_ids`) route each token to the experts given."""
    import torch

    found = routers(model)
    if not found:
        raise ValueError(f"{type(model).__name__} has no mixture-of-experts router to replay")
    if ids.shape[2] != len(found):
        raise ValueError(f"the routing holds {ids.shape[2]} MoE layers, the model has "
                         f"{len(found)}")

    def replay(layer: int):
        def hook(module, args, output):
            logits, scores, own = output
            given = ids[:, :, layer].reshape(-1, ids.shape[-1]).to(own.device)
            chosen = torch.where(given >= 0, given, own)
            weights = torch.softmax(logits.float(), dim=-1).gather(-1, chosen)
            if getattr(module, "norm_topk_prob", True):  # (Mixtral's router always does)
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return logits, weights.to(scores.dtype), chosen
        return hook

    handles = [router.register_forward_hook(replay(i)) for i, router in enumerate(found)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
