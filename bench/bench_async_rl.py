"""Asynchronous against synchronous RL on the same cores: examples/grpo.py with `--async 0`
(the synchronous loop) and `--async ETA`, the same run otherwise, one after the other.

Each run is `ETA@THREADS`: the example under `taskset -c CORES` with `--threads THREADS`
(torch's threads in its one process, which the trainer's thread and the in-process
engine's thread share). The synchronous loop runs one phase at a time, so giving it every
core (`0@2` on two) is its best setting; the asynchronous loop runs both phases at once,
and `1@1` gives each its own core, as a disaggregated deployment gives the trainer and the
engines their own GPUs; `1@2` gives both phases every core, and the operating system
shares them over time; `1@2:keep_kv` pushes with `--pause keep_kv` (running samples keep
their KV cache, no re-prefill) where the others use the example's default, keep;
`+K=V` adds a backend option to one run (`1@2+nice=0`: vLLM's or SGLang's engine
processes at the trainer's priority; the example's asynchronous loop runs them at 19, so
the trainer gets the cores first and the engine what is left). The
baseline is the fastest synchronous run. Printed: per run,
seconds per step (mean from step 2 on), held-out accuracy before and after, the share of
tokens older weights sampled; then each asynchronous run's speed-up in steps per second
over the baseline, and its accuracy difference. Targets (issue 54): >= 1.0x on this short
task, >= 1.3x on a long-tailed one, held-out accuracy within 5 points.

    python bench/bench_async_rl.py --backend hf --runs 0@1,0@2,1@1,1@2 --steps 60
        [--seeds 0,1,2] [--max-tokens 16] [--backend-option dtype=float32] [--logs DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "grpo.py"


def run(args, spec: str, seed: int) -> dict:
    """One run of the example as `spec` (ETA@THREADS[:PAUSE][+K=V...]) with `seed`."""
    spec_, *options = spec.split("+")
    config, _, pause = spec_.partition(":")
    eta, threads = (int(x) for x in config.split("@"))
    name = "".join(c if c.isalnum() or c in "@.-" else "-" for c in spec)
    log = Path(args.logs) / f"{args.backend}-{name}-seed{seed}.jsonl"
    flags = ["--task", "sums", "--backend", args.backend, "--steps", str(args.steps),
             "--prompts", "2", "--group-size", "8", "--max-tokens", str(args.max_tokens),
             "--lr", "1e-5",
             "--eval-every", str(args.eval_every), "--seed", str(seed), "--async", str(eta),
             "--threads", str(threads), "--check-every", str(args.check_every), "--log", str(log),
             *(["--pause", pause] if pause else [])]
    for option in [*args.backend_option, *options]:
        flags += ["--backend-option", option]
    command = ["taskset", "-c", args.cores, sys.executable, str(EXAMPLE), *flags]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(threads)}
    done = subprocess.run(command, capture_output=True, text=True, env=env,
                          timeout=args.timeout)
    if done.returncode != 0:
        sys.exit(f"{spec}, seed {seed} failed:\n"
                 f"{done.stdout[-2000:]}{done.stderr[-2000:]}")
    steps = [json.loads(line) for line in log.read_text().splitlines()]
    timed = [s for s in steps if "step_s" in s][1:]  # step 1 warms up
    evals = [s for s in steps if "accuracy" in s]
    return {"run": spec, "seed": seed,
            "s_per_step": statistics.mean(s["step_s"] for s in timed),
            "before": evals[0]["accuracy"], "after": evals[-1]["accuracy"],
            "stale_tokens": statistics.mean(s["stale_token_share"] for s in timed),
            "max_logprob_diff": json.loads(done.stdout.strip().splitlines()[-1])[
                "max_logprob_diff"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", default="hf")
    parser.add_argument("--backend-option", action="append", default=[])
    parser.add_argument("--runs", default="0@1,0@2,1@1,1@2",
                        help="ETA@THREADS[:PAUSE][+K=V...], comma-separated; ETA 0 is the "
                             "synchronous loop, PAUSE keep (the default) or keep_kv, K=V a "
                             "backend option of that run")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--check-every", type=int, default=10)
    parser.add_argument("--cores", default="0,1")
    parser.add_argument("--logs", default="bench-async-logs")
    parser.add_argument("--timeout", type=float, default=3600)
    args = parser.parse_args()
    Path(args.logs).mkdir(parents=True, exist_ok=True)
    runs = [run(args, spec, int(seed))
            for seed in args.seeds.split(",") for spec in args.runs.split(",")]
    print("| run | seed | s/step | accuracy before | after | stale tokens | max logprob diff |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in runs:
        print(f"| {r['run']} | {r['seed']} | {r['s_per_step']:.2f} | {r['before']:.2f} | "
              f"{r['after']:.2f} | {r['stale_tokens']:.0%} | {r['max_logprob_diff']:.1e} |")

    def mean(name: str, key: str) -> float:
        return statistics.mean(r[key] for r in runs if r["run"] == name)

    names = list(dict.fromkeys(r["run"] for r in runs))
    synchronous = [n for n in names if n.startswith("0@")]
    if not synchronous:
        sys.exit("no synchronous run (ETA 0) to compare with")
    best = min(synchronous, key=lambda n: mean(n, "s_per_step"))
    for name in names:
        if name != best:
            speedup = mean(best, "s_per_step") / mean(name, "s_per_step")
            gap = 100 * (mean(name, "after") - mean(best, "after"))
            print(f"{name}: {speedup:.2f}x the steps per second of the best synchronous run "
                  f"({best}), held-out accuracy {gap:+.0f} points")


if __name__ == "__main__":
    main()
