"""Which node a process runs on, so that a weight update can choose its transport: shared
memory reaches only the processes that see the same `/dev/shm`.

A process started by Ray is on its Ray node (Ray's test clusters run several nodes on one
host, and a real cluster's nodes share nothing). Elsewhere a node is the running kernel
and the `/dev/shm` mount this process sees: containers on one host share the first, not
always the second. A process that starts a replica hands its node down in
`ROLLOUT_NODE_ID`, so that both sides name the node the same way."""

from __future__ import annotations

import os
import sys
from pathlib import Path

NODE_VARIABLE = "ROLLOUT_NODE_ID"


def this_node() -> str:
    inherited = os.environ.get(NODE_VARIABLE)
    if inherited:
        return inherited
    ray = sys.modules.get("ray")  # never imported here for this: only when in use already
    if ray is not None and ray.is_initialized():
        return "ray:" + ray.get_runtime_context().get_node_id()
    boot = Path("/proc/sys/kernel/random/boot_id")
    kernel = boot.read_text().strip() if boot.exists() else os.uname().nodename
    shm = os.stat("/dev/shm").st_dev if os.path.isdir("/dev/shm") else 0
    return f"host:{kernel}:{shm}"


def same_node(nodes) -> bool:
    """Whether every one of `nodes` is this process's node (an unknown one is not)."""
    nodes = set(nodes)
    return bool(nodes) and nodes == {this_node()}
