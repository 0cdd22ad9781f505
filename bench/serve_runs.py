"""Runs in a row against one started server of each contender of bench_serve_vs_vllm.py,
with the CPU seconds each process of the server spent in each run (from /proc, Linux): to
tell a server's stall from its steady speed, and whose process burned the time.

Run in the vLLM environment (scripts/env.sh vllm):
    python bench/serve_runs.py [--runs 8] [--model smollm2] [--only vllm,rollout-async]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from bench_serve_vs_vllm import servers
from common import add_model_argument, model_folder, timed, use_cpu_defaults
from serve_compare import LOAD

TICK = os.sysconf("SC_CLK_TCK")


def process_tree(root: int) -> list[int]:
    """`root` and every process below it."""
    from rollout.kit.process import children

    return [root, *(pid for child in children(root) for pid in process_tree(child))]


def cpu_seconds(root: int) -> dict[str, float]:
    """User and system CPU seconds of each process of the tree, by 'name pid'."""
    seconds = {}
    for pid in process_tree(root):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat.rsplit(")", 1)[1].split()
        seconds[f"{name} {pid}"] = (int(fields[11]) + int(fields[12])) / TICK
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=200)
    parser.add_argument("--only", default="vllm,rollout-async",
                        help="the contenders to run, comma-separated")
    add_model_argument(parser)
    args = parser.parse_args()
    use_cpu_defaults()

    from rollout.kit.process import ServerProcess, free_port
    from rollout.testing.vllm_bench import run_bench

    with tempfile.TemporaryDirectory() as tmp:
        model = model_folder(args.model, tmp)
        served, port = Path(args.model).name, free_port()
        url = f"http://127.0.0.1:{port}"
        for name, argv in servers(model, served, port, ["async"]).items():
            if name not in args.only.split(","):
                continue
            server = ServerProcess(name, argv, die_with_parent=True)
            try:
                server.wait_healthy(f"{url}/health", timeout=600)
                for run in range(args.runs):
                    before, result = cpu_seconds(server.proc.pid), {}
                    wall = timed(lambda: result.update(run_bench(
                        sys.executable, url, served, model, "openai", "/v1/completions",
                        args.prompts, extra=LOAD)))
                    after = cpu_seconds(server.proc.pid)
                    spent = {p: round(after[p] - before[p], 1) for p in after
                             if p in before and after[p] - before[p] >= 0.05}
                    print(f"{name} run {run}: {result['output_throughput']:.0f} tokens/s, "
                          f"TTFT p50 {result['median_ttft_ms']:.0f} ms, {wall:.1f} s; "
                          f"CPU s {spent}", flush=True)
            finally:
                server.stop()


if __name__ == "__main__":
    main()
