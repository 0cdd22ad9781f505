"""What routing replay (R3) buys a mixture-of-experts trainer whose numerics differ from the
engine's: the engine samples in bfloat16 (the default here; `-o dtype=...`), the trainer
scores the same tokens in float32, once routing by itself and once taking the engine's
experts (`rollout.apps.rl.routing.replay_routing`).

Printed, over the sampled tokens: the share whose experts differ from the engine's in at
least one layer (Megatron #4168's measure), and the importance ratio exp(trainer - engine)
(mean, share outside [0.9, 1.1], k3 KL) without replay and with it.

    python bench/bench_routing_replay.py [--backend hf] [-o dtype=bfloat16] [--prompts 32]

The model is a tiny random Qwen3-MoE (`rollout.kit.tiny_model.build_tiny_moe`, 8 experts, 2
per token, 2 layers) unless `--model` names a mixture-of-experts model folder.
"""

from __future__ import annotations

import argparse
import tempfile

from common import add_backend_arguments, prepare_engine, prompts


def trainer_logprobs(model, result, ids=None):
    """The trainer's logprob of each sampled token (float32, temperature 1), routing by
    itself or, given `ids` [1, len, layers, k], as the engine did."""
    import torch

    from rollout.apps.rl.routing import replay_routing

    sequence = torch.tensor([[*result.prompt_token_ids, *result.token_ids]])
    start = len(result.prompt_token_ids)
    with torch.no_grad():
        if ids is None:
            logits = model(input_ids=sequence).logits
        else:
            with replay_routing(model, ids):
                logits = model(input_ids=sequence).logits
    steps = logits[0, start - 1:-1].float().log_softmax(-1)
    return steps.gather(-1, sequence[0, start:, None])[:, 0].tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_backend_arguments(parser)
    parser.add_argument("--model", default=None, help="a MoE model folder (default: tiny)")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    prepare_engine(args.backend)

    import torch
    from transformers import AutoModelForCausalLM

    import rollout
    from rollout.apps.rl.mismatch import mismatch
    from rollout.apps.rl.routing import routing_ids
    from rollout.kit.moe import expert_ids
    from rollout.kit.tiny_model import build_tiny_moe

    with tempfile.TemporaryDirectory() as tmp:
        folder = args.model or str(build_tiny_moe(tmp))
        options = {"dtype": "bfloat16", **dict(args.options)}
        trainer = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        with rollout.load_backend(args.backend, model=folder, **options) as ro:
            requests = [{"prompt": text, "sampling": {
                "temperature": 1.0, "max_tokens": args.tokens, "ignore_eos": True,
                "seed": 1000 + i, "logprobs": 0, "return_routed_experts": True}}
                for i, text in enumerate(prompts(args.prompts))]
            results = [r for c in ro.generate(requests) for r in c.unwrap()]
    engine, own, replayed, differ, tokens = [], [], [], 0, 0
    for result in results:
        start = len(result.prompt_token_ids)
        given = torch.tensor(result.routed_experts)[start - 1:]  # those that made a token
        run = [*result.prompt_token_ids, *result.token_ids][:-1]
        mine = expert_ids(trainer, torch.tensor([run]))[0, start - 1:]
        differ += int((given.sort(-1).values != mine.sort(-1).values).any(-1).any(-1).sum())
        tokens += len(result.token_ids)
        engine.append(list(result.logprobs))
        own.append(trainer_logprobs(trainer, result))
        width = start + len(result.token_ids)
        replayed.append(trainer_logprobs(trainer, result, routing_ids([result], width)))
    print(f"{args.backend} {options}: {len(results)} samples, {tokens} tokens; "
          f"{differ / tokens:.1%} routed to other experts by the float32 trainer "
          "in at least one layer")
    for name, trained in (("trainer routing by itself", own), ("routing replayed", replayed)):
        m = mismatch(trained, engine)
        print(f"  {name:26} ratio mean {m['ratio_mean']:.4f}, {m['outside']:6.2%} outside "
              f"[0.9, 1.1], k3 KL {m['kl_k3']:.2e}")


if __name__ == "__main__":
    main()
