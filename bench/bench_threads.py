"""Threads on a shared host: examples/grpo.py through local replicas, with the defaults
against thread counts set by hand, one run after the other on the same cores.

The trainer and the replicas share this machine. The settings compared:
- `defaults`: nothing set. The pool gives each replica as many threads as its share of the
  cores (rollout.service.replicas.cpu_shares), and keeps it to them where its engine binds
  threads to cores (vLLM, SGLang); the trainer uses torch's default (every core).
- `one thread each`: OMP_NUM_THREADS=1 and `--threads 1` (the pool's split is off, as it
  is whenever OMP_NUM_THREADS is set).
- `every core each`: OMP_NUM_THREADS=<cores> for every process, as when nothing splits them.
Printed: seconds per step for each (mean from step 2 on), and the defaults' ratio to the
best hand-set one. Target (issue 34): within 1.2x.

    python bench/bench_threads.py --backend hf --replicas 2 --steps 6 [--model smollm2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "grpo.py"


def settings(cores: int) -> dict[str, tuple[dict, list[str]]]:
    """name -> (environment, trainer flags)."""
    return {"defaults": ({}, []),
            "one thread each": ({"OMP_NUM_THREADS": "1"}, ["--threads", "1"]),
            "every core each": ({"OMP_NUM_THREADS": str(cores)}, ["--threads", str(cores)])}


def run(args, env_extra: dict, flags: list[str]) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "steps.jsonl"
        command = [sys.executable, str(EXAMPLE), "--backend", args.backend, "--replicas",
                   str(args.replicas), "--steps", str(args.steps), "--log", str(log), *flags,
                   *(["--model", args.model, "--task", "sums"] if args.model else [])]
        for option in args.backend_option:
            command += ["--backend-option", option]
        env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout,
                              env={**env, "HF_HUB_OFFLINE": "1", **env_extra})
        if done.returncode != 0:
            sys.exit(f"{command} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
        steps = [json.loads(line) for line in log.read_text().splitlines()]
        return statistics.mean([s["step_s"] for s in steps if "step_s" in s][1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", default="hf")
    parser.add_argument("--backend-option", action="append", default=[])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--model", help="e.g. smollm2 (the sums task); default: the tiny model")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--timeout", type=float, default=1800)
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0))
    times = {name: run(args, env, flags) for name, (env, flags) in settings(cores).items()}
    print(f"| {args.backend}, {args.replicas} replicas, {cores} cores | s/step |")
    print("| --- | --- |")
    for name, seconds in times.items():
        print(f"| {name} | {seconds:.2f} |")
    best = min(v for k, v in times.items() if k != "defaults")
    print(f"defaults / best hand-set: {times['defaults'] / best:.2f}x")


if __name__ == "__main__":
    main()
