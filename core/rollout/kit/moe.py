"""Mixture-of-experts models in transformers: where their routers are.

transformers (5.x) gives every MoE layer a router module (`Qwen3MoeTopKRouter`,
`MixtralTopKRouter` and their kin) whose forward takes the pass's tokens, flattened, and
returns (logits, scores, expert ids), the ids [tokens, top_k]. The HF backend reads the
ids (`sampling.return_routed_experts`); a trainer replays them
(`rollout.apps.rl.routing`)."""

from __future__ import annotations


def routers(model) -> list:
    """The model's MoE routers, in the order its layers run (empty for a dense model)."""
    return [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
