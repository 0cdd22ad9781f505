"""The SGLang backend against SGLang called directly, side by side in one process.

Throughput: 256 prompts x 64 sampled tokens (EOS ignored), through `rollout` (engine mode)
and through `sglang.Engine` directly, with the same engine settings (the backend's defaults
included: no overlap scheduler, for its penalties); rounds alternate and medians are
compared. SGLang is timed two ways: `generate` on one batch, and every prompt streamed
(`async_generate(stream=True)`, gathered), which is what the backend asks of it: the
streamed ratio prices the backend, the batch ratio adds what streaming costs SGLang.
Target: streamed ratio >= 0.97. With `--overlap`, another engine with SGLang's overlap
scheduler on prices that default.

The model is the tiny one, or `--model smollm2` (chat prompts, from the model cache).

Run in the SGLang environment (scripts/env.sh sglang), from the repository root:
    python bench/bench_sglang.py [--prompts 256] [--tokens 64] [--rounds 3] [--model smollm2]
Without a GPU it loads the test-only CPU scaffolding from plugins/sglang_backend/tests/conftest.py.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import tempfile
from pathlib import Path

from common import TINY, model_folder, prompts, timed, workload_parser

SETTINGS = {"dtype": "float32"}


def main() -> None:
    parser = workload_parser(model=True)
    parser.add_argument("--overlap", action="store_true",
                        help="also time SGLang with its overlap scheduler on")
    args = parser.parse_args()

    import torch

    if not torch.cuda.is_available():
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "plugins" / "sglang_backend" / "tests"))
        import conftest  # noqa: F401 - sets up the CPU scaffolding on import

    import sglang

    import rollout

    with tempfile.TemporaryDirectory() as tmp:
        model = model_folder(args.model, tmp)
        backend = rollout.load_backend("sglang", model=model, mode="engine", **SETTINGS)
        inner = backend._backend
        from rollout_sglang.backend import ENGINE_DEFAULTS
        from rollout_sglang.engines import STREAM_ARGS

        llm = sglang.Engine(model_path=model, device=inner.device, max_total_tokens=4096,
                            random_seed=0, sleep_on_idle=True, log_level="error",
                            **ENGINE_DEFAULTS, **STREAM_ARGS, **SETTINGS)
        texts = prompts(args.prompts, None if args.model == TINY else inner.tokenizer)
        ids = [inner.tokenizer(t).input_ids for t in texts]
        requests = [{"prompt_token_ids": p, "sampling": {"temperature": 1.0, "max_tokens":
                     args.tokens, "ignore_eos": True}} for p in ids]
        params = {"temperature": 1.0, "max_new_tokens": args.tokens, "ignore_eos": True}

        def ours():
            out = backend.generate(requests)
            assert all(c.unwrap()[0].completion_tokens == args.tokens for c in out)

        def direct():
            out = llm.generate(input_ids=ids, sampling_params=params)
            assert all(len(o["output_ids"]) == args.tokens for o in out)

        async def one_streamed(prompt):
            made = 0
            async for out in await llm.async_generate(input_ids=prompt, sampling_params=params,
                                                      stream=True):
                made += len(out["output_ids"])
            assert made == args.tokens

        def streamed():
            async def run():
                await asyncio.gather(*(one_streamed(p) for p in ids))

            llm.loop.run_until_complete(run())

        ours(), direct(), streamed()  # warm up
        rollout_s, direct_s, streamed_s = [], [], []
        for _ in range(args.rounds):
            rollout_s.append(timed(ours))
            direct_s.append(timed(direct))
            streamed_s.append(timed(streamed))
        a, b, s = (statistics.median(x) for x in (rollout_s, direct_s, streamed_s))
        total = args.prompts * args.tokens
        print(f"model {args.model}: generate {args.prompts} prompts x {args.tokens} tokens, "
              f"median of {args.rounds}:")
        print(f"  sglang Engine.generate direct: {b:7.3f} s  {total / b:9.1f} tokens/s")
        print(f"  sglang streamed direct:        {s:7.3f} s  {total / s:9.1f} tokens/s")
        print(f"  rollout sglang backend:        {a:7.3f} s  {total / a:9.1f} tokens/s")
        print(f"  throughput ratio (rollout / streamed): {s / a:.3f}  (target >= 0.97)")
        print(f"  throughput ratio (rollout / batch):    {b / a:.3f}")
        llm.shutdown()
        if args.overlap:
            overlapped = sglang.Engine(
                model_path=model, device=inner.device, max_total_tokens=4096, random_seed=0,
                sleep_on_idle=True, log_level="error", **SETTINGS)
            c = statistics.median(timed(lambda: overlapped.generate(
                input_ids=ids, sampling_params=params)) for _ in range(args.rounds))
            print(f"  sglang with its overlap scheduler: {c:7.3f} s  {total / c:9.1f} tokens/s"
                  f"  (backend / overlapped: {c / a:.3f})")
            overlapped.shutdown()
        backend.close()


if __name__ == "__main__":
    main()
