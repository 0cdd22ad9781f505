"""The differential conformance suite against vLLM's own server, as a report: the recorded
client requests and `--generated` Hypothesis cases on OpenAI's routes, and on Anthropic's
/v1/messages Claude Code's recorded calls (`--harnesses`) and `--messages` drawn ones, go
to vLLM's server and to `rollout serve --backend vllm` on the tiny model (float32, eager,
with room for 32k tokens: differential.long_context_copy), and the table of
differences is printed: request kind x field x count, with what explains each
(rollout.testing.differential: DOCUMENTED, OPEN, or UNEXPLAINED).

The servers start here, each engine on a core of its own, unless `--vllm-url` and
`--rollout-url` name running ones (served as "tiny").

Run in the vLLM environment (scripts/env.sh vllm):
    python bench/bench_differential.py [--generated 500] [--messages 150] [--seed 0]
                                       [--concurrency 1] [--harnesses GLOB]
                                       [--vllm-url URL --rollout-url URL --model DIR]
                                       [--examples 10]
Exits 1 when a difference is unexplained.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECORDING = ROOT / "plugins" / "vllm_backend" / "tests" / "data" / "client_requests.jsonl"
HARNESSES = "tests/data/harnesses/claude_code-*.json"   # under ROOT
SERVED = "tiny"


@contextlib.contextmanager
def servers(model: str):
    """vLLM's server and rollout's on `model`, started together, once both are healthy."""
    from rollout.kit.process import ServerProcess, free_port
    from rollout.testing.differential import server_argvs, server_env

    ports = {"vllm": free_port(), "rollout": free_port()}
    argvs = server_argvs(sys.executable, model, SERVED, ports["vllm"], ports["rollout"])
    started = {name: ServerProcess(f"{name}-differential", argv, env=server_env(core),
                                   die_with_parent=True)
               for core, (name, argv) in enumerate(argvs.items())}
    try:
        urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
        for name, server in started.items():
            server.wait_healthy(urls[name] + "/health", timeout=600)
        yield urls
    finally:
        for server in started.values():
            server.stop()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--generated", type=int, default=500)
    parser.add_argument("--messages", type=int, default=150,
                        help="drawn /v1/messages calls")
    parser.add_argument("--harnesses", default=HARNESSES,
                        help="recorded harness calls (a glob under the repository; '' for none)")
    parser.add_argument("--seed", type=int, default=0)
    # More than 1 is faster, but a seeded sample may then differ by a batch's last bits.
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--recording", default=str(RECORDING))
    parser.add_argument("--vllm-url")
    parser.add_argument("--rollout-url")
    parser.add_argument("--model", help="with --vllm-url: the servers' model folder (its "
                                        "tokenizer reads prompts given as token ids)")
    parser.add_argument("--examples", type=int, default=10,
                        help="unexplained differences to print with their requests")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "bench"))
    from common import prepare_engine

    prepare_engine("vllm")
    from rollout.testing import differential as diff

    corpus = diff.load_recording(args.recording, SERVED) if args.recording else []
    if args.generated:
        corpus += diff.draw_cases(args.generated, args.seed)
    if args.messages:
        corpus += diff.draw_cases(args.messages, args.seed, api="messages")
        corpus += diff.pinned_messages(SERVED)
    if args.harnesses:
        corpus += diff.load_harness(ROOT.glob(args.harnesses), SERVED)
    with contextlib.ExitStack() as stack:
        if args.vllm_url and args.rollout_url:
            urls = {"vllm": args.vllm_url, "rollout": args.rollout_url}
        else:
            from rollout.kit.tiny_model import build_tiny_model

            tmp = stack.enter_context(tempfile.TemporaryDirectory())
            build_tiny_model(Path(tmp) / "tiny", seed=0)
            args.model = str(diff.long_context_copy(Path(tmp) / "tiny", Path(tmp) / "long"))
            urls = stack.enter_context(servers(args.model))
        start = time.monotonic()
        decode = diff.decoder(args.model) if args.model else None
        report = asyncio.run(diff.run(corpus, urls["vllm"], urls["rollout"],
                                      args.concurrency, decode))
        took = time.monotonic() - start
    print(f"{len(corpus)} cases in {took:.1f} s: {report.summary()}")
    print(report.format_table())
    if report.unexplained:
        print("\nunexplained, first ones:\n" + report.examples(args.examples))
        sys.exit(1)


if __name__ == "__main__":
    main()
