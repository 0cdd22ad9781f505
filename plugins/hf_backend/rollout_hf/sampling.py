"""Choosing the next token for every row of a batch, each row with its own parameters."""

from __future__ import annotations

import torch

NO_TOP_K = 0


def filtered_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                    top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Temperature, top-k and top-p applied row by row.

    Returns the sorted token ids and their filtered logits (masked ones are -inf); the
    most likely token always survives.
    """
    scaled = logits / temperature.clamp_min(1e-6)[:, None]
    sorted_logits, sorted_ids = scaled.sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    k = torch.where(top_k > NO_TOP_K, top_k, logits.shape[-1])
    masked = sorted_logits.masked_fill(rank >= k[:, None], float("-inf"))
    probs = masked.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass of the tokens ranked above this one
    masked = masked.masked_fill(before >= top_p[:, None], float("-inf"))
    return sorted_ids, masked


def choose(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
           top_p: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """The next token of each row: argmax where temperature is 0, else a draw from the
    row's own generator (so a seeded row does not depend on its batch)."""
    chosen = logits.argmax(dim=-1)
    sampled = [i for i, g in enumerate(generators) if g is not None]
    if sampled:
        rows = torch.tensor(sampled, device=logits.device)
        ids, masked = filtered_logits(logits[rows], temperature[rows], top_k[rows], top_p[rows])
        probs = masked.softmax(dim=-1)
        for j, i in enumerate(sampled):
            pick = torch.multinomial(probs[j], 1, generator=generators[i])
            chosen[i] = ids[j, pick[0]]
    return chosen
