"""What `update_weights(pause="keep_kv")` changes against `pause="keep"`, by update size.

A batch of sampled requests runs; once the first has `--after` tokens, the weights are
pushed, every tensor changed by seeded noise of `scale` times its own standard deviation
(an RL step at lr 1e-5 moves SmolLM2's weights by about 5e-4 of theirs). With "keep" the
running samples stop and go on from their tokens, their KV cache recomputed under the new
weights; with "keep_kv" they stay in the engine and the new weights decode over the cache
the old ones made. Each sample's tokens after the update are then scored by the new weights
from scratch (a prefill: what a trainer computes), and compared with the logprobs the
engine gave:

- k3: the mean of r - 1 - log r, r = p_recomputed / p_engine over the sampled tokens, an
  estimate of KL(engine || recomputed) per token (0 where the engine recomputed);
- the largest |logprob difference|;
- the batch's wall time with the push, keep_kv against keep (the recompute's cost).

    python bench/bench_keep_kv.py [--model smollm2] [--scales 1e-4,1e-3,1e-2,1e-1]
                                  [--backend sglang -o dtype=float32]
                                  [--backend vllm -o mode=async -o dtype=float32]

(on any backend that offers keep_kv: HF, SGLang, vLLM but in server mode; from that
backend's environment)
"""

from __future__ import annotations

import argparse
import asyncio
import math
import tempfile
import time

from common import add_backend_arguments, add_model_argument, model_folder, prepare_engine, prompts

PAUSES = ("keep", "keep_kv")


def perturbed(weights: dict, scale: float, seed: int = 1) -> dict:
    import torch

    generator = torch.Generator().manual_seed(seed)
    return {name: t + scale * t.std() * torch.randn(t.shape, generator=generator,
                                                      dtype=t.dtype)
            if t.is_floating_point() and t.numel() > 1 else t
            for name, t in weights.items()}


async def with_a_push(ro, requests: list[dict], weights: dict, pause: str, after: int):
    """The batch, pushed `weights` (version 1) once its first request has `after` tokens:
    (seconds, results)."""
    loop = asyncio.get_running_loop()
    started = time.perf_counter()
    others = [asyncio.ensure_future(ro.agenerate(r)) for r in requests[1:]]
    stream, made, update = ro.stream(requests[0]), 0, None
    async for chunk in stream:
        made += len(chunk.token_ids)
        if made >= after and update is None:
            update = loop.run_in_executor(None, lambda: ro.update_weights(
                weights.items(), version=1, pause=pause))
    completions = [stream.completion, *[await o for o in others]]
    if update is None:
        raise SystemExit(f"the first request ended before {after} tokens")
    await update
    return time.perf_counter() - started, [r for c in completions for r in c.unwrap()]


def compared(ro, results) -> tuple[list[float], list[float]]:
    """(engine, recomputed) logprobs of every token made after the update."""
    scoring = [{"prompt_token_ids": list(r.prompt_token_ids) + list(r.token_ids),
                "sampling": {"max_tokens": 1, "prompt_logprobs": 0}} for r in results]
    engine, recomputed = [], []
    for result, scored in zip(results, ro.generate(scoring)):
        [score] = scored.unwrap()
        start = len(result.prompt_token_ids)
        for span in result.weight_versions:
            if span.version == 1:
                engine += result.logprobs[span.start:span.end]
                recomputed += score.prompt_logprobs[start + span.start:start + span.end]
    return engine, recomputed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_argument(parser)
    add_backend_arguments(parser)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--after", type=int, default=16, help="tokens before the push")
    parser.add_argument("--scales", default="1e-4,1e-3,1e-2,1e-1")
    args = parser.parse_args()

    prepare_engine(args.backend)
    import rollout
    from rollout.testing.contract import on_engine_loop
    from rollout.testing.model_folders import load_weights

    folder = model_folder(args.model, tempfile.mkdtemp())
    texts = prompts(args.prompts)
    own = load_weights(folder)
    with rollout.load_backend(args.backend, model=folder, **dict(args.options)) as ro:
        seeded = ro.capabilities.supports("seed")  # (SGLang on CPU: not)
        requests = [{"id": str(i), "prompt": text,
                     "sampling": {"temperature": 1.0, "max_tokens": args.max_tokens,
                                  "ignore_eos": True, "logprobs": 0,
                                  "seed": i if seeded else None}}
                    for i, text in enumerate(texts)]
        print(f"{args.backend}, {args.model}: {args.prompts} prompts x {args.max_tokens} "
              f"tokens at temperature 1, pushed after {args.after}")
        print(f"{'scale':>8} {'pause':>8} {'tokens after':>12} {'k3 KL':>10} "
              f"{'max |diff|':>10} {'batch s':>8}")
        on_engine_loop(with_a_push(ro, requests, own, "keep", args.after))  # warm
        for scale in (float(s) for s in args.scales.split(",")):
            new = perturbed(own, scale)
            seconds = {}
            for pause in PAUSES:
                ro.update_weights(own.items())
                seconds[pause], results = on_engine_loop(
                    with_a_push(ro, requests, new, pause, args.after))
                engine, recomputed = compared(ro, results)
                ratios = [math.exp(b - a) for a, b in zip(engine, recomputed)]
                k3 = sum(r - 1 - math.log(r) for r in ratios) / len(ratios)
                worst = max(abs(a - b) for a, b in zip(engine, recomputed))
                print(f"{scale:8.0e} {pause:>8} {len(engine):12d} {k3:10.2e} {worst:10.2e} "
                      f"{seconds[pause]:8.2f}")
            print(f"{'':8} keep_kv batch time / keep: {seconds['keep_kv'] / seconds['keep']:.3f}")


if __name__ == "__main__":
    main()
