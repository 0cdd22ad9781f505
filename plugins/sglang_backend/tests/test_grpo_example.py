"""examples/grpo.py on SGLang, unchanged but for its backend options: weights pushed after
every step reach the engine (versions and logprobs match the trainer), and the reward rises.
The CPU scaffolding that conftest puts on PYTHONPATH reaches the script's process too."""

import json
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "grpo.py"


def test_reward_rises_and_logprobs_match(tiny_model):
    # float32: the trainer's dtype; a small KV pool, for 4 x 8 short samples.
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), "--model", str(tiny_model), "--backend", "sglang",
         "--backend-option", "dtype=float32", "--backend-option", "max_total_tokens=8192",
         "--steps", "20", "--seed", "0", "--check"],
        capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["max_logprob_diff"] <= 1e-3
    assert summary["last_reward"] > summary["first_reward"] + 0.05, summary
