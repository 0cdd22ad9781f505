"""How far a trainer is from the policy that sampled its tokens, and the importance
weights that correct for it.

`mismatch` summarises one batch: the k3 estimate of KL(behaviour || trainer) (Schulman's
low-variance estimator, (r - 1) - log r with r the importance ratio), the ratio's mean and
quantiles, and the share of tokens whose ratio is outside [0.9, 1.1] (TRL #6789's
measure). `importance_weights` gives each token's weight in the loss: truncated (TIS) or
masked (MIS) importance sampling, per token or per sequence (verl's rollout correction,
TRL #3867 / #4493). Torch is imported only when the weights are asked for.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

CORRECTIONS = ("none", "tis", "mis", "seq-tis", "seq-mis")
NEAR = (0.9, 1.1)  # a ratio outside this is a token the trainer sees as off-policy


def _floats(values) -> list[float]:
    return values.tolist() if hasattr(values, "tolist") else [float(v) for v in values]


def mismatch(trainer: Sequence, behaviour: Sequence) -> dict[str, float]:
    """One batch's diagnostics over per-sequence logprobs of the same sampled tokens:
    `trainer[i]` and `behaviour[i]` (lists or tensors) for sequence i."""
    log_ratios = [t - b for ts, bs in zip(trainer, behaviour)
                  for t, b in zip(_floats(ts), _floats(bs))]
    if not log_ratios:
        return {}
    ratios = sorted(math.exp(x) for x in log_ratios)

    def quantile(q: float) -> float:
        return ratios[min(len(ratios) - 1, int(q * len(ratios)))]

    return {"kl_k3": sum(math.expm1(x) - x for x in log_ratios) / len(log_ratios),
            "ratio_mean": sum(ratios) / len(ratios),
            "ratio_p05": quantile(0.05), "ratio_p50": quantile(0.5),
            "ratio_p95": quantile(0.95),
            "outside": sum(not NEAR[0] <= r <= NEAR[1] for r in ratios) / len(ratios)}


def importance_weights(trainer: Sequence, behaviour: Sequence, correction: str = "tis",
                       cap: float = 2.0) -> list:
    """Per sequence, each token's weight (a detached tensor): "tis" the token's ratio
    truncated at `cap`; "mis" the ratio where it is at most `cap` and 0 (the token
    masked) above; "seq-tis" / "seq-mis" the same with the sequence's ratio (the product
    of its tokens') given to every token of it; "none" 1."""
    import torch

    if correction not in CORRECTIONS:
        raise ValueError(f"correction {correction!r}: one of {', '.join(CORRECTIONS)}")
    out = []
    for t, b in zip(trainer, behaviour):
        t = t.detach()
        log_ratio = t - torch.as_tensor(b, dtype=t.dtype, device=t.device)
        if correction.startswith("seq-"):
            log_ratio = log_ratio.sum().expand_as(log_ratio)
        ratio = log_ratio.exp()
        if correction == "none":
            ratio = torch.ones_like(ratio)
        elif correction.endswith("tis"):
            ratio = ratio.clamp(max=cap)
        else:
            ratio = torch.where(ratio <= cap, ratio, torch.zeros_like(ratio))
        out.append(ratio)
    return out
