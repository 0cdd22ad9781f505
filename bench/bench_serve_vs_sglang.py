"""`rollout serve --backend sglang` against SGLang's own server (`sglang.launch_server`),
under vLLM's own serving benchmark (bench/serve_compare.py says the load and how rounds
alternate). Both run SGLang with the settings the backend gives it (its ENGINE_DEFAULTS and
streaming arguments, float32), rollout in each of `--modes` (comma-separated, default
`engine`: SGLang's Engine in the server's own process, its scheduler in a child process, as
SGLang's server runs it). Targets: output throughput ratio (rollout / SGLang) >= 1.0, TTFT
p50 ratio <= 1.05.

The model is the tiny one, or `--model smollm2`.

Run in the SGLang environment (scripts/env.sh sglang), with vLLM's benchmark from the vLLM
environment (`--bench-python`, default $ROLLOUT_VLLM_PYTHON):
    python bench/bench_serve_vs_sglang.py [--prompts 200] [--rounds 3] [--model smollm2]
Without a GPU it loads the test-only CPU scaffolding from plugins/sglang_backend/tests/conftest.py,
whose environment both servers inherit.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from common import add_model_argument, model_folder
from serve_compare import compare, rollout_serve

SETTINGS = {"dtype": "float32", "max_total_tokens": 64 * 2048 + 4096}


def servers(model: str, served: str, port: int, modes: list[str], device: str
            ) -> dict[str, list[str]]:
    from rollout.kit.process import cli_flags
    from rollout_sglang.backend import ENGINE_DEFAULTS
    from rollout_sglang.engines import STREAM_ARGS

    # What the backend starts SGLang with (rollout_sglang.backend), on SGLang's own server.
    own = {**ENGINE_DEFAULTS, **STREAM_ARGS, **SETTINGS, "device": device,
           "random_seed": 0, "sleep_on_idle": True, "log_level": "error"}
    contenders = {
        "sglang": [sys.executable, "-m", "sglang.launch_server", "--model-path", model,
                   "--served-model-name", served, "--host", "127.0.0.1", "--port", str(port),
                   *cli_flags(own)]}
    for mode in modes:
        contenders[f"rollout-{mode}"] = rollout_serve("sglang", model, served, port, mode,
                                                      SETTINGS)
    return contenders


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--modes", default="engine",
                        help="the SGLang backend's modes to run rollout in, comma-separated")
    parser.add_argument("--bench-python", default=os.environ.get("ROLLOUT_VLLM_PYTHON"),
                        help="a Python with vLLM (and rollout), which runs the benchmark")
    add_model_argument(parser)
    args = parser.parse_args()
    if not args.bench_python:
        parser.error("--bench-python (or ROLLOUT_VLLM_PYTHON): a Python with vLLM")

    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "plugins" /
                               "sglang_backend" / "tests"))
        import conftest  # noqa: F401 - sets up the CPU scaffolding on import

    from rollout.kit.process import free_port

    with tempfile.TemporaryDirectory() as tmp:
        model = model_folder(args.model, tmp)
        served = Path(args.model).name
        port = free_port()
        contenders = servers(model, served, port, args.modes.split(","), device)
        compare(contenders, "sglang", port, model, served, args.prompts, args.rounds,
                args.bench_python, args.model)


if __name__ == "__main__":
    main()
