"""Checks that only a real, trained model can fail: the sums it gets right under greedy
decoding, its own chat template, the same answers on every engine, and weight pushes that
change what the engine computes by exactly what the trainer changed.

The model is SmolLM2-135M-Instruct as `rollout model smollm2` converts it (float32).
"""

from __future__ import annotations

from pathlib import Path

from rollout import Result, Rollout
from rollout.apps.datasets import sums
from rollout.testing.agreement import TOLERANCE, check_first_token_logprobs, check_greedy_tokens

# Sums it answers right, and then stops, under greedy decoding (it gets about half of
# 1..20 right).
RIGHT_SUMS = [(2, 3), (1, 5), (9, 8), (14, 20), (3, 4), (10, 10), (4, 9), (5, 9)]
# Its template adds this system turn when the conversation has none.
SYSTEM_PREFIX = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM"


def sum_requests(max_tokens: int = 16, logprobs: int = 3) -> list[dict]:
    return [{"id": f"sum-{a}-{b}", "messages": sums.messages(a, b),
             "sampling": {"temperature": 0.0, "max_tokens": max_tokens, "logprobs": logprobs}}
            for a, b in RIGHT_SUMS]


def greedy_sums(backend: Rollout, **kwargs) -> list[Result]:
    return [c.unwrap()[0] for c in backend.generate(sum_requests(**kwargs))]


def check_sums_right(results: list[Result]) -> None:
    for (a, b), result in zip(RIGHT_SUMS, results):
        assert sums.is_right(result.text, a + b), (a, b, result.text)
        assert result.finish_reason == "stop", (a, b, result.text)  # ended at <|im_end|>


def check_chat_template(result: Result, tokenizer) -> None:
    prompt = tokenizer.decode(result.prompt_token_ids)
    assert prompt.startswith(SYSTEM_PREFIX), prompt
    assert prompt.endswith("<|im_start|>assistant\n"), prompt


def check_agrees_with_hf(hf_results: list[Result], results: list[Result], model_dir) -> None:
    """Another engine's greedy sums against the HF backend's: the same first-token logprobs
    and tokens (up to a near-tie), right, and rendered with the model's own template."""
    from transformers import AutoTokenizer

    pairs = list(zip(hf_results, results))
    check_first_token_logprobs(pairs)
    check_greedy_tokens(pairs)
    check_sums_right(results)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    for result in results:
        check_chat_template(result, tokenizer)


def perturbed_weights(model_dir: str | Path, seed: int = 0, scale: float = 0.02) -> dict:
    """Every projection matrix with seeded noise of `scale` times its own spread added:
    what a few large optimizer steps do, reproducible anywhere."""
    import torch
    from safetensors.torch import load_file

    state = load_file(str(Path(model_dir) / "model.safetensors"))
    generator = torch.Generator().manual_seed(seed)
    return {name: (t + torch.randn(t.shape, generator=generator) * t.std() * scale
                   if name.endswith("proj.weight") else t)
            for name, t in state.items()}


def reference_logprobs(model_dir: str | Path, weights: dict, results: list[Result]) -> list:
    """Each result's token logprobs under transformers' forward pass with `weights`."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    model.load_state_dict(weights, strict=False)
    out = []
    with torch.no_grad():
        for r in results:
            ids = torch.tensor([list(r.prompt_token_ids) + list(r.token_ids)])
            logprobs = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
            start = len(r.prompt_token_ids)
            rows = logprobs[start - 1: start - 1 + len(r.token_ids)]
            out.append(rows.gather(1, torch.tensor(r.token_ids).unsqueeze(1)).squeeze(1).tolist())
    return out


def check_update_takes_effect(backend: Rollout, model_dir: str | Path) -> None:
    """A push of perturbed weights: afterwards the engine's logprobs are transformers' with
    those weights (within TOLERANCE) and far from what they were before."""
    before = greedy_sums(backend, logprobs=0)
    weights = perturbed_weights(model_dir)
    backend.update_weights(weights.items(), version=1)
    after = greedy_sums(backend, logprobs=0)
    assert {r.weight_version for r in after} == {1}
    expected = reference_logprobs(model_dir, weights, after)
    worst = max(abs(a - b) for r, ref in zip(after, expected) for a, b in zip(r.logprobs, ref))
    assert worst < TOLERANCE, worst
    moved = max(abs(b.logprobs[0] - a.logprobs[0]) for b, a in zip(before, after))
    assert moved > 20 * TOLERANCE, moved  # the push changed the model, not a no-op
