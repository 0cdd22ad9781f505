"""Routed experts (`Result.routed_experts`) against a reference forward pass of the same
mixture-of-experts model in transformers, for the backends' routing tests."""

from __future__ import annotations

# Prompts of the tiny MoE's vocabulary, of several lengths.
PROMPTS = ["ka lo mi", "su ta ri po an el is on", "qu"]
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


def streamed_with_routing_last(ro, request: dict):
    """`request` (one sample) streamed: the routing comes on the chunk that ends it, and
    on no other; returns its result."""
    from rollout.testing.contract import on_engine_loop

    async def run():
        stream = ro.stream(request)
        return [chunk async for chunk in stream], stream.completion

    chunks, completion = on_engine_loop(run())
    assert [c.routed_experts is not None for c in chunks if c.token_ids] == \
        [c.finish_reason is not None for c in chunks if c.token_ids]
    (result,) = completion.unwrap()
    return result


def float32_model(folder):
    """The model in `folder` in transformers, float32, for reference passes."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
