"""`update_weights(pause="keep_kv")` on the HF backend: a running request stays in the
engine, and its tokens after the update are what the new weights make over the KV cache
the old ones made. Checked against transformers doing the same by hand: the cache of the
tokens before the edge from the old model, then the new weights decoding over it."""

from __future__ import annotations

import pytest
import torch

import rollout
from rollout.testing.contract import across_a_keep
from rollout.testing.model_folders import load_weights, perturbed_copy

AFTER = 16  # tokens out before the update
CHECKED = 8  # tokens after the edge compared with the reference


@pytest.fixture(scope="module")
def other(tiny_model, tmp_path_factory):
    return perturbed_copy(tiny_model, tmp_path_factory.mktemp("other"))


def greedy_over(cache, model, ids: list[int], steps: int):
    """Greedy tokens and their raw logprobs: `model` decodes from the last of `ids` over
    `cache` (the KV of the ones before it)."""
    tokens, logprobs, token = [], [], ids[-1]
    for _ in range(steps):
        out = model(torch.tensor([[token]]), past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        scores = out.logits[0, -1].double().log_softmax(-1)
        token = int(scores.argmax())
        tokens.append(token)
        logprobs.append(float(scores[token]))
    return tokens, logprobs


def test_after_the_edge_the_new_weights_decode_over_the_old_cache(tiny_model, other):
    from transformers import AutoModelForCausalLM

    ro = rollout.load_backend("hf", model=str(tiny_model))
    request = {"prompt": "the ka lo", "sampling": {"temperature": 0.0, "ignore_eos": True,
                                                   "logprobs": 0, "max_tokens": 2000}}
    try:
        [kept] = across_a_keep(ro, ro, request, load_weights(other), 1, AFTER,
                               pause="keep_kv").unwrap()
    finally:
        ro.close()
    edge = kept.weight_versions[0].end
    assert AFTER <= edge <= kept.completion_tokens - CHECKED
    old, new = (AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
                for folder in (tiny_model, other))
    ids = list(kept.prompt_token_ids) + list(kept.token_ids[:edge])
    with torch.no_grad():
        cache = old(torch.tensor([ids[:-1]]), use_cache=True).past_key_values
        tokens, logprobs = greedy_over(cache, new, ids, CHECKED)
        recomputed = new(torch.tensor([ids[:-1]]), use_cache=True).past_key_values
        _, fresh = greedy_over(recomputed, new, ids, 1)
    assert list(kept.token_ids[edge:edge + CHECKED]) == tokens
    assert kept.logprobs[edge:edge + CHECKED] == pytest.approx(logprobs, abs=1e-4)
    # (and the kept cache is not the recomputed one: what pause="keep" would have given)
    assert abs(kept.logprobs[edge] - fresh[0]) > 1e-3
