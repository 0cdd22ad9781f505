"""Routed experts (R3) on the HF backend, with a tiny random Qwen3-MoE: each token's experts
as a reference forward pass of transformers routes it; replayed into a trainer's forward
pass (`rollout.apps.rl.routing`), they are the experts it takes. (A dense model refuses
them by name: the contract suite's on-policy tests.)"""

from __future__ import annotations

import pytest
import torch

import rollout
from rollout.apps.rl.routing import replay_routing, routing_ids
from rollout.kit.moe import expert_ids, routers
from rollout.testing.routing import (PROMPTS, assert_routed_as_the_reference,
                                     float32_model, streamed_with_routing_last)

@pytest.fixture(scope="module")
def ro(tiny_moe):
    ro = rollout.load_backend("hf", model=str(tiny_moe), batch_size=4)
    yield ro
    ro.close()


@pytest.fixture(scope="module")
def reference(tiny_moe):
    return float32_model(tiny_moe)


@pytest.fixture(scope="module")
def results(ro):
    """Sampled and greedy rows that join the running batch at different steps (4 rows at
    most decode together), each with its routed experts and raw logprobs."""
    requests = [{"prompt": p, "sampling": {"max_tokens": 6 + i, "ignore_eos": True,
                                           "temperature": 1.0 if i % 2 else 0.0,
                                           "n": 2 if i % 2 else 1, "logprobs": 0,
                                           "return_routed_experts": True}}
                for i, p in enumerate(PROMPTS * 2)]
    return [r for c in ro.generate(requests) for r in c.unwrap()]


def test_each_tokens_experts_are_those_of_a_reference_forward(results, reference):
    assert len(results) == 9
    for result in results:
        shape = assert_routed_as_the_reference(result, reference)
        assert shape[1:] == (2, 2)  # 2 MoE layers, 2 experts each


def test_a_streamed_sample_gets_them_on_its_last_chunk(ro, results):
    greedy = results[0]
    request = {"prompt": PROMPTS[0], "sampling": {"max_tokens": 6, "ignore_eos": True,
                                                  "temperature": 0.0,
                                                  "return_routed_experts": True}}
    result = streamed_with_routing_last(ro, request)
    assert result.token_ids == greedy.token_ids
    assert result.routed_experts == greedy.routed_experts


def test_replayed_a_trainer_takes_the_engines_experts_and_weighs_them_its_own_way(
        results, reference, tiny_moe):
    sequences = [[*r.prompt_token_ids, *r.token_ids] for r in results]
    width = max(map(len, sequences))
    ids = torch.tensor([s + [0] * (width - len(s)) for s in sequences])
    given = routing_ids(results, width)
    known = given[..., 0, 0] >= 0  # positions with the engine's routing
    # A trainer whose routers drifted from the engine's weights routes otherwise ...
    trainer = float32_model(tiny_moe)
    with torch.no_grad():
        for router in routers(trainer):
            router.weight.add_(torch.randn_like(router.weight) * router.weight.std())
    assert not torch.equal(expert_ids(trainer, ids)[known], given[known])
    # ... and, replayed, takes the engine's experts, the others routed its own way.
    with replay_routing(trainer, given):
        assert torch.equal(expert_ids(trainer, ids)[known], given[known])
        loss = trainer(input_ids=ids).logits.logsumexp(-1).mean()
    loss.backward()
    assert all(r.weight.grad is not None and r.weight.grad.abs().sum() > 0
               for r in routers(trainer))  # the routers still learn
    # Replaying the engine's own model changes nothing (where no near-tie went the other
    # way in the engine): its logprobs are the engine's.
    with torch.no_grad():
        plain = reference(input_ids=ids).logits
        with replay_routing(reference, given):
            replayed = reference(input_ids=ids).logits
    if torch.equal(expert_ids(reference, ids)[known], given[known]):
        assert torch.allclose(plain, replayed, atol=1e-6)
    logprobs = torch.log_softmax(replayed, dim=-1)
    for i, result in enumerate(results):
        start = len(result.prompt_token_ids)
        mine = logprobs[i, start - 1:start - 1 + len(result.token_ids)].gather(
            -1, torch.tensor(result.token_ids)[:, None])[:, 0]
        assert torch.allclose(mine, torch.tensor(result.logprobs), atol=1e-4)


def test_a_replay_of_another_shape_is_refused(reference):
    with pytest.raises(ValueError, match="3 MoE layers"):
        with replay_routing(reference, torch.zeros(1, 4, 3, 2, dtype=torch.long)):
            pass
