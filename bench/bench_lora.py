"""LoRA adapters against full weights, on one backend in this process, in one run:

- push: `Rollout.update_weights` with every weight of the model against
  `Rollout.load_adapter` with a rank-`--rank` adapter of every linear layer (the seven
  projections of each decoder layer), the same path (buckets into the backend's hook);
  rounds alternate, medians compared. Target: the adapter at least 20x faster. The adapter
  goes as separate tensors (each its own allocation, as peft makes them) and packed into one
  block, as a trainer keeps it with `rollout.weights.lora.pack_adapter`.
- generation: `--prompts` prompts of `--tokens` tokens each, with the base weights, with
  one adapter, and with four adapters mixed in one batch (each prompt its own). Targets:
  one adapter at least 0.8 of the base's tokens per second; four mixed at least 0.8 of one.

Run in the backend's environment (scripts/env.sh vllm, sglang or hf):
    python bench/bench_lora.py --backend vllm [--model smollm2] [--rank 16] [--rounds 3]
"""

from __future__ import annotations

import statistics
import tempfile

from common import model_folder, prepare_engine, prompts, timed, workload_parser

ADAPTERS = 4  # mixed in one batch


def load(backend: str, model: str, rank: int):
    import rollout

    if backend == "vllm":
        return rollout.load_backend("vllm", model=model, mode="engine", dtype="float32",
                                    engine_args={"enable_lora": True, "max_lora_rank": rank,
                                                 "max_loras": ADAPTERS})
    if backend == "sglang":
        return rollout.load_backend("sglang", model=model, mode="engine", dtype="float32",
                                    engine_args={"enable_lora": True, "max_lora_rank": rank,
                                                 "max_loras_per_batch": ADAPTERS})
    return rollout.load_backend(backend, model=model, dtype="float32")


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def generate(ro, texts: list[str], tokens: int, adapters: list[str | None]) -> float:
    """Tokens per second over the batch, each prompt with the adapter at its place."""
    seeded = ro.capabilities.supports("seed")  # not SGLang's on CPU
    requests = [{"prompt": t, "adapter": adapters[i % len(adapters)], "sampling": {
        "temperature": 1.0, "max_tokens": tokens, "ignore_eos": True,
        **({"seed": i} if seeded else {})}} for i, t in enumerate(texts)]
    seconds = timed(lambda: [c.unwrap() for c in ro.generate(requests)])
    return len(texts) * tokens / seconds


def main() -> None:
    parser = workload_parser(model=True)
    parser.add_argument("--backend", choices=("hf", "vllm", "sglang"), default="vllm")
    parser.add_argument("--rank", type=int, default=16)
    parser.set_defaults(model="smollm2", prompts=64, tokens=32)
    args = parser.parse_args()
    prepare_engine(args.backend)
    from transformers import AutoTokenizer

    from rollout.testing.adapters import lora_adapter
    from rollout.testing.model_folders import load_weights
    from rollout.weights.lora import pack_tensors

    with tempfile.TemporaryDirectory() as tmp:
        model = model_folder(args.model, tmp)
        weights = load_weights(model)
        adapters = [lora_adapter(model, rank=args.rank, seed=s) for s in range(ADAPTERS)]
        tokenizer = AutoTokenizer.from_pretrained(model)
        texts = prompts(args.prompts, tokenizer if tokenizer.chat_template else None)
        with load(args.backend, model, args.rank) as ro:
            for i, (tensors, config) in enumerate(adapters):
                ro.load_adapter(f"a{i}", tensors.items(), config)
            generate(ro, texts[:8], 4, [None, "a0"])  # warm-up
            tensors, config = adapters[0]
            packed = {k: t.clone() for k, t in tensors.items()}
            pack_tensors(list(packed.values()))
            given = {"adapter": tensors, "adapter packed": packed}
            push = {"full": [], **{k: [] for k in given}}
            speed = {"base": [], "one adapter": [], f"{ADAPTERS} adapters mixed": []}
            for r in range(args.rounds):
                for kind, named in given.items():  # each right after a full push
                    push["full"].append(timed(lambda: ro.update_weights(weights.items(),
                                                                        version=r)))
                    push[kind].append(timed(lambda: ro.load_adapter(
                        "a0", named.items(), config, version=r)))
                for name, names in zip(speed, ([None], ["a0"],
                                               [f"a{i}" for i in range(ADAPTERS)])):
                    speed[name].append(generate(ro, texts, args.tokens, names))
    full = statistics.median(push["full"])
    print(f"{args.backend}, {args.model}, rank {args.rank}, {args.rounds} rounds (medians)")
    print(f"push  full weights   {nbytes(weights) / 2**20:8.1f} MiB  {full:7.3f} s")
    for kind in given:
        adapter = statistics.median(push[kind])
        print(f"push  {kind:<14} {nbytes(tensors) / 2**20:8.1f} MiB  {adapter:7.3f} s"
              f"  -> {full / adapter:.1f}x faster (target >= 20x)")
    rates = {k: statistics.median(v) for k, v in speed.items()}
    for name, rate in rates.items():
        print(f"generate  {name:<20} {rate:9.1f} tokens/s")
    one, mixed = rates["one adapter"], rates[f"{ADAPTERS} adapters mixed"]
    print(f"one adapter / base: {one / rates['base']:.2f} (target >= 0.8); "
          f"{ADAPTERS} mixed / one: {mixed / one:.2f} (target >= 0.8)")


if __name__ == "__main__":
    main()
