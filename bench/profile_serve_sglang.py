"""Where `rollout serve --backend sglang` (engine mode) and SGLang's own server spend their
CPU under vLLM's serving benchmark (the load of bench_serve_vs_sglang.py): each server
alone, a warm-up run, then `--runs` runs under py-spy, one on the API process and one on
SGLang's scheduler process; prints each run's throughput and TTFT and each process's CPU
seconds (from /proc), and writes py-spy's raw profiles to `--out` (one line per stack:
frames then a sample count; `flamegraph.pl` draws them).

Run in the SGLang environment, with py-spy on PATH (or --py-spy) and a Python with vLLM:
    python bench/profile_serve_sglang.py --bench-python VLLM_ENV_PYTHON [--model smollm2]
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_serve_vs_sglang import servers
from common import add_model_argument, model_folder
from serve_compare import LOAD

PROMPTS = 200


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def process_tree(pid: int) -> list[int]:
    from rollout.kit.process import children

    return [pid, *(p for child in children(pid) for p in process_tree(child))]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", default="profiles")
    parser.add_argument("--py-spy", default=shutil.which("py-spy"))
    parser.add_argument("--bench-python", default=os.environ.get("ROLLOUT_VLLM_PYTHON"))
    add_model_argument(parser)
    args = parser.parse_args()
    if not args.bench_python or not args.py_spy:
        parser.error("--bench-python (a Python with vLLM) and py-spy are needed")
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "plugins" /
                               "sglang_backend" / "tests"))
        import conftest  # noqa: F401 - sets up the CPU scaffolding on import

    from rollout.kit.process import ServerProcess, free_port
    from rollout.testing.vllm_bench import run_bench

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        model = model_folder(args.model, tmp)
        port = free_port()
        url = f"http://127.0.0.1:{port}"

        def bench() -> dict:
            return run_bench(args.bench_python, url, "m", model, "openai", "/v1/completions",
                             PROMPTS, extra=LOAD)

        for name, argv in servers(model, "m", port, ["engine"], device).items():
            server = ServerProcess(name, argv, die_with_parent=True)
            try:
                server.wait_healthy(url + "/health", timeout=600)
                bench()  # warm-up
                procs = process_tree(server.proc.pid)
                scheduler = next(p for p in procs
                                 if b"scheduler" in Path(f"/proc/{p}/cmdline").read_bytes())
                spies = [subprocess.Popen(
                    [args.py_spy, "record", "--rate", "200", "--format", "raw", "--nonblocking",
                     "-o", str(out / f"{name}-{part}.txt"), "--pid", str(pid)],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                    for part, pid in (("api", server.proc.pid), ("scheduler", scheduler))]
                before = {pid: cpu_seconds(pid) for pid in procs}
                runs = [bench() for _ in range(args.runs)]
                after = {pid: cpu_seconds(pid) for pid in procs}
                for spy in spies:
                    spy.send_signal(signal.SIGINT)
                    spy.wait(60)
                print(f"{name}: " + ", ".join(
                    f"{r['output_throughput']:.0f} tokens/s (TTFT p50 {r['median_ttft_ms']:.0f} ms)"
                    for r in runs))
                for pid in procs:
                    command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
                    print(f"  {command.decode()[-24:]:>24s}: "
                          f"{(after[pid] - before[pid]) / args.runs:.2f} CPU s per run")
            finally:
                server.stop()


if __name__ == "__main__":
    main()
