"""Replicas on a Ray cluster of several nodes (Ray's own multi-node test cluster: a raylet
per node, each with its own resources and node id), HF backend, tiny model: replicas spread
over nodes, a request the cluster cannot hold fails at once naming what is missing, a
replica whose node is removed is restarted by the pool on a live node and brought to the
pool's weights before it serves, and weights go by shared memory only to a replica on the
trainer's own node (by Ray node id), by gloo to the others."""

import logging
import time

import pytest

ray = pytest.importorskip("ray", reason='Ray is not installed (pip install "rollout-core[ray]")')

from ray.cluster_utils import Cluster  # noqa: E402

from rollout import load_backend  # noqa: E402
from rollout.service.ray_placement import RayPlacement, check_fits  # noqa: E402
from rollout.service.served import ServedRollout  # noqa: E402
from rollout.contract.errors import InvalidRequestError  # noqa: E402
from rollout.testing.contract import probe_requests  # noqa: E402
from rollout.testing.fixtures import LOOPBACK, check_ray_on_loopback  # noqa: E402
from rollout.testing.model_folders import load_weights, perturbed_copy  # noqa: E402
from rollout.testing.waiting import wait_for  # noqa: E402

SLOT = {"replica_slot": 1}  # only the worker nodes have it
HEAD = {"head_slot": 1}  # only the head node, where this process runs, has it


@pytest.fixture(scope="module")
def cluster():
    # On loopback (rollout.testing.fixtures): the head, and the nodes added later, which
    # take the driver's address; the replicas serve on their node's.
    cluster = Cluster(initialize_head=True, connect=True,
                      head_node_args={"num_cpus": 1, "resources": dict(HEAD),
                                      "include_dashboard": False, "node_ip_address": LOOPBACK})
    workers = [cluster.add_node(num_cpus=1, resources=dict(SLOT)) for _ in range(3)]
    cluster.wait_for_nodes()
    check_ray_on_loopback()
    yield cluster, workers
    ray.shutdown()
    cluster.shutdown()


def node_of(replica) -> str:
    return ray.get(replica.process.actor.node_id.remote(), timeout=60)


def transports(caplog) -> list[str]:
    """The transport each weight update chose, and the nodes of its receivers."""
    return [r.getMessage() for r in caplog.records if r.name == "rollout.weights"]


def check_balanced_and_pinned(trainer) -> None:
    """Requests go to both nodes' replicas; a session's requests all go to one."""
    replicas = trainer.service.replicas
    served: dict[int, list] = {id(r): [] for r in replicas}
    for replica in replicas:
        async def counting(request, send=replica.service.generate, replica=replica):
            served[id(replica)].append(request.session_id)
            return await send(request)
        replica.service.generate = counting
    try:
        trainer.generate(probe_requests() * 4)
        assert all(served.values())  # least in flight: both took some
        trainer.generate([{**r, "session_id": "s1"} for r in probe_requests() * 4])
        assert [sessions.count("s1") for sessions in served.values()] in ([16, 0], [0, 16])
    finally:
        for replica in replicas:
            del replica.service.generate


def test_what_the_cluster_cannot_hold_fails_at_once_naming_it(cluster, tiny_model):
    # A wait for room far past the bound: checked before anything is placed, not after it.
    started = time.monotonic()
    with pytest.raises(InvalidRequestError, match="GPU: 1") as error:
        ServedRollout.start("hf", str(tiny_model), replicas=1,
                            ray={"gpus": 1, "ready_timeout": 1200})
    assert "no node of the cluster" in str(error.value)
    with pytest.raises(InvalidRequestError, match="STRICT_SPREAD needs 4 nodes"):
        ServedRollout.start("hf", str(tiny_model), replicas=4,
                            ray={"resources": SLOT, "strategy": "STRICT_SPREAD",
                                 "ready_timeout": 1200})
    assert time.monotonic() - started < 120
    with pytest.raises(InvalidRequestError, match="ray.strategy"):
        RayPlacement.of({"strategy": "ANYWHERE"})
    with pytest.raises(InvalidRequestError, match="ray.gpu"):
        RayPlacement.of({"gpu": 1})


