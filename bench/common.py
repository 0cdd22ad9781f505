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


def prepare_engine(backend: str) -> None:
    """What an engine needs on this machine before it loads: vLLM a KV cache that fits a
    small machine, SGLang without a GPU the test-only CPU scaffolding (its conftest)."""
    if backend == "vllm":
        from bench_vllm import use_cpu_defaults

        use_cpu_defaults()
    elif backend == "sglang":
        import sys
        from pathlib import Path

        import torch

        if not torch.cuda.is_available():
            tests = Path(__file__).resolve().parent.parent / "plugins" / "sglang_backend" / "tests"
            sys.path.insert(0, str(tests))
            import conftest  # noqa: F401 - sets up the CPU scaffolding on import
