"""examples/grpo.py on vLLM, unchanged but for its backend options: weights pushed after
every step reach the engine (versions and logprobs match the trainer), and the reward rises."""

import pytest
from conftest import ENGINE

from rollout.testing.grpo import run_grpo


def test_reward_rises_and_logprobs_match(tiny_model):
    # float32 on CPU: vLLM's default there is bfloat16, whose logprobs are ~0.2 away.
    run = run_grpo("vllm", ENGINE, tiny_model, "--steps", 20, "--seed", 0, "--check")
    assert run.summary["max_logprob_diff"] <= 1e-3
    assert run.summary["last_reward"] > run.summary["first_reward"] + 0.05, run.summary


@pytest.mark.parametrize("backend, options", [
    ("hf", {}),
    ("vllm", {**ENGINE, "mode": "async",
              "engine_args": {"enable_lora": True, "max_loras": 1, "max_lora_rank": 8}}),
])
def test_a_lora_adapter_learns_and_its_logprobs_match(tiny_model, backend, options):
    """--lora: the trainer trains an adapter (peft) and pushes only it each step; every
    token is of the adapter version just pushed, its logprob the trainer's, and the reward
    rises. (Here, where peft is installed: the vLLM environment has the HF backend too.)"""
    run = run_grpo(backend, options, tiny_model, "--lora", 8, "--steps", 20, "--seed", 0,
                   "--check")
    assert run.summary["lora"] == 8 and len(run.steps) == 20
    assert run.summary["max_logprob_diff"] <= 1e-3
    assert run.summary["last_reward"] > run.summary["first_reward"] + 0.05, run.summary


def test_a_lora_adapter_through_two_replica_processes(tiny_model):
    """The adapter reaches both replicas every step (each token's logprob is checked)."""
    run = run_grpo("hf", {}, tiny_model, "--lora", 8, "--replicas", 2, "--steps", 5,
                   "--prompts", 4, "--group-size", 4, "--seed", 0, timeout=300)
    assert run.summary["max_logprob_diff"] <= 1e-3 and len(run.summary["rewards"]) == 5
