"""Mixture-of-experts models in transformers: where their routers are, and the experts a
forward pass takes.

transformers (5.x) gives every MoE layer a router module (`Qwen3MoeTopKRouter`,
`MixtralTopKRouter` and their kin) whose forward takes the pass's tokens, flattened, and
returns (logits, scores, expert ids), the ids [tokens, top_k]. The HF backend reads the
ids (`sampling.return_routed_experts`); a trainer replays them
(`rollout.apps.rl.routing`)."""

from __future__ import annotations


def routers(model) -> list:
    """The model's MoE routers, in the order its layers run (empty for a dense model)."""
    return [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]


def router_outputs(model, input_ids) -> list:
    """Each router's (logits, scores, expert ids) in a forward pass of `model` over
    `input_ids` [batch, seq], in layer order (after any hook that replays a routing)."""
    import torch

    outputs = []
    handles = [r.register_forward_hook(lambda module, args, out: outputs.append(out))
               for r in routers(model)]
    try:
        with torch.no_grad():
            model(input_ids=input_ids)
    finally:
        for handle in handles:
            handle.remove()
    return outputs


def expert_ids(model, input_ids, outputs: list | None = None):
    """The experts each position of `input_ids` takes: [batch, seq, layers, top_k], from
    `router_outputs` (run here unless given)."""
    import torch

    outputs = router_outputs(model, input_ids) if outputs is None else outputs
    return torch.stack([ids for *_, ids in outputs], dim=1).view(
        *input_ids.shape, len(outputs), -1)
