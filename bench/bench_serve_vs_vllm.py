"""`rollout serve --backend vllm` against vLLM's own OpenAI server, under vLLM's own serving
benchmark (`vllm.benchmarks.serve`): random dataset, 200 prompts, 32 tokens in and 32 out,
64 requests at once, streamed, on /v1/completions. The benchmark sends
`repetition_penalty`, which rollout honours.

rollout runs the vLLM backend in each of `--modes` (comma-separated, default `async`:
vLLM's AsyncLLM with its engine core in a child process, as vLLM's own server runs it;
`engine`: its LLMEngine stepped in the server's own process).

The servers run one at a time (two engines on a small machine would slow each other),
alternating for `--rounds` rounds after a warm-up round each; medians are compared.
Targets: output throughput ratio (rollout / vLLM) >= 1.0, TTFT p50 ratio <= 1.2.

The model is the tiny one, or `--model smollm2` (the dataset's random token ids are drawn
from the model's own vocabulary).

Run in the vLLM environment (scripts/env.sh vllm):
    python bench/bench_serve_vs_vllm.py [--prompts 200] [--rounds 3] [--modes async,engine]
                                        [--model smollm2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from bench_vllm import SETTINGS
from common import add_model_argument, model_folder, use_cpu_defaults

LOAD = ("--random-input-len", "32", "--random-output-len", "32", "--max-concurrency", "64",
        "--ignore-eos")


def servers(model: str, served: str, port: int, modes: list[str]) -> dict[str, list[str]]:
    engine = ["--dtype", SETTINGS["dtype"], "--enforce-eager"]
    contenders = {
        "vllm": [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                 "--served-model-name", served, "--port", str(port), *engine]}
    for mode in modes:
        contenders[f"rollout-{mode}"] = [
            sys.executable, "-m", "rollout", "serve", "--backend", "vllm", "--model", model,
            "--served-model-name", served, "--port", str(port), "-o", f"mode={mode}",
            "-o", "dtype=float32", "-o", "enforce_eager=true"]
    return contenders


def measure(argv: list[str], port: int, model: str, served: str, prompts: int) -> dict:
    from rollout.kit.process import ServerProcess
    from rollout.testing.vllm_bench import run_bench

    server = ServerProcess(argv[2], argv, die_with_parent=True)
    try:
        server.wait_healthy(f"http://127.0.0.1:{port}/health", timeout=600)
        result = run_bench(sys.executable, f"http://127.0.0.1:{port}", served, model, "openai",
                           "/v1/completions", prompts, extra=LOAD)
        assert (result["completed"], result["failed"]) == (prompts, 0), result
        return result
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--modes", default="async",
                        help="the vLLM backend's modes to run rollout in, comma-separated")
    add_model_argument(parser)
    args = parser.parse_args()
    use_cpu_defaults()

    from rollout.kit.process import free_port

    with tempfile.TemporaryDirectory() as tmp:
        model = model_folder(args.model, tmp)
        served = Path(args.model).name  # the tiny model's served name stays "tiny"
        port = free_port()
        contenders = servers(model, served, port, args.modes.split(","))
        results: dict[str, list[dict]] = {name: [] for name in contenders}
        for round_ in range(args.rounds + 1):
            for name, argv in contenders.items():
                result = measure(argv, port, model, served, args.prompts)
                if round_:  # the first round warms caches up
                    results[name].append(result)
                print(f"round {round_} {name}: {result['output_throughput']:.1f} tokens/s, "
                      f"TTFT p50 {result['median_ttft_ms']:.1f} ms", flush=True)
    median = {name: {key: statistics.median(r[key] for r in rs)
                     for key in ("output_throughput", "median_ttft_ms")}
              for name, rs in results.items()}
    print(f"model {args.model}: {args.prompts} prompts, 32 in / 32 out, concurrency 64, "
          f"median of {args.rounds}:")
    for name, m in median.items():
        print(f"  {name:16s} {m['output_throughput']:8.1f} tokens/s  "
              f"TTFT p50 {m['median_ttft_ms']:8.1f} ms")
    base = median.pop("vllm")
    for name, m in median.items():
        print(f"  {name}: output throughput ratio (rollout / vllm) "
              f"{m['output_throughput'] / base['output_throughput']:.3f}, "
              f"TTFT p50 ratio {m['median_ttft_ms'] / base['median_ttft_ms']:.3f}")


if __name__ == "__main__":
    main()
