"""The batch job on Ray Data (rollout.apps.jobs.ray_data), HF backend, tiny model, on a local
Ray cluster: it writes what the single-driver job writes, row for row, from a file or a
folder of files with several row groups; killed and run again, it computes no written
chunk again and writes every row once."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

ray = pytest.importorskip("ray", reason='Ray is not installed (pip install "rollout-core[ray]")')
pytest.importorskip("ray.data", reason="Ray Data needs pandas")

from ray.cluster_utils import Cluster  # noqa: E402

from rollout import load_backend  # noqa: E402
from rollout.apps.jobs.config import GenerateConfig  # noqa: E402
from rollout.apps.jobs.generate import GenerateJob  # noqa: E402
from rollout.apps.jobs.ray_data import Plan, RayDataJob  # noqa: E402
from rollout.contract import convert  # noqa: E402
from rollout.contract.errors import InvalidRequestError  # noqa: E402

GREEDY = {"max_tokens": 8, "temperature": 0.0}
LONG = {"max_tokens": 48, "ignore_eos": True, "temperature": 0.7, "seed": 5}


@pytest.fixture(scope="module")
def cluster():
    # Logical CPUs: one per actor and room for Ray Data's own tasks on a 2-core machine.
    cluster = Cluster(initialize_head=True, connect=True,
                      head_node_args={"num_cpus": 4, "include_dashboard": False})
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def write_prompts(path: Path, rows: range, row_group_size: int = 10) -> None:
    pq.write_table(pa.table({"prompt": [f"the ka {i}" for i in rows], "idx": list(rows)}),
                   path, row_group_size=row_group_size)


def config(**settings) -> GenerateConfig:
    return convert.structure({"backend": "hf", "chunk_size": 4, **settings}, GenerateConfig)


def test_plan_names_chunks_by_first_row_within_row_groups(tmp_path):
    folder = tmp_path / "in"
    folder.mkdir()
    write_prompts(folder / "a.parquet", range(0, 10), row_group_size=6)  # groups of 6, 4
    write_prompts(folder / "b.parquet", range(10, 15))
    plan = Plan.of(str(folder), 4)
    assert plan.rows == 15 and plan.chunks == 5
    assert [plan.locate(c)[2:] for c in range(plan.chunks)] == [
        (0, 4, 0), (4, 2, 4), (0, 4, 6), (0, 4, 10), (4, 1, 14)]
    assert plan.locate(4)[0] == str(folder / "b.parquet")


def test_writes_what_the_driver_job_writes(cluster, tiny_model, tmp_path):
    folder = tmp_path / "in"
    folder.mkdir()
    write_prompts(folder / "a.parquet", range(0, 18))
    write_prompts(folder / "b.parquet", range(18, 30))
    out = tmp_path / "out"
    stats = RayDataJob(config(input=str(folder), output=str(out), model=str(tiny_model),
                              sampling=GREEDY, replicas=2, ray_data=True)).run(
        {"batch_size": 4}, progress=False)
    assert stats["rows_this_run"] == 30 and stats["errors"] == 0 and stats["samples"] == 30
    written = pq.read_table(out).to_pylist()  # the parts, in row order
    assert [row["idx"] for row in written] == list(range(30))

    whole = tmp_path / "whole.parquet"
    pq.write_table(pa.concat_tables([pq.read_table(f) for f in sorted(folder.iterdir())]),
                   whole)
    driver_config = config(input=str(whole), output=str(tmp_path / "driver.parquet"),
                           model=str(tiny_model), sampling=GREEDY)
    with load_backend("hf", str(tiny_model)) as engine:
        import asyncio

        asyncio.run(GenerateJob(driver_config).run(engine, progress=False))
    expected = pq.read_table(tmp_path / "driver.parquet").to_pylist()
    assert [r["response_token_ids"] for r in written] == \
        [r["response_token_ids"] for r in expected]
    assert [r["responses"] for r in written] == [r["responses"] for r in expected]

    again = RayDataJob(config(input=str(folder), output=str(out), model=str(tiny_model),
                              sampling=GREEDY, replicas=2, ray_data=True)).run({}, False)
    assert again["rows_this_run"] == 0 and again["chunks_this_run"] == 0


def test_killed_job_reruns_without_computing_a_written_chunk_again(cluster, tiny_model,
                                                                  tmp_path):
    count = 40
    source = tmp_path / "in.parquet"
    write_prompts(source, range(count), row_group_size=count)
    out = tmp_path / "out"
    settings = tmp_path / "job.yaml"  # the CLI has no flag for ignore_eos
    settings.write_text("sampling: {ignore_eos: true}\n")
    command = [sys.executable, "-m", "rollout", "generate", "--ray-data", "--backend", "hf",
               "--model", str(tiny_model), "--input", str(source), "--output", str(out),
               "--replicas", "2", "--chunk-size", "2", "--max-tokens", str(LONG["max_tokens"]),
               "--temperature", "0.7", "--seed", "3", "--quiet", "-o", "batch_size=2",
               "--ray-address", cluster.address, "--config", str(settings)]
    job = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 180
    while len(list(out.glob("part-*.parquet"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    job.send_signal(signal.SIGKILL)
    job.wait(30)
    before = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.glob("part-*")}
    assert 2 <= len(before) < count // 2

    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    stats = json.loads(result.stderr.strip().splitlines()[-1])
    # Parts written before the rerun planned (by the killed job's actors too) are skipped.
    assert 0 < stats["rows_this_run"] <= count - 2 * len(before)
    assert {n: (os.stat(out / n).st_ino, os.stat(out / n).st_mtime_ns) for n in before} == \
        before  # no finished chunk written again
    rows = pq.read_table(out).to_pylist()
    assert [r["idx"] for r in rows] == list(range(count))  # every row once, none lost
    assert all(r["error"] is None and r["completion_tokens"] == [LONG["max_tokens"]]
               for r in rows)


def test_settings_it_cannot_honour_are_refused(tmp_path):
    write_prompts(tmp_path / "in.parquet", range(4))
    common = {"input": str(tmp_path / "in.parquet"), "model": "m", "ray_data": True}
    with pytest.raises(InvalidRequestError, match="server"):
        RayDataJob(config(**common, output=str(tmp_path / "o"), server="http://h:1",
                          backend=None))
    with pytest.raises(InvalidRequestError, match="ray.strategy"):
        RayDataJob(config(**common, output=str(tmp_path / "o"), ray={"strategy": "PACK"}))
    with pytest.raises(InvalidRequestError, match="mode"):
        config(**common, output=str(tmp_path / "o"), mode="hybrid")
    (tmp_path / "file").write_text("")
    with pytest.raises(InvalidRequestError, match="folder"):
        RayDataJob(config(**common, output=str(tmp_path / "file")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(InvalidRequestError, match="no .parquet file"):
        RayDataJob(config(**{**common, "input": str(tmp_path / "empty")},
                          output=str(tmp_path / "o")))
