"""examples/grpo.py run as a user runs it, for each backend's test of the GRPO loop.

The example is not part of the package: it is found in the checkout that this package is
installed from (editable), as the tests that use it are.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import attrs

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "grpo.py"


@attrs.frozen
class GrpoRun:
    summary: dict  # the JSON line the example prints last
    steps: list[str]  # its "step N ..." lines, one per training step


def sampler_options(*argv: str) -> dict:
    """The backend options the example gives its sampler for these flags (its own module,
    imported; nothing is started)."""
    spec = importlib.util.spec_from_file_location("grpo_example", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example.sampler_options(example.parse_args(list(argv)))


def run_grpo_script(*args, timeout: float = 600) -> subprocess.CompletedProcess:
    """The example with `args` in a child process, whatever its outcome; offline (its
    model is a local folder). The child inherits this environment (the SGLang tests' CPU
    scaffolding reaches it on PYTHONPATH)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, str(EXAMPLE), *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=timeout)


def run_grpo(backend: str, options: dict, model, *args, timeout: float = 600) -> GrpoRun:
    """The example on `backend` with `options` (its --backend-option pairs) and the model
    folder `model`; `args` are more of its flags. Fails the test, with the end of the
    run's output, unless it succeeded."""
    # Values as JSON, which the example reads as YAML: "float32", 8192, true.
    flags = [arg for key, value in options.items()
             for arg in ("--backend-option", f"{key}={json.dumps(value)}")]
    done = run_grpo_script("--model", model, "--backend", backend, *flags, *args,
                           timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    return GrpoRun(summary=json.loads(lines[-1]),
                   steps=[line for line in lines if line.startswith("step ")])
