"""How far a trainer's logprobs are from the engine's behaviour logprobs, TRL #6789's
experiment (top_p=0.8, temperature 1 and 0.7) on a real model: the importance ratio
exp(trainer - engine) per sampled token, its mean and the share outside [0.9, 1.1].

Four pairings, side by side on the same sampled tokens (one seed per request):
- raw: the engine's default logprobs (the model's, temperature 1) against the trainer's
  log_softmax(logits / T), which TRL computes;
- processed: the engine's `logprobs_mode="processed"` (the distribution it drew from)
  against the same trainer logprobs: what is left is the top-p truncation;
- processed, trainer truncated: the trainer applying the same top-p to its own
  distribution and renormalising (its kept set may differ from the engine's at the edge);
- processed, over the engine's mask: the trainer renormalising over the set the engine
  says each token was drawn from (`return_sampling_mask`), where the backend gives it.

    python bench/bench_on_policy.py --model smollm2 --backend vllm -o dtype=float32

With `--cost` it measures instead what each costs in throughput, on a backend that gives
both modes per request (HF): tokens/s of raw logprobs, processed ones, and processed ones
with the masks, the three in turn in each round, as ratios to raw.
"""

from __future__ import annotations

import argparse
import tempfile
import time

from common import (add_backend_arguments, add_model_argument, model_folder, prepare_engine,
                    prompts)

TOP_P = 0.8


def sample(ro, texts: list[str], temperature: float, mode: str, n: int, max_tokens: int,
           masks: bool | None = None):
    if masks is None:
        masks = ro.capabilities.supports("sampling_mask")
    seeded = ro.capabilities.supports("seed")  # (SGLang on CPU: not)
    requests = [{"id": str(i), "prompt": text,
                 "sampling": {"temperature": temperature, "top_p": TOP_P, "n": n,
                              "max_tokens": max_tokens, "seed": 1000 + i if seeded else None,
                              "logprobs": 0,
                              "logprobs_mode": mode, "return_sampling_mask": masks}}
                for i, text in enumerate(texts)]
    return [r for c in ro.generate(requests) for r in c.unwrap()]


def trainer_logprobs(model, result, temperature: float):
    """Per sampled token: the trainer's log_softmax(logits / T), the same truncated to its
    own top-p set and renormalised, and renormalised over the engine's mask (None
    without one)."""
    import torch

    ids = list(result.prompt_token_ids) + list(result.token_ids)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, len(result.prompt_token_ids) - 1:-1]
    scaled = (logits.double() / temperature).log_softmax(-1)
    ranked, order = scaled.sort(-1, descending=True)
    probs = ranked.exp()
    before = probs.cumsum(-1) - probs
    truncated = ranked.masked_fill(before >= TOP_P, float("-inf")).log_softmax(-1)
    kept = torch.empty_like(truncated).scatter_(1, order, truncated)
    token = torch.tensor(result.token_ids)[:, None]
    chosen = scaled.gather(1, token)[:, 0]
    masked = None if result.sampling_mask is None else [
        float(chosen[step] - scaled[step, list(ids)].logsumexp(-1))
        for step, ids in enumerate(result.sampling_mask)]
    return chosen.tolist(), kept.gather(1, token)[:, 0].tolist(), masked


def summary(trainer: list[float], engine: list[float]) -> str:
    import math

    ratios = [math.exp(t - e) for t, e in zip(trainer, engine)]
    outside = sum(not 0.9 <= r <= 1.1 for r in ratios) / len(ratios)
    return f"mean {sum(ratios) / len(ratios):6.3f}, {outside:6.1%} outside [0.9, 1.1]"


def cost(ro, texts: list[str], n: int, max_tokens: int, rounds: int) -> None:
    """Tokens/s of each setting against raw logprobs, medians of the rounds' own ratios."""
    import statistics

    settings = {"raw": ("raw", False), "processed": ("processed", False),
                "processed + masks": ("processed", True)}
    rates: dict[str, list[float]] = {name: [] for name in settings}
    sample(ro, texts, 1.0, "raw", n, max_tokens, False)  # warm
    for _ in range(rounds):
        for name, (mode, masks) in settings.items():
            started = time.perf_counter()
            tokens = sum(len(r.token_ids) for r in sample(ro, texts, 1.0, mode, n, max_tokens,
                                                          masks))
            rates[name].append(tokens / (time.perf_counter() - started))
    for name in settings:
        ratio = statistics.median(a / b for a, b in zip(rates[name], rates["raw"]))
        print(f"  {name:<18} {statistics.median(rates[name]):8.1f} tokens/s, {ratio:.3f} of raw")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_argument(parser)
    add_backend_arguments(parser)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("-n", type=int, default=4, help="samples per prompt")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--cost", action="store_true", help="throughput of each mode instead")
    parser.add_argument("--rounds", type=int, default=3, help="with --cost")
    args = parser.parse_args()
    prepare_engine(args.backend)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import rollout

    folder = model_folder(args.model, tempfile.mkdtemp())
    tokenizer = AutoTokenizer.from_pretrained(folder)
    texts = prompts(args.prompts, tokenizer if tokenizer.chat_template else None)
    # A small KV cache, where the backend takes a context length (SGLang sizes its own).
    limit = {} if args.backend == "sglang" else {"max_model_len": 2048}
    if args.cost:
        with rollout.load_backend(args.backend, model=folder, **limit,
                                  **dict(args.options)) as ro:
            print(f"{args.backend}, {args.model}: {args.prompts} prompts x {args.n} samples "
                  f"of {args.max_tokens} tokens, top_p={TOP_P}, {args.rounds} rounds")
            cost(ro, texts, args.n, args.max_tokens, args.rounds)
        return
    temperatures = (1.0, 0.7)
    sampled = {}
    # vLLM fixes the mode at start: one engine per mode, one after the other.
    for mode in ("raw", "processed"):
        ro = rollout.load_backend(args.backend, model=folder, **limit, **dict(args.options),
                                  **({"logprobs_mode": mode} if args.backend == "vllm" else {}))
        try:
            for t in temperatures:
                sampled[mode, t] = sample(ro, texts, t, mode, args.n, args.max_tokens)
        finally:
            ro.close()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    print(f"{args.backend}, {args.model}: {args.prompts} prompts x {args.n} samples, "
          f"top_p={TOP_P}")
    for t in temperatures:
        # Each mode's samples against the trainer on the same tokens (with a seed both
        # modes sample alike; without one, SGLang's, each mode has its own samples).
        raw, processed = sampled["raw", t], sampled["processed", t]
        same = sum(a.token_ids == b.token_ids for a, b in zip(raw, processed))
        trainer_raw, engine_raw = [], []
        for a in raw:
            trainer_raw += trainer_logprobs(model, a, t)[0]
            engine_raw += a.logprobs
        trainer, truncated, masked, engine_processed = [], [], [], []
        for b in processed:
            scaled, kept, over_mask = trainer_logprobs(model, b, t)
            trainer += scaled
            truncated += kept
            masked += over_mask or []
            engine_processed += b.logprobs
        print(f"temperature {t}: {len(trainer_raw)} and {len(trainer)} tokens "
              f"({same}/{len(raw)} samples alike in both modes)")
        print(f"  raw                          {summary(trainer_raw, engine_raw)}")
        print(f"  processed                    {summary(trainer, engine_processed)}")
        print(f"  processed, trainer truncated {summary(truncated, engine_processed)}")
        if masked:
            print(f"  processed, over engine's mask {summary(masked, engine_processed)}")


if __name__ == "__main__":
    main()
