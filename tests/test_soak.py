"""The two-minute soak (bench/soak.py --check): `rollout serve --replicas 2` under a mixed
load with weight updates and a replica killed; fails on growth of memory, threads, open
files or /dev/shm files after warm-up, on any 5xx and on any request lost.

No floor of requests a second here: a rate is the machine's as much as the code's (CI once
made 19.6/s where a quiet run makes 200), so a timed floor fails under load. The served
path's speed is checked by bench/bench_replica_path.py, as a ratio in one process."""

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def test_two_minute_soak_grows_nothing_and_loses_nothing(tmp_path):
    png = tmp_path / "soak.png"
    run = subprocess.run([sys.executable, "soak.py", "--duration", "120", "--check",
                          "--png", str(png)], cwd=BENCH,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert "FAIL" not in run.stdout and png.stat().st_size > 0


def test_the_check_fails_below_the_floor(monkeypatch, capsys):
    """The floor's check on a finished run's figures: a rate under --floor fails it."""
    import argparse

    monkeypatch.syspath_prepend(str(BENCH))
    import soak

    samples = [{"t": t, "requests": 100 * t, **dict.fromkeys([*soak.LIMITS, *soak.SHOWN], 1.0)}
               for t in range(10)]
    load = soak.Load("", ["hi"], 0)
    load.done, load.outcomes["completion", "ok"] = 1000, 1000

    def check(floor):
        args = argparse.Namespace(duration=10.0, warmup=0.25, png=None, check=True, floor=floor)
        return soak.report(args, samples, [(1.0, "replica killed")], load, [])

    assert check(50) == 0  # 100 requests/s
    assert check(150) == 1
    assert "100.0 requests/s, below the floor of 150" in capsys.readouterr().out