def test_capacity_is_counted_per_node():
    nodes = [{"CPU": 2, "GPU": 2}, {"CPU": 2, "GPU": 1}]
    check_fits({"CPU": 1, "GPU": 1}, 3, "SPREAD", nodes)
    with pytest.raises(InvalidRequestError, match="fewer than 4 replica"):
        check_fits({"CPU": 1, "GPU": 1}, 4, "SPREAD", nodes)
    with pytest.raises(InvalidRequestError, match="STRICT_PACK"):
        check_fits({"CPU": 1, "GPU": 1}, 3, "STRICT_PACK", nodes)


def test_a_replica_whose_node_is_removed_restarts_on_a_live_node_at_the_pool_version(
        cluster, tiny_model, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="rollout.weights")
    cluster, workers = cluster
    other = perturbed_copy(tiny_model, tmp_path / "other")
    with load_backend("hf", str(other)) as engine:
        fresh = [c.unwrap()[0].token_ids for c in engine.generate(probe_requests())]
    many = probe_requests() * 4  # enough to reach both replicas

    with ServedRollout.start("hf", str(tiny_model), replicas=2,
                             ray={"resources": SLOT, "strategy": "STRICT_SPREAD"}) as trainer:
        replicas = trainer.service.replicas
        placed = [node_of(r) for r in replicas]
        assert len(set(placed)) == 2  # one replica per node
        trainer.update_weights(load_weights(other).items(), version=1)
        [pushed] = transports(caplog)  # to replicas on other nodes: a gloo group
        assert pushed.startswith("weights go by gloo to 3 receivers")  # and the pool's copy
        assert all(f"ray:{node}" in pushed for node in placed)
        check_balanced_and_pinned(trainer)

        victim = replicas[0]
        old_url = victim.service.url
        cluster.remove_node(next(w for w in workers if w.node_id == placed[0]))
        wait_for(lambda: victim.service.url != old_url, 300,
                 "the pool to restart the replica of the removed node")
        spare = node_of(victim)
        assert spare not in placed
        wait_for(lambda: all(r["healthy"] and "behind" not in r and r.get("weight_version") == 1
                             for r in trainer.health()["replicas"]), 120,
                 "the restarted replica to be brought to version 1")
        assert transports(caplog)[1:] == [  # brought there across nodes by gloo too
            f"weights go by gloo to 1 receivers on nodes ray:{spare}"]
        for completion, expected in zip(trainer.generate(many), fresh * 4):
            [result] = completion.unwrap()
            assert result.weight_version == 1 and result.token_ids == expected
    # Closed, the pool gave its placement group back: every live node's slot is free.
    live = sum(1 for n in ray.nodes() if n["Alive"] and "replica_slot" in n["Resources"])
    wait_for(lambda: ray.available_resources().get("replica_slot") == live, 60,
             "the placement group's resources to be given back")


def test_weights_go_by_shared_memory_to_a_replica_on_this_node(cluster, tiny_model, tmp_path,
                                                              caplog):
    caplog.set_level(logging.INFO, logger="rollout.weights")
    other = perturbed_copy(tiny_model, tmp_path / "other")
    with load_backend("hf", str(other)) as engine:
        fresh = [c.unwrap()[0].token_ids for c in engine.generate(probe_requests())]
    with ServedRollout.start("hf", str(tiny_model), replicas=1, keep_weights=False,
                             ray={"resources": HEAD}) as trainer:
        here = ray.get_runtime_context().get_node_id()
        assert node_of(trainer.service.replicas[0]) == here
        trainer.update_weights(load_weights(other).items(), version=1)
        assert transports(caplog) == [f"weights go by shm to 1 receivers on nodes ray:{here}"]
        for completion, expected in zip(trainer.generate(probe_requests()), fresh):
            assert completion.unwrap()[0].token_ids == expected


