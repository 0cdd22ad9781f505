"""One request per call against one batch call, on any backend, side by side in one process.

The same N requests (the tiny model, `--tokens` sampled tokens each, EOS ignored) go to
one backend two ways: as N concurrent `await rollout.agenerate(request)` calls
(asyncio.gather, on the caller's own event loop), and as one `rollout.generate(all N)`.
Rounds alternate and medians are compared. Prints tokens per second for both and the
ratio concurrent / batch (target: >= 0.9: one request per call costs little).

    python bench/bench_concurrency.py --backend hf -o batch_size=64
    python bench/bench_concurrency.py --backend vllm -o mode=engine -o dtype=float32 \\
        -o enforce_eager=true
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile

from common import add_backend_arguments, prepare_engine, prompts, timed, workload_parser

TARGET = 0.9


def main() -> None:
    parser = workload_parser()
    parser.set_defaults(tokens=32)
    add_backend_arguments(parser)
    args = parser.parse_args()
    prepare_engine(args.backend)

    import rollout
    from rollout.kit.tiny_model import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model = str(build_tiny_model(tmp))
        backend = rollout.load_backend(args.backend, model=model, **dict(args.options))
        requests = [{"prompt": text, "sampling": {"temperature": 1.0, "ignore_eos": True,
                                                  "max_tokens": args.tokens}}
                    for text in prompts(args.prompts)]

        def check(completions) -> None:
            assert all(c.unwrap()[0].completion_tokens == args.tokens for c in completions)

        def batch() -> None:
            check(backend.generate(requests))

        def concurrent() -> None:
            async def run():
                return await asyncio.gather(*(backend.agenerate(r) for r in requests))

            check(asyncio.run(run()))

        for fn in (batch, concurrent):  # warm up both paths
            fn()
        batch_s, concurrent_s = [], []
        for _ in range(args.rounds):
            batch_s.append(timed(batch))
            concurrent_s.append(timed(concurrent))
        backend.close()

    total = args.prompts * args.tokens
    batch_m, concurrent_m = statistics.median(batch_s), statistics.median(concurrent_s)
    print(f"backend {args.backend} {dict(args.options)}: {args.prompts} requests x "
          f"{args.tokens} tokens, median of {args.rounds} rounds")
    print(f"one generate(all):        {batch_m:7.3f} s  {total / batch_m:9.1f} tokens/s")
    print(f"concurrent agenerate(1):  {concurrent_m:7.3f} s  {total / concurrent_m:9.1f} tokens/s")
    print(f"throughput ratio (concurrent / batch): {batch_m / concurrent_m:.2f}  "
          f"(target >= {TARGET})")


if __name__ == "__main__":
    main()
