"""What every benchmark here shares: the prompts, the stopwatch, and the engine benches'
workload arguments."""

from __future__ import annotations

import argparse
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


def workload_parser() -> argparse.ArgumentParser:
    """`--prompts`, `--tokens` and `--rounds`, as the engine throughput benches take them."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    return parser
