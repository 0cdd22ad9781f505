"""Which weights made each token, checked: a sampler's logprobs against the trainer's own
forward pass under the weights of each token's version (`Result.weight_versions`).

Where the engine recomputes the KV cache after an update (every backend's keep does: see
`Capabilities.keep`), a token's logprob is exactly that of its version's weights over the
whole sequence, so the largest gap stays within the engine-trainer noise (about 1e-5 in
float32); a span off by one token shows as a gap of the size of one update.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from rollout.contract.schemas import Result

# version -> the results that hold tokens of it -> per result, the logprob of every output
# token under that version's weights
LogprobsUnder = Callable[[int | None, list[Result]], Sequence[Sequence[float]]]


def versions_in(results: Sequence[Result]) -> set[int | None]:
    return {x.version for r in results for x in r.weight_versions}


def largest_gap(results: Sequence[Result], logprobs_under: LogprobsUnder) -> float:
    """The largest |sampler logprob - logprob under the weights of the token's version|
    over every output token of `results` (which need `logprobs`)."""
    return max(first_and_later_gaps(results, logprobs_under))


def first_and_later_gaps(results: Sequence[Result],
                         logprobs_under: LogprobsUnder) -> tuple[float, float]:
    """`largest_gap` over the first span of each result, and over the spans after it.
    Under `pause="keep_kv"` the later ones were made over a KV cache that older weights
    computed, so they are not exact (docs/weights.md, "What kept KV costs")."""
    worst = [0.0, 0.0]  # over first spans, over later ones
    for version in versions_in(results):
        holding = [r for r in results if any(x.version == version for x in r.weight_versions)]
        for result, under in zip(holding, logprobs_under(version, holding)):
            under = under.tolist() if hasattr(under, "tolist") else under  # (one copy)
            for i, span in enumerate(result.weight_versions):
                if span.version == version:
                    for t in range(span.start, span.end):
                        gap = abs(float(under[t]) - result.logprobs[t])
                        worst[i > 0] = max(worst[i > 0], gap)
    return worst[0], worst[1]
