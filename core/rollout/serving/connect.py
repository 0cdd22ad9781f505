"""One entry point for the three places a job or server can get its samples from."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

from rollout.serving.service import Service


async def connect(backend: str | None = None, model: str | None = None,
                  options: Mapping | None = None, replicas: int | None = None,
                  placement: str = "local", server: str | None = None,
                  api_key: str | None = None) -> Service:
    """A running `rollout serve` at `server`; else `replicas` processes of the backend;
    else the backend in this process."""
    from rollout.serving.pool import Replica, ReplicaPool

    if server:
        from rollout.serving.client import RemoteService

        pool = ReplicaPool([Replica(RemoteService(server, api_key))], name=server)
        return await pool.start()
    if replicas:
        from rollout.serving.replicas import start_replicas

        return await start_replicas(backend, model, dict(options or {}), replicas, placement)
    from rollout.backend import load_backend
    from rollout.serving.service import BackendService

    engine = await asyncio.to_thread(load_backend, backend, model=model, **dict(options or {}))
    return BackendService(engine, name=model)
