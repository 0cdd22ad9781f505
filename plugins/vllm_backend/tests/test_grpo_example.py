"""examples/grpo.py on vLLM, unchanged but for its backend options: weights pushed after
every step reach the engine (versions and logprobs match the trainer), and the reward rises."""

import json
import subprocess
import sys
from pathlib import Path

from conftest import ENGINE

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "grpo.py"


def test_reward_rises_and_logprobs_match(tiny_model):
    # float32 on CPU: vLLM's default there is bfloat16, whose logprobs are ~0.2 away.
    options = [arg for key, value in ENGINE.items()
               for arg in ("--backend-option", f"{key}={json.dumps(value)}")]
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), "--model", str(tiny_model), "--backend", "vllm", *options,
         "--steps", "20", "--seed", "0", "--check"],
        capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["max_logprob_diff"] <= 1e-3
    assert summary["last_reward"] > summary["first_reward"] + 0.05, summary
