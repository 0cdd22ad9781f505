"""Is a request's output independent of what else the engine runs with it? The same greedy
request alone, then in batches of 1 to 64 beside other requests (prompts of other
lengths, so padding differs, and half of them sharing its prompt's start, so the engine's
prefix cache serves part of it), and alone again after its prompt is cached: the largest
|logprob difference| against the first run alone, and whether the tokens are the same.
With `--invariant` the request asks for `sampling.batch_invariant`, and the bench also
times what that costs: a batch of 64 with no such request, with the one, and with all 64,
side by side (best of `--repeats`).

    python bench/bench_batch_invariance.py --backend hf [--invariant]
    python bench/bench_batch_invariance.py --backend vllm -o dtype=float32
"""

from __future__ import annotations

import argparse
import tempfile
import time

from common import (WORDS, add_backend_arguments, add_model_argument, model_folder,
                    prepare_engine)

SIZES = (1, 2, 4, 8, 16, 32, 64)


def target(max_tokens: int) -> dict:
    prompt = " ".join(WORDS[(j * 5) % len(WORDS)] for j in range(40))
    return {"id": "target", "prompt": prompt,
            "sampling": {"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True,
                         "logprobs": 0}}


def invariant(request: dict) -> dict:
    return {**request, "sampling": {**request["sampling"], "batch_invariant": True}}


def cost(ro, plain: dict, max_tokens: int, repeats: int) -> dict[str, float]:
    """Seconds for a batch of 64 (the best of `repeats`, the three kinds taken in turn):
    none asking for batch invariance, the target `plain` alone asking, all 64 asking."""
    rest = others(63, plain["prompt"], max_tokens)
    kinds = {"none": [plain, *rest], "one": [invariant(plain), *rest],
             "all": [invariant(r) for r in (plain, *rest)]}
    best = dict.fromkeys(kinds, float("inf"))
    for _ in range(repeats):
        for kind, batch in kinds.items():
            began = time.perf_counter()
            for completion in ro.generate(batch):
                completion.unwrap()
            best[kind] = min(best[kind], time.perf_counter() - began)
    return best


def others(count: int, shared: str, max_tokens: int) -> list[dict]:
    """`count` other requests: prompts of 3 to 60 words, every second one starting with the
    target's first 30 words."""
    out = []
    for i in range(count):
        words = " ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(3 + (i * 11) % 58))
        prompt = (" ".join(shared.split()[:30]) + " " + words) if i % 2 else words
        out.append({"id": f"other-{i}", "prompt": prompt,
                    "sampling": {"temperature": 0.0, "max_tokens": max_tokens,
                                 "ignore_eos": True}})
    return out


def compare(alone, result) -> tuple[bool, float]:
    same = alone.token_ids == result.token_ids
    n = next((i for i, (a, b) in enumerate(zip(alone.token_ids, result.token_ids))
              if a != b), len(alone.token_ids))  # logprobs up to the first differing token
    gap = max((abs(a - b) for a, b in zip(alone.logprobs[:n + 1], result.logprobs[:n + 1])),
              default=0.0)
    return same, gap


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_argument(parser)
    add_backend_arguments(parser)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--invariant", action="store_true",
                        help="the request asks for sampling.batch_invariant; time its cost")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    prepare_engine(args.backend)
    import rollout

    folder = model_folder(args.model, tempfile.mkdtemp())
    ro = rollout.load_backend(args.backend, model=folder, **dict(args.options))
    try:
        plain = target(args.max_tokens)
        request = invariant(plain) if args.invariant else plain
        (alone,) = ro.generate([request])[0].unwrap()
        rows = []
        for size in SIZES:
            completions = ro.generate([request, *others(size - 1, request["prompt"],
                                                        args.max_tokens)])
            rows.append((f"batch of {size}", *compare(alone, completions[0].unwrap()[0])))
        (again,) = ro.generate([request])[0].unwrap()  # its prompt now in the prefix cache
        rows.append(("alone, prompt cached", *compare(alone, again)))
        seconds = cost(ro, plain, args.max_tokens, args.repeats) if args.invariant else None
    finally:
        ro.close()
    print(f"{args.backend}, {args.model}: one greedy request of {args.max_tokens} tokens "
          f"against itself alone{', asking for batch invariance' if args.invariant else ''}")
    for name, same, gap in rows:
        print(f"  {name:<22} tokens {'same' if same else 'DIFFER'}, largest |logprob "
              f"difference| {gap:.2e}")
    worst = max(gap for _, _, gap in rows)
    print(f"batch-invariant: {'yes' if worst == 0 and all(s for _, s, _ in rows) else 'no'}"
          f" (largest difference {worst:.2e})")
    if seconds:
        print(f"a batch of 64, best of {args.repeats}: " + ", ".join(
            f"{kind} batch-invariant {s:.2f} s ({s / seconds['none']:.2f}x)"
            for kind, s in seconds.items()))


if __name__ == "__main__":
    main()
