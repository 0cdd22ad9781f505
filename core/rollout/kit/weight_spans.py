"""A sample's tokens in runs of the weights that made them, from the spans an engine reports
as it ends a sample (SGLang's `weight_versions`, vLLM's): what a backend that keeps requests
across a "keep_kv" update gives out once the sample ends."""

from __future__ import annotations

from rollout.contract.errors import GenerationError


def runs_of(before: int, end: int, spans) -> list[tuple[int, int, int]]:
    """The sample's tokens [before, end) in runs (updates, a, b), with a and b counted from
    `before`, from the engine's (updates, start, end) spans over all its tokens. A token no
    span covers fails the sample, rather than be dropped or mislabelled."""
    runs = []
    for update, first, last in spans:
        a, b = max(first, before), min(last, end)
        if a < b:
            runs.append((update, a - before, b - before))
    if sum(b - a for _, a, b in runs) != end - before:
        raise GenerationError(f"the engine's weight versions {list(spans)} do not cover "
                              f"this sample's tokens {before} to {end}")
    return runs
