"""examples/grpo.py on vLLM, unchanged but for its backend options: weights pushed after
every step reach the engine (versions and logprobs match the trainer), and the reward rises."""

from conftest import ENGINE

from rollout.testing.grpo import run_grpo


def test_reward_rises_and_logprobs_match(tiny_model):
    # float32 on CPU: vLLM's default there is bfloat16, whose logprobs are ~0.2 away.
    run = run_grpo("vllm", ENGINE, tiny_model, "--steps", 20, "--seed", 0, "--check")
    assert run.summary["max_logprob_diff"] <= 1e-3
    assert run.summary["last_reward"] > run.summary["first_reward"] + 0.05, run.summary
