"""Starting replicas: each one is a `rollout serve` process with the backend in it, reached
over loopback HTTP with a key of the pool's own (other local users cannot call it). The
local default starts them as child processes; with Ray (`placement="ray"`) each is started
by an actor that a placement group spreads over the cluster's nodes.

A replica watches the process that started it and exits when that one is gone, so a batch
job killed with SIGKILL leaves no replica behind.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import sys
from collections.abc import Mapping

from rollout.contract.errors import InvalidRequestError
from rollout.kit.process import HOST, ServerProcess, free_port
from rollout.apps.serving.client import RemoteService
from rollout.apps.serving.pool import Replica, ReplicaPool

PLACEMENTS = ("local", "ray")
KEY_VARIABLE = "ROLLOUT_API_KEY"


def replica_argv(backend: str, model: str, options: Mapping, host: str, port: int) -> list[str]:
    argv = [sys.executable, "-m", "rollout", "serve", "--backend", backend, "--model", model,
            "--host", host, "--port", str(port), "--replicas", "1",
            "--watch-parent", str(os.getpid())]
    for key, value in options.items():
        argv += ["-o", f"{key}={json.dumps(value)}"]
    return argv


async def start_replicas(backend: str, model: str, options: Mapping, count: int,
                         placement: str = "local", startup_timeout: float = 900.0,
                         request_timeout: float = 3600.0, max_in_flight: int = 64,
                         ray_address: str | None = None, restarts: int = 3,
                         keep_weights: bool = True) -> ReplicaPool:
    if placement not in PLACEMENTS:
        raise InvalidRequestError("placement", f"got {placement!r}", ", ".join(PLACEMENTS))
    if not isinstance(count, int) or count < 1:
        raise InvalidRequestError("replicas", f"got {count!r}", "an integer >= 1")
    key = secrets.token_urlsafe(24)
    if placement == "ray":
        started = await asyncio.to_thread(_start_on_ray, backend, model, options, count, key,
                                          startup_timeout, ray_address)
    else:
        env = {KEY_VARIABLE: key, **_thread_share(count)}
        started = await asyncio.gather(*(asyncio.to_thread(
            _start_local, f"replica-{i}", backend, model, options, env, startup_timeout)
            for i in range(count)), return_exceptions=True)
        failed = [s for s in started if isinstance(s, BaseException)]
        if failed:
            for s in started:
                if not isinstance(s, BaseException):
                    await asyncio.to_thread(s[1].stop)
            raise failed[0]
    restart = {}
    if placement == "local":  # Ray restarts its actors by its own rules
        restart = {i: _restarter(f"replica-{i}", backend, model, options, env, startup_timeout,
                                 request_timeout) for i in range(count)}
    replicas = [Replica(RemoteService(url, key, request_timeout), process, restart.get(i),
                        restarts) for i, (url, process) in enumerate(started)]
    # Kept weights bring a restarted replica to the pool's version (one copy of the model
    # in this process); without them it waits, serving nothing, for the next update.
    return await ReplicaPool(replicas, name=model, max_in_flight=max_in_flight,
                             keep_weights=keep_weights and bool(restart) and restarts > 0
                             ).start()


def _restarter(name: str, backend: str, model: str, options: Mapping, env: dict,
               startup_timeout: float, request_timeout: float):
    async def restart() -> tuple[RemoteService, ServerProcess]:
        url, process = await asyncio.to_thread(_start_local, name, backend, model, options,
                                               env, startup_timeout)
        return RemoteService(url, env[KEY_VARIABLE], request_timeout), process
    return restart


def _thread_share(count: int) -> dict[str, str]:
    """Replicas on one machine split its cores: each with every core, their OpenMP threads
    fight over them and all of them slow down many times over."""
    if "OMP_NUM_THREADS" in os.environ:
        return {}
    return {"OMP_NUM_THREADS": str(max(1, len(os.sched_getaffinity(0)) // count))}


def _start_local(name: str, backend: str, model: str, options: Mapping, env: dict,
                 timeout: float) -> tuple[str, ServerProcess]:
    port = free_port()
    process = ServerProcess(name, replica_argv(backend, model, options, HOST, port), env=env)
    url = f"http://{HOST}:{port}"
    process.wait_healthy(f"{url}/health", timeout,
                         {"Authorization": f"Bearer {env[KEY_VARIABLE]}"})
    return url, process


# --- Ray ------------------------------------------------------------------------------

class ReplicaHost:
    """A Ray actor that starts one replica on its node and owns its process."""

    def start(self, backend: str, model: str, options: dict, key: str, timeout: float) -> str:
        import ray

        host = ray.util.get_node_ip_address()
        port = free_port()
        self.process = ServerProcess("replica", replica_argv(backend, model, options, host, port),
                                     env={KEY_VARIABLE: key})
        url = f"http://{host}:{port}"
        self.process.wait_healthy(f"{url}/health", timeout, {"Authorization": f"Bearer {key}"})
        return url

    def alive(self) -> bool:
        return self.process.alive()

    def stop(self) -> None:
        self.process.stop()


class RayReplicaProcess:
    def __init__(self, actor):
        self.actor = actor

    def alive(self) -> bool:
        import ray

        try:
            return ray.get(self.actor.alive.remote(), timeout=10)
        except Exception:  # noqa: BLE001 - an actor that cannot answer counts as dead
            return False

    def stop(self) -> None:
        import ray

        try:
            ray.get(self.actor.stop.remote(), timeout=60)
        finally:
            ray.kill(self.actor)


def _start_on_ray(backend: str, model: str, options: Mapping, count: int, key: str,
                  timeout: float, address: str | None) -> list[tuple[str, RayReplicaProcess]]:
    try:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    except ImportError:
        raise InvalidRequestError("placement", "Ray is not installed",
                                  'local, or pip install "rollout-core[ray]"') from None
    if not ray.is_initialized():
        ray.init(address=address, ignore_reinit_error=True, log_to_driver=False)
    # One bundle per replica, spread over the nodes where the cluster allows it.
    group = placement_group([{"CPU": 1}] * count, strategy="SPREAD")
    ray.get(group.ready(), timeout=timeout)
    host_cls = ray.remote(num_cpus=1)(ReplicaHost)
    actors = [host_cls.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
        placement_group=group, placement_group_bundle_index=i)).remote() for i in range(count)]
    urls = ray.get([a.start.remote(backend, model, dict(options), key, timeout) for a in actors],
                   timeout=timeout + 60)
    return [(url, RayReplicaProcess(actor)) for url, actor in zip(urls, actors)]
