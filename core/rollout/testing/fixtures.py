"""Pytest fixtures for backend test suites: `pytest_plugins = ["rollout.testing.fixtures"]`
in a conftest.py gives its tests `tiny_model`, the tiny model folder, built once per run, and `real_model`,
the real model folder (rollout.kit.models).

Loading it also keeps every Ray node, driver and worker the tests start on loopback
(`keep_ray_on_loopback`): tests listen on no address that another machine can reach."""

import os
import sys

import pytest

from rollout.testing.model_folders import tiny_model_dir

LOOPBACK = "127.0.0.1"
# Ray reads this once, when it is imported. "0" (its default on macOS and Windows) makes it
# take 127.0.0.1 as this machine's address. On Linux it takes the address of the route
# outwards, and `ray.init` turns a 127.0.0.1 it is given (the cluster's address, or
# `_node_ip_address`) into that address too, so a driver cannot even join nodes started
# with node_ip_address 127.0.0.1. Ray's in-process multi-node test cluster
# (ray.cluster_utils.Cluster) works with it; only `ray start --address` (a node joining a
# cluster, as from another machine) refuses to run.
RAY_CLUSTERS_VARIABLE = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def keep_ray_on_loopback() -> None:
    """Make the Ray nodes and drivers started from now on, in this process and the ones it
    starts, use 127.0.0.1: a node's servers and its workers' bind there, and a replica that
    a Ray actor starts serves on its node's address (rollout.service.replicas)."""
    os.environ[RAY_CLUSTERS_VARIABLE] = "0"
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None:  # ray was imported before: the variable came too late for it
        constants.ENABLE_RAY_CLUSTER = False


def check_ray_on_loopback() -> None:
    """Raise unless this driver and every live node of its Ray cluster are on loopback (a
    Ray that stopped honouring `keep_ray_on_loopback` fails here, not by listening outwards)."""
    import ray

    addresses = {node["NodeManagerAddress"] for node in ray.nodes() if node["Alive"]}
    addresses.add(ray.util.get_node_ip_address())
    if addresses != {LOOPBACK}:
        raise RuntimeError(f"the test's Ray cluster is not on loopback: {sorted(addresses)}")


# Here, where pytest loads this plugin from a conftest.py before any test module imports ray.
keep_ray_on_loopback()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.getbasetemp() / "rollout-models")


@pytest.fixture(scope="session")
def tiny_moe(tmp_path_factory):
    """A tiny random Qwen3-MoE (8 experts, 2 per token, 2 layers)."""
    from rollout.kit.tiny_model import build_tiny_moe

    return build_tiny_moe(tmp_path_factory.getbasetemp() / "rollout-models" / "moe")


@pytest.fixture(scope="session")
def real_model():
    """SmolLM2-135M-Instruct converted by `rollout model smollm2`, from the cache that
    command keeps (fetched and converted the first time: about a minute)."""
    from rollout.kit.models import ensure

    return ensure("smollm2")
