"""Asynchronous against synchronous RL: examples/grpo.py with `--async 0` (the baseline)
and `--async ETA`, the same run otherwise, one after the other on the same cores.

Each run gets the same split of this machine as a disaggregated deployment has (the
trainer's GPUs are not the rollout GPUs): the trainer one core and the engine another.
In process, the example runs under `taskset -c CORES` with `--threads 1`, so the trainer's
thread and the engine's thread each compute on one thread. Printed: per run, seconds per
step (mean from step 2 on), held-out accuracy before and after, the share of tokens that
older weights sampled; then each asynchronous run's speed-up in steps per second over the
synchronous one, and its accuracy difference. Targets (issue 33): ETA 1 >= 1.4x the
synchronous steps per second, held-out accuracy within 5 points.

    python bench/bench_async_rl.py --backend hf --etas 1,2 --steps 60 [--seeds 0,1,2]
        [--backend-option dtype=float32] [--logs DIR]
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


def run(args, eta: int, seed: int) -> dict:
    log = Path(args.logs) / f"{args.backend}-eta{eta}-seed{seed}.jsonl"
    flags = ["--task", "sums", "--backend", args.backend, "--steps", str(args.steps),
             "--prompts", "2", "--group-size", "8", "--max-tokens", "16", "--lr", "1e-5",
             "--eval-every", str(args.eval_every), "--seed", str(seed), "--async", str(eta),
             "--threads", "1", "--check-every", str(args.check_every), "--log", str(log)]
    for option in args.backend_option:
        flags += ["--backend-option", option]
    command = ["taskset", "-c", args.cores, sys.executable, str(EXAMPLE), *flags]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, env=env,
                          timeout=args.timeout)
    if done.returncode != 0:
        sys.exit(f"eta {eta}, seed {seed} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    steps = [json.loads(line) for line in log.read_text().splitlines()]
    timed = [s for s in steps if "step_s" in s][1:]  # step 1 warms up
    evals = [s for s in steps if "accuracy" in s]
    return {"eta": eta, "seed": seed, "s_per_step": statistics.mean(s["step_s"] for s in timed),
            "before": evals[0]["accuracy"], "after": evals[-1]["accuracy"],
            "stale_tokens": statistics.mean(s["stale_token_share"] for s in timed),
            "max_logprob_diff": json.loads(done.stdout.strip().splitlines()[-1])[
                "max_logprob_diff"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", default="hf")
    parser.add_argument("--backend-option", action="append", default=[])
    parser.add_argument("--etas", default="1", help="asynchronous runs, besides eta 0")
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--check-every", type=int, default=10)
    parser.add_argument("--cores", default="0,1")
    parser.add_argument("--logs", default="bench-async-logs")
    parser.add_argument("--timeout", type=float, default=3600)
    args = parser.parse_args()
    Path(args.logs).mkdir(parents=True, exist_ok=True)
    etas = [0] + [int(e) for e in args.etas.split(",")]
    runs = [run(args, eta, int(seed)) for seed in args.seeds.split(",") for eta in etas]
    print("| eta | seed | s/step | accuracy before | after | stale tokens | max logprob diff |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in runs:
        print(f"| {r['eta']} | {r['seed']} | {r['s_per_step']:.2f} | {r['before']:.2f} | "
              f"{r['after']:.2f} | {r['stale_tokens']:.0%} | {r['max_logprob_diff']:.1e} |")
    sync = [r for r in runs if r["eta"] == 0]
    for eta in etas[1:]:
        mine = [r for r in runs if r["eta"] == eta]
        speedup = statistics.mean(s["s_per_step"] for s in sync) / statistics.mean(
            r["s_per_step"] for r in mine)
        gap = 100 * (statistics.mean(r["after"] for r in mine)
                     - statistics.mean(s["after"] for s in sync))
        print(f"eta {eta}: {speedup:.2f}x the synchronous steps per second (target >= 1.4), "
              f"held-out accuracy {gap:+.0f} points (target within 5)")


if __name__ == "__main__":
    main()
