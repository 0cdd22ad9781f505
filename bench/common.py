"""What every benchmark here shares: the prompts and the stopwatch."""

from __future__ import annotations

import time

WORDS = "the ka lo mi ne su ta ri po def return print x y".split()


def prompts(count: int) -> list[str]:
    """`count` deterministic prompts of 3 to 15 words, in the tiny model's vocabulary."""
    return [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(3 + i % 13))
            for i in range(count)]


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started
