"""Probes: greedy tokens for fixed prompts, the fingerprint of the weights a sampler
serves (and of a LoRA adapter on them)."""

from __future__ import annotations

from rollout import Rollout, Sampler

PROBE_PROMPTS = ("the ka lo", "def x", "1 2 3 +", "mi ne su ta ri po")
PROBE_TOKENS = 12


def probe_requests(adapter: str | None = None) -> list[dict]:
    return [{"id": f"probe-{i}-{adapter}", "prompt": p, "adapter": adapter,
             "sampling": {"temperature": 0.0, "max_tokens": PROBE_TOKENS, "ignore_eos": True}}
            for i, p in enumerate(PROBE_PROMPTS)]


def probe(backend: Sampler, adapter: str | None = None) -> tuple[tuple[int, ...], ...]:
    """Greedy tokens for fixed prompts: the fingerprint of the weights now loaded (with
    `adapter`, of that LoRA adapter on them)."""
    return tuple(c.unwrap()[0].token_ids for c in backend.generate(probe_requests(adapter)))


def probe_versions(backend: Rollout) -> set[int | None]:
    return {r.weight_version for c in backend.generate(probe_requests()) for r in c.unwrap()}
