"""The figures of an evaluation: accepted@1, unbiased pass@k, mean pass ratio, statuses."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

STANDARD_K = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)


def pass_at_k(n: int, c: int, k: int) -> float:
    """The chance that at least one of k samples drawn without replacement from n, of which
    c are correct, is correct: 1 - C(n-c, k) / C(n, k), as a product (no huge binomials)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    fail = 1.0
    for i in range(n - c + 1, n + 1):
        fail *= 1.0 - k / i
    return 1.0 - fail


def ks_for(n: int) -> list[int]:
    """The k worth reporting for n samples per problem: the usual ones up to n, and n."""
    return sorted({k for k in STANDARD_K if k <= n} | ({n} if n >= 1 else set()))


def summarize(problems: Sequence[Sequence[str]], ratios: Sequence[float],
              case_statuses: Sequence[str]) -> dict:
    """Figures from the sample statuses of each problem (in sample order), and the pass
    ratio of every sample. pass@k uses every k up to the fewest samples any problem has."""
    counted = [p for p in problems if p]
    fewest = min((len(p) for p in counted), default=0)
    return {
        "problems": len(counted),
        "samples": sum(len(p) for p in counted),
        "accepted@1": _mean([p[0] == "success" for p in counted]),
        "pass@k": {str(k): _mean([pass_at_k(len(p), p.count("success"), k) for p in counted])
                   for k in ks_for(fewest)},
        "mean_pass_ratio": _mean(ratios),
        "statuses": _counts([status for p in counted for status in p]),
        "case_statuses": _counts(case_statuses),
    }


def _counts(values: Sequence[str]) -> dict[str, int]:
    from rollout.apps.judges import STATUSES

    found = Counter(values)
    return {status: found.get(status, 0) for status in STATUSES}


def _mean(values) -> float:
    values = list(values)
    return round(sum(values) / len(values), 6) if values else 0.0
