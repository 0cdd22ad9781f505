"""examples/grpo.py on the HF backend: weights pushed after every step reach the sampler
(versions and logprobs match the trainer), and the reward rises."""

import json
import os
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "grpo.py"


def run_example(*args, timeout=120):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, str(EXAMPLE), *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_reward_rises_and_logprobs_match(tiny_model):
    done = run_example("--model", tiny_model, "--backend", "hf", "--steps", 20, "--prompts", 4,
                       "--group-size", 8, "--seed", 0, "--check")
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.strip().splitlines()
    steps = [line for line in lines if line.startswith("step ")]
    assert len(steps) == 20
    summary = json.loads(lines[-1])
    assert summary["max_logprob_diff"] <= 1e-3
    # It rises by far more than this on most seeds (0.15 to 0.5 in 20 steps).
    assert summary["last_reward"] > summary["first_reward"] + 0.05, summary


def test_config_file_and_a_failed_logprob_check(tiny_model, tmp_path):
    config = tmp_path / "grpo.yaml"
    # A tolerance no engine meets: the check must fail the run, on the first batch.
    config.write_text(f"model: {tiny_model}\nsteps: 3\ngroup-size: 2\ntolerance: 0.0\n"
                      "backend-option: {batch_size: 4}\n")
    done = run_example("--config", config)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "step 1: logprobs differ by" in done.stdout


def test_the_same_loop_through_two_replica_processes(tiny_model):
    """The sampler in two `rollout serve` replicas: weights reach both every step."""
    done = run_example("--model", tiny_model, "--backend", "hf", "--replicas", 2, "--steps", 8,
                       "--prompts", 4, "--group-size", 4, "--seed", 0, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["max_logprob_diff"] <= 1e-3 and len(summary["rewards"]) == 8
