"""The vLLM backend against vLLM called directly, side by side in one process.

1. Throughput: 256 prompts x 64 sampled tokens (EOS ignored), through `rollout` (engine
   mode, its outputs streamed `--stream-interval` tokens a chunk) and through
   `vllm.LLM.generate` (final outputs only) with the same engine settings; rounds
   alternate, and the medians and each round's own ratio are compared. Target: >= 0.98.
2. Weight update of the model's full state: through `rollout` (buckets, safetensors
   bytes to the worker, prefix-cache reset) against vLLM's own in-process
   `collective_rpc("reload_weights")` of the same tensors plus its prefix-cache reset.

The model is the tiny one, or `--model smollm2` (chat prompts, from the model cache).

Run in the vLLM environment (scripts/env.sh vllm):
    python bench/bench_vllm.py [--prompts 256] [--tokens 64] [--rounds 3] [--stream-interval 16]
                               [--model smollm2]
"""

from __future__ import annotations

import os
import statistics
import tempfile

from common import TINY, model_folder, prompts, timed, use_cpu_defaults, workload_parser

SETTINGS = {"dtype": "float32", "enforce_eager": True}


def main() -> None:
    parser = workload_parser(model=True)
    parser.add_argument("--stream-interval", type=int, default=16)  # the backend's default
    args = parser.parse_args()
    use_cpu_defaults()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the direct LLM runs in this process

    import rollout
    from rollout.testing.model_folders import load_weights
    from vllm import LLM, SamplingParams, TokensPrompt

    with tempfile.TemporaryDirectory() as tmp:
        model = model_folder(args.model, tmp)
        backend = rollout.load_backend("vllm", model=model, mode="engine",
                                       stream_interval=args.stream_interval, **SETTINGS)
        llm = LLM(model=model, max_model_len=backend._backend.max_model_len, **SETTINGS)
        tokenizer = llm.get_tokenizer()
        texts = prompts(args.prompts, None if args.model == TINY else tokenizer)
        ids = [tokenizer(t).input_ids for t in texts]
        requests = [{"prompt_token_ids": p, "sampling": {"temperature": 1.0, "max_tokens":
                     args.tokens, "ignore_eos": True}} for p in ids]
        params = SamplingParams(temperature=1.0, max_tokens=args.tokens, ignore_eos=True)
        token_prompts = [TokensPrompt(prompt_token_ids=p) for p in ids]

        def ours():
            out = backend.generate(requests)
            assert all(c.unwrap()[0].completion_tokens == args.tokens for c in out)

        def direct():
            out = llm.generate(token_prompts, params, use_tqdm=False)
            assert all(len(o.outputs[0].token_ids) == args.tokens for o in out)

        ours(), direct()  # warm up
        rollout_s, direct_s = [], []
        for _ in range(args.rounds):
            rollout_s.append(timed(ours))
            direct_s.append(timed(direct))
        a, b = statistics.median(rollout_s), statistics.median(direct_s)
        total = args.prompts * args.tokens
        print(f"model {args.model}: generate {args.prompts} prompts x {args.tokens} tokens, "
              f"stream interval {args.stream_interval}, median of {args.rounds}:")
        print(f"  vllm LLM.generate direct: {b:7.3f} s  {total / b:9.1f} tokens/s")
        print(f"  rollout vllm backend:     {a:7.3f} s  {total / a:9.1f} tokens/s")
        print(f"  throughput ratio (rollout / direct): {b / a:.3f}  (target >= 0.98)")
        # Each round's own ratio too: its two runs are seconds apart, the medians' are not.
        pairs = [d / r for r, d in zip(rollout_s, direct_s)]
        print(f"  round by round: {', '.join(f'{x:.3f}' for x in pairs)}; "
              f"median {statistics.median(pairs):.3f}")

        state = load_weights(model)

        def ours_update():
            backend.update_weights(state.items())

        def direct_update():
            llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(state.items())})
            llm.reset_prefix_cache()

        ours_update(), direct_update()
        ours_w = statistics.median(timed(ours_update) for _ in range(args.rounds * 3))
        direct_w = statistics.median(timed(direct_update) for _ in range(args.rounds * 3))
        print(f"weight update, {len(state)} tensors, {sum(t.nbytes for t in state.values())} bytes:")
        print(f"  vllm reload_weights direct (in process): {direct_w * 1000:8.1f} ms")
        print(f"  rollout update_weights:                  {ours_w * 1000:8.1f} ms")
        print(f"  time ratio (rollout / direct): {ours_w / direct_w:.2f}")
        backend.close()


if __name__ == "__main__":
    main()
