"""`rollout serve --backend vllm` against vLLM's own OpenAI server, under vLLM's own serving
benchmark (bench/serve_compare.py says the load and how rounds alternate).

rollout runs the vLLM backend in each of `--modes` (comma-separated, default `async`:
vLLM's AsyncLLM with its engine core in a child process, as vLLM's own server runs it;
`engine`: its LLMEngine stepped in the server's own process).
Targets: output throughput ratio (rollout / vLLM) >= 1.0, TTFT p50 ratio <= 1.05.

The model is the tiny one, or `--model smollm2` (the dataset's random token ids are drawn
from the model's own vocabulary).

Run in the vLLM environment (scripts/env.sh vllm):
    python bench/bench_serve_vs_vllm.py [--prompts 200] [--rounds 3] [--modes async,engine]
                                        [--model smollm2]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from bench_vllm import SETTINGS
from common import add_model_argument, model_folder, use_cpu_defaults
from serve_compare import compare, rollout_serve


def servers(model: str, served: str, port: int, modes: list[str]) -> dict[str, list[str]]:
    engine = ["--dtype", SETTINGS["dtype"], "--enforce-eager"]
    contenders = {
        "vllm": [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                 "--served-model-name", served, "--port", str(port), *engine]}
    for mode in modes:
        contenders[f"rollout-{mode}"] = rollout_serve(
            "vllm", model, served, port, mode, {"dtype": "float32", "enforce_eager": "true"})
    return contenders


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--modes", default="async",
                        help="the vLLM backend's modes to run rollout in, comma-separated")
    add_model_argument(parser)
    args = parser.parse_args()
    use_cpu_defaults()

    from rollout.kit.process import free_port

    with tempfile.TemporaryDirectory() as tmp:
        model = model_folder(args.model, tmp)
        served = Path(args.model).name  # the tiny model's served name stays "tiny"
        port = free_port()
        compare(servers(model, served, port, args.modes.split(",")), "vllm", port, model,
                served, args.prompts, args.rounds, sys.executable, args.model)


if __name__ == "__main__":
    main()
