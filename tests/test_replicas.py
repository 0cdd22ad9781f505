"""Replicas of the real HF backend, each a `rollout serve` process on the tiny model, behind
the least-in-flight pool: killing a replica mid-batch or the job itself loses nothing."""

import asyncio
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

pytest.importorskip("aiohttp")

from processes import replicas_of  # noqa: E402

from rollout.contract import convert  # noqa: E402
from rollout.apps.jobs.config import GenerateConfig  # noqa: E402
from rollout.apps.jobs.generate import GenerateJob  # noqa: E402
from rollout.contract.errors import InvalidRequestError  # noqa: E402
from rollout.service.connect import resolve_mode  # noqa: E402
from rollout.service.admission import Limits  # noqa: E402
from rollout.service.replicas import start_replicas  # noqa: E402
from rollout.service.served import ServedRollout  # noqa: E402
from rollout.testing.waiting import wait_for  # noqa: E402

LONG = {"max_tokens": 48, "ignore_eos": True, "temperature": 0.7, "seed": 5}


def write_prompts(path, count):
    pq.write_table(pa.table({"prompt": [f"the ka {i}" for i in range(count)],
                             "idx": list(range(count))}), path)
    return str(path)


def check_complete(out, count, n=1):
    table = pq.read_table(out).to_pylist()
    assert [r["idx"] for r in table] == list(range(count))
    for row in table:
        assert row["error"] is None, row["error"]
        assert len(row["responses"]) == n and row["completion_tokens"] == [LONG["max_tokens"]] * n
    return table


def test_job_completes_when_a_replica_is_killed_mid_batch(tiny_model, tmp_path):
    count = 48
    config = convert.structure({"input": write_prompts(tmp_path / "in.parquet", count),
                                "output": str(tmp_path / "out.parquet"), "backend": "hf",
                                "model": str(tiny_model), "sampling": LONG, "chunk_size": 4},
                               GenerateConfig)

    async def main():
        sampler = await asyncio.to_thread(
            ServedRollout.open, backend="hf", model=str(tiny_model),
            options={"batch_size": 4}, replicas=2, limits=Limits(max_running=4, max_waiting=None))
        pool = sampler.service
        try:
            job = asyncio.ensure_future(GenerateJob(config).run(sampler, progress=False,
                                                                in_flight=16))
            victim = pool.replicas[0]
            deadline = time.monotonic() + 120
            while victim.in_flight == 0 and not job.done() and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert victim.in_flight > 0 and not job.done()
            os.killpg(victim.process.proc.pid, signal.SIGKILL)
            stats = await asyncio.wait_for(job, 300)
            health = await asyncio.to_thread(sampler.health)
            return stats, health
        finally:
            await asyncio.to_thread(sampler.close)

    stats, health = asyncio.run(main())
    assert stats["errors"] == 0 and stats["samples"] == count
    assert health["healthy"] == 1 and not health["replicas"][0]["healthy"]
    check_complete(tmp_path / "out.parquet", count)


