"""The local judge on HumanEval's 164 canonical solutions, against running the same
programs one after another with a plain `subprocess.run` (no harness, no limits, no
namespaces, site-packages loaded: what a first script would do).

Prints seconds and problems per second for both, the ratio, and the local judge against
its target (under 15 s; SandboxFusion without isolation took 19-34 s here).

    python bench/bench_judge.py [--concurrency N] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

from rollout.apps.datasets.humaneval import load_problems
from rollout.apps.judges import ProgramTests, Sample, load_judge

from common import timed

TARGET_SECONDS = 15.0


def samples(problems) -> list[Sample]:
    return [Sample(f"```python\n{p['prompt']}{p['canonical_solution']}```",
                   ProgramTests(p["test"], p["entry_point"], p["prompt"])) for p in problems]


def judge_all(judge, batch) -> None:
    verdicts = judge.judge(batch)
    failed = [v.detail for v in verdicts if v.status != "success"]
    assert not failed, failed[:3]


def plain_sequential(problems) -> None:
    with tempfile.TemporaryDirectory() as folder:
        for p in problems:
            path = os.path.join(folder, "program.py")
            with open(path, "w") as f:
                f.write(f"{p['prompt']}{p['canonical_solution']}\n\n{p['test']}\n\n"
                        f"check({p['entry_point']})\n")
            subprocess.run([sys.executable, path], check=True, timeout=10, cwd=folder,
                           capture_output=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--concurrency", type=int, default=None, help="default: CPU count")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each; the median counts")
    args = parser.parse_args()
    problems = load_problems()
    batch = samples(problems)
    judge = load_judge("local", concurrency=args.concurrency)
    ours = statistics.median(timed(lambda: judge_all(judge, batch)) for _ in range(args.repeat))
    plain = statistics.median(timed(lambda: plain_sequential(problems)) for _ in range(args.repeat))
    count = len(problems)
    print(f"problems: {count}, CPUs: {os.cpu_count()}, judge concurrency: {judge.concurrency}, "
          f"isolation: {judge.isolation}")
    print(f"plain subprocess.run, sequential: {plain:6.2f} s  {count / plain:6.1f} problems/s")
    print(f"local judge:                      {ours:6.2f} s  {count / ours:6.1f} problems/s  "
          f"(target < {TARGET_SECONDS:.0f} s: {'met' if ours < TARGET_SECONDS else 'MISSED'})")
    print(f"speed-up over plain: {plain / ours:.2f}x")


if __name__ == "__main__":
    main()
