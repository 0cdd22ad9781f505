"""`rollout serve` in a child process, for tests whose client runs in another environment's
Python (vLLM's benchmark, TRL's client, the OpenAI Agents SDK)."""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator

MODEL_NAME = "tiny"


@contextlib.contextmanager
def rollout_serve(backend: str, model_dir: str, options: dict | None = None,
                  start_timeout: float = 300) -> Iterator[str]:
    """The base URL of `rollout serve --backend backend` on `model_dir` (served as
    MODEL_NAME), once healthy; stopped on the way out."""
    from rollout.kit.process import ServerProcess, free_port

    port = free_port()
    argv = [sys.executable, "-m", "rollout", "serve", "--backend", backend, "--model",
            model_dir, "--served-model-name", MODEL_NAME, "--port", str(port)]
    for key, value in (options or {}).items():
        argv += ["-o", f"{key}={json.dumps(value)}"]
    server = ServerProcess("rollout-serve", argv, die_with_parent=True)
    try:
        url = f"http://127.0.0.1:{port}"
        server.wait_healthy(f"{url}/health", timeout=start_timeout)
        yield url
    finally:
        server.stop()


RESULT = "RESULT "  # a client script's answer: this prefix, then one JSON line


def run_client(argv: list[str], timeout: float = 600) -> dict:
    """Run a client script (`argv`, often another environment's Python) and return the
    JSON of its last RESULT line; fail with its output when it prints none."""
    import subprocess

    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT)]
    if not lines:
        raise AssertionError(f"{' '.join(argv[1:3])} printed no result (exit "
                             f"{done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len(RESULT):])


def print_result(result: dict) -> None:
    print(RESULT + json.dumps(result), flush=True)
