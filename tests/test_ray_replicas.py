"""Replicas placed by Ray, on a local Ray cluster started by the test: each replica is a
`rollout serve` process started by an actor in a placement-group bundle."""

import asyncio

import pytest

ray = pytest.importorskip("ray", reason='Ray is not installed (pip install "rollout-core[ray]")')

from rollout.contract import convert  # noqa: E402
from rollout.contract.schemas import Request  # noqa: E402
from rollout.service.replicas import RayReplicaProcess, start_replicas  # noqa: E402
from rollout.testing.fixtures import LOOPBACK, check_ray_on_loopback  # noqa: E402


@pytest.fixture(scope="module")
def local_ray():
    # On loopback (rollout.testing.fixtures), so the replicas serve there too.
    # A cluster of its own ("local"), not one another test started on this machine.
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
             _node_ip_address=LOOPBACK)
    check_ray_on_loopback()
    yield
    ray.shutdown()


def test_replicas_placed_by_ray_serve_and_stop(tiny_model, local_ray):
    async def main():
        pool = await start_replicas("hf", str(tiny_model), {}, 2, placement="ray")
        try:
            requests = [convert.structure({"id": f"r{i}", "prompt": f"the ka {i}", "sampling":
                                           {"max_tokens": 4, "temperature": 0.0}}, Request)
                        for i in range(8)]
            completions = await asyncio.gather(*(pool.generate(r) for r in requests))
            return pool, completions, await pool.health()
        finally:
            await pool.close()

    pool, completions, health = asyncio.run(main())
    assert [c.request_id for c in completions] == [f"r{i}" for i in range(8)]
    assert all(c.ok and c.results[0].completion_tokens == 4 for c in completions)
    assert health["healthy"] == 2
    assert all(isinstance(r.process, RayReplicaProcess) for r in pool.replicas)
    # Each replica ran in an actor of the placement group, and is gone after close().
    assert not any(r.process.alive() for r in pool.replicas)


def test_a_ray_replica_gets_as_many_threads_as_its_bundle_has_cpus(monkeypatch):
    """Replicas on one node would otherwise each take every core's worth of threads."""
    from rollout.service.ray_placement import RayPlacement
    from rollout.service.replicas import RayReplicas

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    replicas = RayReplicas("hf", "m", {}, "key", RayPlacement(cpus=3), 60, 60)
    assert replicas._env(0)["OMP_NUM_THREADS"] == "3"
    assert RayReplicas("hf", "m", {}, "key", RayPlacement(cpus=0.5, gpus=1), 60, 60
                       )._env(1)["OMP_NUM_THREADS"] == "1"
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the user's choice
    assert replicas._env(0)["OMP_NUM_THREADS"] == "2"
