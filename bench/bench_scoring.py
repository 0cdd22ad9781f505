"""Scoring given sequences (`sampling.prompt_logprobs`) through rollout against the same
scoring done by the trainer's own forward pass in transformers, side by side in one process.

Same model (the tiny one, or `--model smollm2`), same sequences (random token ids, of
lengths from `--length` down to about 3/4 of it), scored twice each way: the per-token
logprob of every token given the ones before it, as reference or recomputed logprobs are.
The trainer's side runs micro-batches of `--batch` sequences (right-padded, masked)
through the model and takes a log-softmax; rollout's side sends every sequence as one
request with `prompt_logprobs` and `max_tokens=1`. Prints sequences and tokens per second
for both, their ratio, and the largest difference between the two sets of logprobs.

    python bench/bench_scoring.py [--backend hf] [--sequences 64] [--length 256]
                                  [--batch 16] [--top 0] [--model smollm2]
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time

import rollout

from common import add_model_argument, model_folder


def sequences(count: int, length: int, vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(vocab) for _ in range(length - (i * 37) % (length // 4 + 1))]
            for i in range(count)]


def trainer_scores(model, batch: list[list[int]], pad_id: int, top: int = 0):
    """The trainer's own: one forward pass over a right-padded micro-batch; each token's
    logprob given those before it (None for the first), and with `top` the top k at each
    position too (the same work as rollout's side)."""
    import torch

    width = max(len(s) for s in batch)
    ids = torch.tensor([s + [pad_id] * (width - len(s)) for s in batch])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in batch])
    with torch.inference_mode():
        logits = model(input_ids=ids, attention_mask=mask).logits.float()
        every = torch.log_softmax(logits[:, :-1], dim=-1)
        logprobs = every.gather(-1, ids[:, 1:, None])[..., 0]
        if top:
            values, indices = every.topk(top, dim=-1)
            _ = [(values[i, :len(s) - 1].tolist(), indices[i, :len(s) - 1].tolist())
                 for i, s in enumerate(batch)]
    return [[None, *logprobs[i, :len(s) - 1].tolist()] for i, s in enumerate(batch)]


def run_trainer(model, seqs, batch_size: int, pad_id: int, top: int = 0
                ) -> tuple[float, list]:
    started = time.perf_counter()
    out = []
    for i in range(0, len(seqs), batch_size):
        out += trainer_scores(model, seqs[i:i + batch_size], pad_id, top)
    return time.perf_counter() - started, out


def run_rollout(backend, seqs, top: int) -> tuple[float, list]:
    batch = [{"prompt_token_ids": s, "sampling": {"max_tokens": 1, "temperature": 0.0,
                                                  "prompt_logprobs": top}} for s in seqs]
    started = time.perf_counter()
    completions = backend.generate(batch)
    elapsed = time.perf_counter() - started
    return elapsed, [list(c.unwrap()[0].prompt_logprobs) for c in completions]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="hf")
    add_model_argument(parser)
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16,
                        help="the trainer's micro-batch, and the HF backend's batch_size")
    parser.add_argument("--top", type=int, default=0, help="prompt_logprobs: top k as well")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        folder = model_folder(args.model, tmp)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        vocab = model.get_input_embeddings().num_embeddings
        seqs = sequences(args.sequences, args.length, vocab)
        tokens = sum(len(s) for s in seqs)
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        options = {"dtype": "float32", "batch_size": args.batch} if args.backend == "hf" \
            else {"dtype": "float32"}
        with rollout.load_backend(args.backend, model=folder, **options) as backend:
            run_rollout(backend, seqs[:2], args.top)  # warm up both
            run_trainer(model, seqs[:2], args.batch, pad_id, args.top)
            times = {"trainer": [], "rollout": []}
            for _ in range(args.repeats):
                elapsed, mine = run_trainer(model, seqs, args.batch, pad_id, args.top)
                times["trainer"].append(elapsed)
                elapsed, theirs = run_rollout(backend, seqs, args.top)
                times["rollout"].append(elapsed)
        gap = max(abs(a - b) for x, y in zip(mine, theirs) for a, b in zip(x[1:], y[1:]))
        print(f"{args.sequences} sequences, {tokens} tokens, model {args.model}, "
              f"backend {args.backend}, trainer micro-batch {args.batch}, top {args.top}, "
              f"torch threads {torch.get_num_threads()}")
        for name, runs in times.items():
            best = min(runs)
            print(f"{name:8s} best {best:7.3f} s  {args.sequences / best:8.1f} seq/s  "
                  f"{tokens / best:10.0f} tok/s  (runs: {', '.join(f'{t:.3f}' for t in runs)})")
        ratio = min(times["trainer"]) / min(times["rollout"])
        print(f"rollout / trainer speed: {ratio:.2f}x; largest logprob difference {gap:.2e}")


if __name__ == "__main__":
    main()
