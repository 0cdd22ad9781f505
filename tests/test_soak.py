"""The two-minute soak (bench/soak.py --check): `rollout serve --replicas 2` under a mixed
load with weight updates and a replica killed; fails on growth of memory, threads, open
files or /dev/shm files after warm-up, on any 5xx, and on any request lost."""

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def test_two_minute_soak_grows_nothing_and_loses_nothing(tmp_path):
    png = tmp_path / "soak.png"
    run = subprocess.run([sys.executable, "soak.py", "--duration", "120", "--check",
                          "--png", str(png)], cwd=BENCH, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert "FAIL" not in run.stdout and png.stat().st_size > 0
