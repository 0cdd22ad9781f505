"""Choosing the next token for every row of a batch, each row with its own parameters."""

from __future__ import annotations

import torch

NO_TOP_K = 0


def filtered_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                    top_p: torch.Tensor, min_p: torch.Tensor | None = None,
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Temperature, min-p, top-k and top-p applied row by row, in vLLM's order.

    Returns the sorted token ids and their filtered logits (masked ones are -inf); the
    most likely token always survives.
    """
    scaled = logits / temperature.clamp_min(1e-6)[:, None]
    if min_p is not None:
        # p < min_p * p_max  <=>  logit < max logit + log(min_p); log(0) = -inf keeps all.
        # vLLM applies it before top-k/top-p, so top-p sees the renormalised survivors.
        floor = scaled.amax(dim=-1, keepdim=True) + min_p.log()[:, None]
        scaled = scaled.masked_fill(scaled < floor, float("-inf"))
    sorted_logits, sorted_ids = scaled.sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    k = torch.where(top_k > NO_TOP_K, top_k, logits.shape[-1])
    masked = sorted_logits.masked_fill(rank >= k[:, None], float("-inf"))
    probs = masked.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass of the tokens ranked above this one
    masked = masked.masked_fill(before >= top_p[:, None], float("-inf"))
    return sorted_ids, masked


def sampled_from(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                 top_p: torch.Tensor, min_p: torch.Tensor | None = None) -> tuple:
    """What each row draws from, from one `filtered_logits`: its log-probabilities (vLLM's
    `processed_logprobs`: the kept logits renormalised, -inf elsewhere; a greedy row's are
    its logits' log_softmax, unscaled and untruncated), and its kept ids most likely first
    (None for a greedy row, whose chosen token alone is kept)."""
    logprobs = logits.log_softmax(dim=-1)
    kept: list = [None] * len(logits)
    sampled = (temperature > 0).nonzero()[:, 0]
    if len(sampled):
        ids, masked = filtered_logits(logits[sampled], temperature[sampled], top_k[sampled],
                                      top_p[sampled], None if min_p is None else min_p[sampled])
        logprobs[sampled] = torch.empty_like(masked).scatter_(1, ids, masked.log_softmax(dim=-1))
        alive = masked > float("-inf")
        for j, i in enumerate(sampled.tolist()):
            kept[i] = ids[j][alive[j]]
    return logprobs, kept


def choose(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
           top_p: torch.Tensor, generators: list[torch.Generator | None],
           min_p: torch.Tensor | None = None) -> torch.Tensor:
    """The next token of each row: argmax where temperature is 0, else a draw from the
    row's own generator (so a seeded row does not depend on its batch). `min_p` is None
    when no row uses it (the common case pays nothing for it)."""
    chosen = logits.argmax(dim=-1)
    sampled = [i for i, g in enumerate(generators) if g is not None]
    if sampled:
        rows = torch.tensor(sampled, device=logits.device)
        ids, masked = filtered_logits(logits[rows], temperature[rows], top_k[rows], top_p[rows],
                                      None if min_p is None else min_p[rows])
        probs = masked.softmax(dim=-1)
        for j, i in enumerate(sampled):
            pick = torch.multinomial(probs[j], 1, generator=generators[i])
            chosen[i] = ids[j, pick[0]]
    return chosen