def test_killed_job_with_replicas_reruns_to_exact_counts(tiny_model, tmp_path):
    count = 40
    out = tmp_path / "out.parquet"
    args = ["generate", "--backend", "hf", "--model", tiny_model,
            "--input", write_prompts(tmp_path / "in.parquet", count), "--output", out,
            "--replicas", 2, "--chunk-size", 2, "--in-flight", 4, "--n", 2,
            "--max-tokens", LONG["max_tokens"], "--temperature", 0.7, "--seed", 3,
            "--quiet", "-o", "batch_size=2"]
    config = tmp_path / "job.yaml"  # the CLI has no flag for ignore_eos
    config.write_text("sampling: {ignore_eos: true}\n")
    command = [sys.executable, "-m", "rollout", *map(str, args), "--config", str(config)]
    log = tmp_path / "job.log"
    with open(log, "wb") as sink:
        job = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT)
    parts = Path(str(out) + ".parts")

    def two_parts_written():
        assert job.poll() is None, f"the job ended early:\n{log.read_text()[-3000:]}"
        return len(list(parts.glob("part-*.parquet"))) >= 2

    wait_for(two_parts_written, 300, "the job's first two parts", interval=0.05)
    replicas = replicas_of(job.pid)
    assert len(replicas) == 2, log.read_text()[-3000:]
    os.kill(job.pid, signal.SIGKILL)
    job.wait(30)
    done_before = len(list(parts.glob("part-*.parquet")))
    assert 2 <= done_before < count // 2 and not out.exists()
    deadline = time.monotonic() + 60  # the replicas notice their parent is gone
    while any(_alive(p) for p in replicas) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(p) for p in replicas), "replicas outlived their job"

    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    stats = json.loads(result.stderr.strip().splitlines()[-1])
    assert stats["samples"] == 2 * (count - 2 * done_before)  # finished chunks were kept
    assert stats["latency_s"]["p50"] > 0 and stats["errors_by_kind"] == {}
    check_complete(out, count, n=2)
    summary = json.loads(out.with_suffix(".summary.json").read_text())
    assert summary["prompts"] == count and summary["latency_s"]["p99"] >= summary["latency_s"]["p50"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat").read_text().split()[2] if Path(f"/proc/{pid}").exists() else "X"
    return state != "Z"


@pytest.mark.parametrize("mode, replicas, placement, server, expected", [
    (None, None, "local", None, "hybrid"),
    (None, 2, "local", None, "colocated"),
    (None, 2, "ray", None, "standalone"),
    (None, None, "local", "http://h:1", "standalone"),
    ("standalone", 2, "local", None, "standalone"),
    ("colocated", None, "local", None, "colocated"),
    ("hybrid", 2, "local", None, "mode"),
    ("colocated", 2, "ray", None, "mode"),
    ("serverless", None, "local", None, "mode"),
])
def test_deployment_modes(mode, replicas, placement, server, expected):
    if expected == "mode":
        with pytest.raises(InvalidRequestError) as error:
            resolve_mode(mode, replicas, placement, server)
        assert error.value.field == "mode"
    else:
        assert resolve_mode(mode, replicas, placement, server) == expected


def test_a_session_stays_on_one_replica_and_moves_when_it_dies(tiny_model):
    from rollout import Request, SamplingParams

    def request(session):
        return Request(prompt="the ka", sampling=SamplingParams(max_tokens=4),
                       session_id=session)

    async def main():
        pool = await start_replicas("hf", str(tiny_model), {}, 2)
        served = []  # (session, replica) of every request sent
        for replica in pool.replicas:
            async def record(r, send=replica.service.generate, replica=replica):
                served.append((r.session_id, replica))
                return await send(r)

            replica.service.generate = record
        try:
            for _ in range(4):
                done = await asyncio.gather(*(pool.generate(request(s)) for s in "ab"),
                                            pool.generate(request(None)))
                assert all(c.ok for c in done)
            homes = {s: {r for t, r in served if t == s} for s in "ab"}
            victim = pool.replicas[0]
            os.killpg(victim.process.proc.pid, signal.SIGKILL)
            served.clear()
            after = [await pool.generate(request("a")) for _ in range(3)]
            return homes, victim, served, after
        finally:
            await pool.close()

    homes, victim, served, after = asyncio.run(main())
    assert all(len(replicas) == 1 for replicas in homes.values()), homes
    assert homes["a"] != homes["b"], "least-in-flight put both new sessions on one replica"
    assert all(c.ok for c in after)
    assert served[-2:] == [("a", r) for _, r in served[-2:]] and victim not in {
        r for _, r in served[-2:]}


def test_streams_through_the_pool_come_token_by_token_and_follow_their_session(tiny_model):
    from rollout import Request, SamplingParams

    def request(session, max_tokens=48):
        return Request(prompt="the ka lo", session_id=session, sampling=SamplingParams(
            max_tokens=max_tokens, temperature=0.0, ignore_eos=True))

    async def stream(pool, r):
        s = pool.stream(r)
        return [chunk async for chunk in s], s.completion

    async def main():
        pool = await start_replicas("hf", str(tiny_model), {}, 2)
        try:
            chunks, completion = await stream(pool, request("a"))
            pinned = pool._sessions["a"]
            # Closing a stream early stops it and frees its replica's slot.
            early = pool.stream(request("a", max_tokens=200))
            async for _ in early:
                break
            await early.aclose()
            in_flight = [r.in_flight for r in pool.replicas]
            # Its replica dies: the session's next stream goes to the other one.
            os.killpg(pinned.process.proc.pid, signal.SIGKILL)
            moved_chunks, moved = await stream(pool, request("a"))
            return chunks, completion, pinned, in_flight, moved_chunks, moved, \
                pool._sessions["a"]
        finally:
            await pool.close()

    chunks, completion, pinned, in_flight, moved_chunks, moved, new_home = \
        asyncio.run(main())
    sample = completion.unwrap()[0]
    # Tokens made while the replica's loop was busy come merged into one chunk (the HF
    # backend takes all it finds), so how many chunks depends on timing; the first comes
    # well before the end of 48 tokens.
    assert len(chunks) >= 2 and tuple(t for c in chunks for t in c.token_ids) == sample.token_ids
    assert in_flight == [0, 0]
    assert new_home is not pinned and moved.unwrap()[0].token_ids == sample.token_ids
    assert tuple(t for c in moved_chunks for t in c.token_ids) == sample.token_ids


def test_every_replica_down_at_once_a_request_waits_for_their_restart(tiny_model,
                                                                        monkeypatch):
    """Both replicas killed together: a request sent then waits (bounded) for a restarted
    one instead of failing with NoReplicaError, so a run rides over it. Each replica, and
    its restart, keeps to its own share of the cores (as a vLLM or SGLang replica would:
    the HF backend's are held to shares here)."""
    from rollout import Request, SamplingParams
    from rollout.service import replicas

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # the user's choice turns it off
    monkeypatch.setattr(replicas, "BINDS_THREADS", ("hf",))
    request = Request(prompt="the ka", sampling=SamplingParams(max_tokens=4))
    cores = sorted(os.sched_getaffinity(0))

    def shares(pool):
        return [sorted(os.sched_getaffinity(r.process.proc.pid)) for r in pool.replicas]

    async def main():
        pool = await start_replicas("hf", str(tiny_model), {}, 2)
        try:
            assert (await pool.generate(request)).ok
            first = {r.process.proc.pid for r in pool.replicas}
            before = shares(pool)
            for replica in pool.replicas:
                os.killpg(replica.process.proc.pid, signal.SIGKILL)
                await asyncio.to_thread(replica.process.proc.wait)
            after = await pool.generate(request)
            await asyncio.to_thread(wait_for, lambda: all(r.healthy for r in pool.replicas),
                                    120, "both replicas back")
            return first, after, {r.process.proc.pid for r in pool.replicas if r.healthy}, \
                before, shares(pool)
        finally:
            await pool.close()

    first, after, serving, before, restarted = asyncio.run(main())
    assert after.ok, after.error
    assert serving and not serving & first  # served by a restarted process
    each = max(1, len(cores) // 2)
    assert all(len(share) == each for share in before)
    if len(cores) >= 2:
        assert not set(before[0]) & set(before[1])
    assert restarted == before


def test_each_replica_gets_an_equal_share_of_the_cores():
    """An equal share each (round robin when there are more replicas than cores); None
    for each where the user chose the threads."""
    from rollout.service.replicas import cpu_shares

    cores = sorted(os.sched_getaffinity(0))
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("OMP_NUM_THREADS", raising=False)
        shares = cpu_shares(3)
        assert len(shares) == 3 and all(share and set(share) <= set(cores) for share in shares)
        if len(cores) >= 3:
            assert not set(shares[0]) & set(shares[1])
        assert [len(share) for share in cpu_shares(2)] == [max(1, len(cores) // 2)] * 2
        patch.setenv("OMP_NUM_THREADS", "1")
        assert cpu_shares(2) == [None, None]


def test_hf_replicas_run_as_many_threads_as_their_share_and_float(tiny_model, monkeypatch):
    """Two HF replicas with every core each answered half the requests a second of one
    thread each (issue 50): each gets OMP_NUM_THREADS of its share. Transformers does not
    bind its threads, so they are not kept to their cores: a core the other replica
    leaves idle is used."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = sorted(os.sched_getaffinity(0))

    async def main():
        pool = await start_replicas("hf", str(tiny_model), {}, 2)
        try:
            return [(environ_of(r.process.proc.pid).get("OMP_NUM_THREADS"),
                     sorted(os.sched_getaffinity(r.process.proc.pid))) for r in pool.replicas]
        finally:
            await pool.close()

    share = str(max(1, len(cores) // 2))
    assert asyncio.run(main()) == [(share, cores), (share, cores)]


def environ_of(pid: int) -> dict[str, str]:
    pairs = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(p.decode().split("=", 1) for p in pairs if b"=" in p)
