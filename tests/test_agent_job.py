"""`rollout generate --environment`: one trajectory per sample into parquet, on the real HF
backend, with a summary; killed with SIGKILL and run again, it keeps the finished chunks."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

ENVIRONMENT = "rollout.testing.agents:ToolTask"


def command(tiny_model, tmp_path, rows: int, *extra) -> list[str]:
    prompts = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": [f"what is {i % 10} + 1?" for i in range(rows)],
                             "idx": list(range(rows))}), prompts)
    return [sys.executable, "-m", "rollout", "generate", "--backend", "hf",
            "--model", str(tiny_model), "--input", str(prompts),
            "--output", str(tmp_path / "out.parquet"), "--environment", ENVIRONMENT,
            "--max-tokens", "128", "--quiet", *extra]


def test_trajectories_to_parquet_with_a_summary(tiny_model, tmp_path):
    done = subprocess.run(command(tiny_model, tmp_path, 3, "--n", "2", "--temperature", "1",
                                  "--seed", "3", "--env-option", "calls=2"),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    table = pq.read_table(tmp_path / "out.parquet").to_pylist()
    assert [(r["idx"], r["sample"]) for r in table] == [(i, k) for i in range(3) for k in (0, 1)]
    for r in table:
        assert r["end_reason"] == "done" and r["num_turns"] == 3, r["end_detail"]
        assert len(r["response_ids"]) == len(r["mask"]) == len(r["logprobs"])
        # One unversioned span per turn's sampled run of tokens, covering mask 1 exactly.
        covered = [t for x in r["weight_versions"] for t in range(x["start"], x["end"])]
        assert covered == [t for t, m in enumerate(r["mask"]) if m]
        assert {x["version"] for x in r["weight_versions"]} == {None}
        turns = json.loads(r["turns"])
        assert [c["outcome"] for t in turns for c in t["tool_calls"]] == ["ok", "ok"]
        assert json.loads(r["messages"])[-1]["role"] == "assistant"
    assert table[0]["response_ids"] != table[1]["response_ids"]  # two samples, two seeds
    summary = json.loads((tmp_path / "out.summary.json").read_text())
    assert summary["trajectories"] == 6 and summary["end_reasons"] == {"done": 6}
    assert summary["tool_calls"] == {"ok": 12} and summary["turns"] == 18
    assert summary["engine_s"] > 0 and summary["sampled_tokens"] == sum(
        sum(r["mask"]) for r in table)


def test_a_killed_agent_job_reruns_to_the_same_trajectories(tiny_model, tmp_path):
    rows = 30
    argv = command(tiny_model, tmp_path, rows, "--chunk-size", "2", "--seed", "5",
                   "--temperature", "1")
    out = tmp_path / "out.parquet"
    parts = Path(str(out) + ".parts")
    job = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 180
    while len(list(parts.glob("part-*.parquet"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(job.pid, signal.SIGKILL)
    job.wait(30)
    kept = {p.name: pq.read_table(p).to_pylist() for p in parts.glob("part-*.parquet")}
    assert 2 <= len(kept) < rows // 2 and not out.exists()

    again = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    summary = json.loads(again.stderr.strip().splitlines()[-1])
    assert summary["trajectories_this_run"] == rows - 2 * len(kept)
    table = pq.read_table(out).to_pylist()
    assert [r["idx"] for r in table] == list(range(rows))
    assert all(r["end_reason"] == "done" for r in table)
    # The kept chunks are in the output as they were written.
    for part in kept.values():
        for before in part:
            after = table[before["row"]]
            assert after["response_ids"] == before["response_ids"]
