"""Servers compared under vLLM's own serving benchmark (`vllm.benchmarks.serve`): random
dataset, 32 tokens in and 32 out, 64 requests at once, streamed, on /v1/completions. Each
server runs alone (two engines on a small machine would slow each other), alternating for
`rounds` rounds after a warm-up round each, each round in the order of the one before reversed
(so that neither always runs right after the other); the medians are compared with the
baseline's, and so is each round's own ratio. Each server is started afresh for its turn
and sent one batch of the load (64 requests) before the measured run, so that a run
measures the server at work, not its first batch's one-off costs.
The benchmark sends `repetition_penalty`, which rollout honours."""

from __future__ import annotations

import statistics
import sys
from collections.abc import Mapping, Sequence

CONCURRENCY = 64
LOAD = ("--random-input-len", "32", "--random-output-len", "32", "--max-concurrency",
        str(CONCURRENCY), "--ignore-eos")
KEYS = ("output_throughput", "median_ttft_ms")


def rollout_serve(backend: str, model: str, served: str, port: int, mode: str,
                  options: Mapping[str, object]) -> list[str]:
    """`rollout serve`'s command line for one backend mode, with backend options (`-o`)."""
    return [sys.executable, "-m", "rollout", "serve", "--backend", backend, "--model", model,
            "--served-model-name", served, "--port", str(port), "-o", f"mode={mode}",
            *(arg for key, value in options.items() for arg in ("-o", f"{key}={value}"))]


def measure(name: str, argv: Sequence[str], port: int, model: str, served: str, prompts: int,
            bench_python: str) -> dict:
    """Start the server `argv` (listening on `port`), warm it with one batch, run the
    benchmark, stop it."""
    from rollout.kit.process import ServerProcess
    from rollout.testing.vllm_bench import run_bench

    url = f"http://127.0.0.1:{port}"
    server = ServerProcess(name, argv, die_with_parent=True)
    try:
        server.wait_healthy(f"{url}/health", timeout=600)
        for count in (CONCURRENCY, prompts):  # the warm-up batch, then the measured run
            result = run_bench(bench_python, url, served, model, "openai", "/v1/completions",
                               count, extra=LOAD)
        assert (result["completed"], result["failed"]) == (prompts, 0), result
        return result
    finally:
        server.stop()


def compare(contenders: Mapping[str, Sequence[str]], baseline: str, port: int, model: str,
            served: str, prompts: int, rounds: int, bench_python: str, label: str) -> dict:
    """Every contender, round after round; prints each round, the medians and each one's
    ratios to `baseline` (throughput: higher is better; TTFT: lower is better)."""
    results: dict[str, list[dict]] = {name: [] for name in contenders}
    order = list(contenders)
    for round_ in range(rounds + 1):
        for name in order:
            result = measure(name, contenders[name], port, model, served, prompts,
                             bench_python)
            if round_:  # the first round warms caches up
                results[name].append(result)
            print(f"round {round_} {name}: {result['output_throughput']:.1f} tokens/s, "
                  f"TTFT p50 {result['median_ttft_ms']:.1f} ms", flush=True)
        order.reverse()
    median = {name: {key: statistics.median(r[key] for r in rs) for key in KEYS}
              for name, rs in results.items()}
    print(f"model {label}: {prompts} prompts, 32 in / 32 out, concurrency 64, "
          f"median of {rounds}:")
    for name, m in median.items():
        print(f"  {name:16s} {m['output_throughput']:8.1f} tokens/s  "
              f"TTFT p50 {m['median_ttft_ms']:8.1f} ms")
    base = median[baseline]
    for name, m in median.items():
        if name != baseline:
            print(f"  {name}: output throughput ratio (rollout / {baseline}) "
                  f"{m['output_throughput'] / base['output_throughput']:.3f}, "
                  f"TTFT p50 ratio {m['median_ttft_ms'] / base['median_ttft_ms']:.3f}")
            # Each round's own ratio too: the two ran minutes apart, so a machine that
            # drifts over the run moves both alike.
            parts = []
            for key, label in zip(KEYS, ("throughput", "TTFT p50")):
                paired = [r[key] / b[key] for r, b in zip(results[name], results[baseline])]
                parts.append(f"{label} {' / '.join(f'{x:.2f}' for x in paired)} "
                               f"(median {statistics.median(paired):.3f})")
            print(f"  {name}: round by round, {', '.join(parts)}")
    return median