def run_losing_a_node(cluster, tiny_model, job) -> dict:
    """`job.run(sampler)` over two HF replicas on two nodes, with the node of one removed
    while that replica has requests in flight (a spare node is added first to take it)."""
    import asyncio

    from rollout.service.admission import Limits

    cluster, workers = cluster
    workers.append(cluster.add_node(num_cpus=1, resources=dict(SLOT)))
    cluster.wait_for_nodes()

    async def main():
        sampler = await asyncio.to_thread(
            ServedRollout.open, backend="hf", model=str(tiny_model),
            options={"batch_size": 4}, replicas=2, placement="ray",
            ray={"resources": SLOT, "strategy": "STRICT_SPREAD"},
            limits=Limits(max_running=4, max_waiting=None))
        try:
            running = asyncio.ensure_future(job(sampler))
            victim = sampler.service.replicas[0]
            deadline = time.monotonic() + 120
            while victim.in_flight == 0 and not running.done() and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert victim.in_flight > 0 and not running.done()
            node = await asyncio.to_thread(node_of, victim)
            await asyncio.to_thread(cluster.remove_node,
                                    next(w for w in workers if w.node_id == node))
            return await asyncio.wait_for(running, 300)
        finally:
            await asyncio.to_thread(sampler.close)

    return asyncio.run(main())


def test_a_batch_job_completes_when_a_node_is_removed_mid_batch(cluster, tiny_model,
                                                                 tmp_path):
    from test_replicas import LONG, check_complete, write_prompts

    from rollout.apps.jobs.config import GenerateConfig
    from rollout.apps.jobs.generate import GenerateJob as Job
    from rollout.contract import convert

    count = 48
    config = convert.structure({"input": write_prompts(tmp_path / "in.parquet", count),
                                "output": str(tmp_path / "out.parquet"), "backend": "hf",
                                "model": str(tiny_model), "sampling": LONG, "chunk_size": 4},
                               GenerateConfig)
    stats = run_losing_a_node(
        cluster, tiny_model, lambda sampler: Job(config).run(sampler, progress=False, in_flight=16))
    assert stats["errors"] == 0 and stats["samples"] == count
    check_complete(tmp_path / "out.parquet", count)  # every row once, none lost


def test_an_agent_run_completes_when_a_node_is_removed_mid_run(cluster, tiny_model, tmp_path):
    """Trajectories whose turn was on the lost node are sent again (a turn that had
    streamed nothing) or end with the engine's death as a typed error; none is lost."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from rollout.apps.jobs.agents import AgentJob
    from rollout.apps.jobs.config import GenerateConfig
    from rollout.contract import convert

    rows = 24
    source = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": [f"what is {i % 10} + 1?" for i in range(rows)],
                             "idx": list(range(rows))}), source)
    config = convert.structure({
        "input": str(source), "output": str(tmp_path / "out.parquet"), "backend": "hf",
        "model": str(tiny_model), "sampling": {"max_tokens": 128, "temperature": 1.0,
                                               "seed": 2},
        "chunk_size": rows, "environment": "rollout.testing.agents:ToolTask",
        "environment_options": {"calls": 2}}, GenerateConfig)
    summary = run_losing_a_node(cluster, tiny_model,
                                lambda sampler: AgentJob(config).run(sampler, progress=False))
    table = pq.read_table(tmp_path / "out.parquet").to_pylist()
    assert [r["idx"] for r in table] == list(range(rows))  # every trajectory once
    assert summary["trajectories"] == rows
    for row in table:
        assert row["end_reason"] in ("done", "error"), row["end_detail"]
        if row["end_reason"] == "error":
            assert row["end_detail"].startswith("engine_dead:"), row["end_detail"]
    assert any(row["end_reason"] == "done" for row in table)
