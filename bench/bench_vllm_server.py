"""The vLLM backend's server mode against the same vLLM server called directly.

One vLLM OpenAI server, started by the backend (`mode="server"`). The same prompts x
sampled tokens (EOS ignored) go through `rollout` (streamed, `--stream-interval` tokens a
chunk, a connection per request) and as plain `/v1/completions` requests sent all at once
with aiohttp, not streamed, on an uncapped connection pool; rounds alternate and medians
are compared. This prices server mode's streaming, which is what lets an abort keep the
tokens already made. With `--capped`, a third contender is rollout on aiohttp's default
pool of 100 connections (what server mode used before), to show what the cap costs.

Run in the vLLM environment (scripts/env.sh vllm):
    python bench/bench_vllm_server.py [--prompts 256] [--tokens 64] [--rounds 3]
                                      [--stream-interval 16] [--capped]
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile

from bench_vllm import SETTINGS
from common import prompts, timed, use_cpu_defaults, workload_parser


def main() -> None:
    parser = workload_parser()
    parser.add_argument("--stream-interval", type=int, default=16)  # the backend's default
    parser.add_argument("--capped", action="store_true")
    args = parser.parse_args()
    use_cpu_defaults()

    import aiohttp

    import rollout
    from rollout.kit.tiny_model import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model = str(build_tiny_model(tmp))
        backend = rollout.load_backend("vllm", model=model, mode="server",
                                       stream_interval=args.stream_interval, **SETTINGS)
        engine, loop = backend._backend.engine, backend._backend.loop
        ids = [backend._backend.tokenizer(t).input_ids for t in prompts(args.prompts)]
        sampling = {"temperature": 1.0, "max_tokens": args.tokens, "ignore_eos": True}
        requests = [{"prompt_token_ids": p, "sampling": sampling} for p in ids]

        def ours():
            out = backend.generate(requests)
            assert all(c.unwrap()[0].completion_tokens == args.tokens for c in out)

        async def send_all():
            connector = aiohttp.TCPConnector(limit=0)
            async with aiohttp.ClientSession(connector=connector) as session:
                async def one(prompt):
                    body = {"model": "rollout", "prompt": prompt, **sampling}
                    async with session.post(engine.url + "/v1/completions", json=body) as r:
                        data = await r.json()
                    assert data["usage"]["completion_tokens"] == args.tokens, data

                await asyncio.gather(*(one(p) for p in ids))

        def direct():
            loop.run(send_all(), 600, "direct requests")

        async def use_pool(limit: int):
            await engine.session.close()
            engine.session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(force_close=True, limit=limit))

        def capped():
            loop.run(use_pool(100), 30, "capped pool")
            try:
                ours()
            finally:
                loop.run(use_pool(0), 30, "uncapped pool")

        contenders = {"direct": direct, "rollout": ours}
        if args.capped:
            contenders["rollout, pool of 100"] = capped
        try:
            for run in contenders.values():  # warm up
                run()
            times: dict[str, list[float]] = {name: [] for name in contenders}
            for _ in range(args.rounds):
                for name, run in contenders.items():
                    times[name].append(timed(run))
        finally:
            backend.close()
    medians = {name: statistics.median(t) for name, t in times.items()}
    total = args.prompts * args.tokens
    print(f"vLLM server, {args.prompts} prompts x {args.tokens} tokens, "
          f"stream interval {args.stream_interval}, median of {args.rounds}:")
    for name, seconds in medians.items():
        print(f"  {name:22s} {seconds:7.3f} s  {total / seconds:9.1f} tokens/s")
    print(f"  throughput ratio (rollout / direct): {medians['direct'] / medians['rollout']:.3f}")
    if args.capped:
        print("  throughput ratio (rollout / rollout on a pool of 100): "
              f"{medians['rollout, pool of 100'] / medians['rollout']:.3f}")


if __name__ == "__main__":
    main()
