"""Where a job, a trainer or a server gets its samples from, by deployment mode:

- `hybrid`: the backend in this process (a trainer pushes weights to it in process);
- `colocated`: replica processes on this machine, sharing its devices with the trainer;
- `standalone`: replicas of their own, placed locally or by Ray over a cluster, or a
  running `rollout serve` at a URL.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

from rollout.contract.errors import InvalidRequestError
from rollout.service.admission import UNBOUNDED, Limits
from rollout.service.service import Service

MODES = ("hybrid", "colocated", "standalone")


def resolve_mode(mode: str | None, replicas: int | None, placement: str,
                 server: str | None, ray: Mapping | None = None) -> str:
    """The mode asked for, checked against the other settings, or the one they imply."""
    if ray and placement != "ray":
        raise InvalidRequestError("ray", "Ray settings given without placement ray",
                                  "--placement ray, or no --ray-* settings")
    if mode is None:
        if server or placement == "ray":
            return "standalone"
        return "colocated" if replicas else "hybrid"
    if mode not in MODES:
        raise InvalidRequestError("mode", f"got {mode!r}", ", ".join(MODES))
    if mode == "hybrid" and (server or (replicas or 1) > 1 or placement != "local"):
        raise InvalidRequestError("mode", "hybrid runs the backend in this process",
                                  "no --replicas, --placement or --server with hybrid")
    if mode == "colocated" and (server or placement != "local"):
        raise InvalidRequestError("mode", "colocated replicas run on this machine",
                                  "local placement and no --server with colocated")
    return mode


async def connect(backend: str | None = None, model: str | None = None,
                  options: Mapping | None = None, replicas: int | None = None,
                  placement: str = "local", server: str | None = None,
                  api_key: str | None = None, mode: str | None = None,
                  restarts: int = 3, keep_weights: bool = True,
                  ray: Mapping | None = None, limits: Limits | None = None) -> Service:
    """`ray`: what each replica asks a Ray cluster for and how replicas spread over its
    nodes (rollout.service.ray_placement.RayPlacement's fields), with placement="ray".
    `limits`: admission control, for a server (rollout.service.admission); without
    them nothing is refused and replicas take 64 requests each at once."""
    from rollout.service.pool import ReplicaPool
    from rollout.service.replica import Replica

    mode = resolve_mode(mode, replicas, placement, server, ray)
    if server:
        from rollout.service.client import RemoteService

        pool = ReplicaPool([Replica(RemoteService(server, api_key))], name=server)
        return await pool.start()
    if mode != "hybrid":
        from rollout.service.replicas import start_replicas

        bounds = {} if limits is None else {"max_in_flight": limits.max_running or 2**31,
                                            "max_waiting": limits.max_waiting}
        return await start_replicas(backend, model, dict(options or {}), replicas or 1,
                                    placement, restarts=restarts, keep_weights=keep_weights,
                                    ray=ray, **bounds)
    from rollout.api import load_backend
    from rollout.service.service import LocalService

    rollout = await asyncio.to_thread(load_backend, backend, model=model, **dict(options or {}))
    return LocalService(rollout, name=model, limits=limits or UNBOUNDED)

