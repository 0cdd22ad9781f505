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


def prepare_engine(backend: str, images: bool = False) -> None:
    """What an engine needs on this machine before it loads: vLLM a KV cache that fits a
    small machine (and for images the test-only stand-in for torchvision), SGLang without a
    GPU the test-only CPU scaffolding (each from its tests' conftest)."""
    import sys
    from pathlib import Path

    tests = Path(__file__).resolve().parent.parent / "plugins" / f"{backend}_backend" / "tests"
    if backend == "vllm":
        from bench_vllm import use_cpu_defaults

        use_cpu_defaults()
        if images:
            sys.path.insert(0, str(tests))
            import conftest  # noqa: F401 - the torchvision stand-in, on import
    elif backend == "sglang":
        import torch

        if not torch.cuda.is_available():
            sys.path.insert(0, str(tests))
            import conftest  # noqa: F401 - sets up the CPU scaffolding on import
