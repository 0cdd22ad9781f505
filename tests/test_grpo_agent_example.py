"""examples/grpo_agent.py on the HF backend and the tiny model, through the `llm` CLI run
unchanged: every episode is the session's exact tokens (each step's logprobs equal the
trainer's forward pass), the weights reach the gateway each step, and no run fails."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "grpo_agent.py"


def test_training_through_the_llm_cli(tiny_model):
    # The CLI installed beside this Python (requirements/agents.txt).
    bin_dir = str(Path(sys.executable).parent)
    assert shutil.which("llm", path=bin_dir), "llm is not installed beside this Python"
    env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ["PATH"],
           "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, str(EXAMPLE), "--model", str(tiny_model),
                           "--steps", "2", "--prompts", "2", "--group-size", "3",
                           "--max-tokens", "8", "--lr", "3e-3"],
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    summary = json.loads(lines[-1])
    steps = [line for line in lines if line.startswith("step ")]
    assert len(steps) == 2 and summary["failed_runs"] == 0
    # 6 runs a step, one branch each (llm makes one call), 8 tokens each at most.
    assert all("6 runs, 6 branches" in line for line in steps), steps
    # Each step's logprobs are the trainer's forward pass under its current weights, which
    # every step changes: the pushes reached the engine behind the gateway.
    assert summary["max_logprob_diff"] <= 1e-3
