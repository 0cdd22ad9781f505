"""How long `import rollout` takes, and whether it pulls in torch or an engine.

Each measurement is a fresh interpreter; the median of several runs is printed next to the
same measurement for `import asyncio` (a large stdlib package) as a baseline. Target: under 0.2 s, no torch.

    python bench/bench_import.py [--runs 7]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

PROBE = """
import sys, time
t = time.perf_counter()
import {module}
elapsed = time.perf_counter() - t
import json
heavy = [m for m in ("torch", "transformers", "vllm", "sglang", "pyarrow") if m in sys.modules]
print(json.dumps({{"seconds": elapsed, "heavy": heavy}}))
"""


def measure(module: str, runs: int) -> tuple[float, list[str]]:
    samples, heavy = [], []
    for _ in range(runs):
        out = subprocess.run([sys.executable, "-c", PROBE.format(module=module)],
                             capture_output=True, text=True, check=True)
        data = json.loads(out.stdout)
        samples.append(data["seconds"])
        heavy = data["heavy"]
    return statistics.median(samples), heavy


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    baseline, _ = measure("asyncio", args.runs)
    ours, heavy = measure("rollout", args.runs)
    print(f"import asyncio (baseline): {baseline * 1000:7.1f} ms")
    print(f"import rollout:            {ours * 1000:7.1f} ms  (target < 200 ms)")
    print(f"ratio rollout / asyncio: {ours / baseline:.2f}")
    print(f"heavy modules imported by rollout: {heavy or 'none'} (torch imported: {'torch' in heavy})")


if __name__ == "__main__":
    main()
