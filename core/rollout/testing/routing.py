"""Routed experts (`Result.routed_experts`) against a reference forward pass of the same
mixture-of-experts model in transformers, for the backends' routing tests."""

from __future__ import annotations

# A router whose k-th and next experts' probabilities are this close may be decided either
# way by another kernel (the engine's batched pass against the reference's own).
TIE = 1e-5


def near_ties(model, outputs: list):
    """Per position of one sequence's `router_outputs`: whether some router's choice there
    is a near-tie."""
    import torch

    from rollout.kit.moe import routers

    gaps = []
    for router, (logits, *_) in zip(routers(model), outputs):
        probs = logits.float().softmax(-1).sort(-1, descending=True).values
        gaps.append(probs[:, router.top_k - 1] - probs[:, router.top_k])
    return (torch.stack(gaps) < TIE).any(dim=0)


def assert_routed_as_the_reference(result, reference) -> tuple[int, ...]:
    """Every token the engine ran (all but the last) was routed to the experts the
    reference routes it to, near-ties aside; returns the routing's shape."""
    import torch

    from rollout.kit.moe import expert_ids, router_outputs

    sequence = torch.tensor([[*result.prompt_token_ids, *result.token_ids][:-1]])
    assert len(result.routed_experts) == sequence.shape[1]  # the last ran through none
    outputs = router_outputs(reference, sequence)
    expected = expert_ids(reference, sequence, outputs)[0]
    clear = ~near_ties(reference, outputs)
    assert clear.float().mean() > 0.9  # (near-ties are rare)
    assert torch.equal(torch.tensor(result.routed_experts)[clear], expected[clear])
    return tuple(expected.shape)
