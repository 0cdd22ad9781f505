"""examples/grpo.py on SGLang, unchanged but for its backend options: weights pushed after
every step reach the engine (versions and logprobs match the trainer), and the reward rises.
The CPU scaffolding that conftest puts on PYTHONPATH reaches the script's process too."""

from rollout.testing.grpo import run_grpo


def test_reward_rises_and_logprobs_match(tiny_model):
    # float32: the trainer's dtype; a small KV pool, for 4 x 8 short samples.
    run = run_grpo("sglang", {"dtype": "float32", "max_total_tokens": 8192}, tiny_model,
                   "--steps", 20, "--seed", 0, "--check")
    assert run.summary["max_logprob_diff"] <= 1e-3
    assert run.summary["last_reward"] > run.summary["first_reward"] + 0.05, run.summary
