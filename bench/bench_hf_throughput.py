"""HF backend against a plain per-prompt `model.generate` loop, side by side in one process.

Same model (the tiny one, or `--model smollm2` with chat prompts), same 64 prompts, 32 new
tokens each (EOS ignored so both produce exactly that many). Prints tokens per second for
both and the ratio (target: >= 5x).

    python bench/bench_hf_throughput.py [--prompts 64] [--tokens 32] [--device cpu]
                                        [--model smollm2]
"""

from __future__ import annotations

import argparse
import tempfile
import time

import rollout

from common import TINY, add_model_argument, model_folder, prompts


def plain_loop(model, tokenizer, texts, tokens, device) -> float:
    import torch

    started = time.perf_counter()
    with torch.inference_mode():
        for text in texts:
            ids = tokenizer(text, return_tensors="pt").input_ids.to(device)
            model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=True,
                           temperature=1.0, top_k=0, pad_token_id=tokenizer.pad_token_id)
    return time.perf_counter() - started


def through_rollout(backend, texts, tokens) -> float:
    batch = [{"prompt": t, "sampling": {"temperature": 1.0, "max_tokens": tokens,
                                        "ignore_eos": True}} for t in texts]
    started = time.perf_counter()
    completions = backend.generate(batch)
    elapsed = time.perf_counter() - started
    assert all(c.unwrap()[0].completion_tokens == tokens for c in completions)
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--device", default=None)
    parser.add_argument("--batch-size", type=int, default=64)
    add_model_argument(parser)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = model_folder(args.model, tmp)
        backend = rollout.load_backend("hf", model=model_dir, device=args.device,
                                       batch_size=args.batch_size)
        engine = backend._backend  # the same loaded model serves the baseline
        texts = prompts(args.prompts, None if args.model == TINY else engine.tokenizer)
        through_rollout(backend, texts[:4], 4)  # warm up both paths
        plain_loop(engine.model, engine.tokenizer, texts[:2], 4, engine.device)
        ours = through_rollout(backend, texts, args.tokens)
        plain = plain_loop(engine.model, engine.tokenizer, texts, args.tokens, engine.device)
        total = args.prompts * args.tokens
        print(f"model: {args.model}, device: {engine.device}")
        print(f"plain model.generate loop: {plain:7.3f} s  {total / plain:9.1f} tokens/s")
        print(f"rollout hf backend:        {ours:7.3f} s  {total / ours:9.1f} tokens/s")
        print(f"throughput ratio (rollout / plain): {plain / ours:.2f}x  (target >= 5x)")
        backend.close()


if __name__ == "__main__":
    main()
