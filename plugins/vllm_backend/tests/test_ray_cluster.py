"""vLLM replicas on Ray's multi-node test cluster (a raylet per node, each with its own
node id): two replicas on two nodes get their weights by gloo (not on this process's
node), and when one node is removed the pool starts its replica on a spare node and brings
it to the pool's weights by gloo before it serves."""

import logging

import pytest

ray = pytest.importorskip("ray", reason='Ray is not installed (pip install "rollout-core[ray]")')

from conftest import ENGINE  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

import rollout  # noqa: E402
from rollout.service.served import ServedRollout  # noqa: E402
from rollout.testing.contract import probe_requests  # noqa: E402
from rollout.testing.fixtures import LOOPBACK, check_ray_on_loopback  # noqa: E402
from rollout.testing.model_folders import load_weights, perturbed_copy  # noqa: E402
from rollout.testing.waiting import wait_for  # noqa: E402

SLOT = {"replica_slot": 1}  # only the worker nodes have it


def greedy(sampler) -> list:
    return [c.unwrap()[0].token_ids for c in sampler.generate(probe_requests() * 2)]


def test_vllm_replicas_on_two_nodes_survive_a_node_removed(tiny_model, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="rollout.weights")
    other = perturbed_copy(tiny_model, tmp_path / "other")
    with rollout.load_backend("vllm", str(other), **ENGINE) as fresh:
        expected = greedy(fresh)
    # On loopback (rollout.testing.fixtures): the head, and the nodes added later, which
    # take the driver's address; the replicas serve on their node's.
    cluster = Cluster(initialize_head=True, connect=True,
                      head_node_args={"num_cpus": 1, "include_dashboard": False,
                                      "node_ip_address": LOOPBACK})
    try:
        workers = [cluster.add_node(num_cpus=1, resources=dict(SLOT)) for _ in range(3)]
        cluster.wait_for_nodes()
        check_ray_on_loopback()
        with ServedRollout.start("vllm", str(tiny_model), replicas=2, options=ENGINE,
                                 ray={"resources": SLOT, "strategy": "STRICT_SPREAD"}
                                 ) as trainer:
            replicas = trainer.service.replicas
            placed = [ray.get(r.process.actor.node_id.remote(), timeout=60) for r in replicas]
            assert len(set(placed)) == 2
            trainer.update_weights(load_weights(other).items(), version=1)
            assert greedy(trainer) == expected
            pushes = [r.getMessage() for r in caplog.records if r.name == "rollout.weights"]
            assert pushes[0].startswith("weights go by gloo to 3 receivers")

            victim = replicas[0]
            old_url = victim.service.url
            cluster.remove_node(next(w for w in workers if w.node_id == placed[0]))
            wait_for(lambda: victim.service.url != old_url, 600,
                     "the pool to restart the replica of the removed node", interval=0.5)
            wait_for(lambda: all(r["healthy"] and "behind" not in r
                                 and r.get("weight_version") == 1
                                 for r in trainer.health()["replicas"]), 300,
                     "the restarted replica to be brought to version 1", interval=0.5)
            assert ray.get(victim.process.actor.node_id.remote(), timeout=60) not in placed
            served = trainer.generate(probe_requests() * 2)
            assert [c.unwrap()[0].token_ids for c in served] == expected
            assert {r.weight_version for c in served for r in c.unwrap()} == {1}
    finally:
        ray.shutdown()
        cluster.shutdown()
