"""Starting replicas: each one is a `rollout serve` process with the backend in it, reached
over loopback HTTP with a key of the pool's own (other local users cannot call it). The
local default starts them as child processes; with Ray (`placement="ray"`) each is started
by an actor in a placement group's bundle (rollout.service.ray_placement). Either
way the pool restarts a replica that died, by its own rules.

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
from rollout.kit.logs import REPLICA_VARIABLE, log_settings
from rollout.kit.process import HOST, ServerProcess, free_port
from rollout.weights.transports.nodes import NODE_VARIABLE, this_node
from rollout.service.client import RemoteService
from rollout.service.pool import ReplicaPool
from rollout.service.replica import Replica
from rollout.service.ray_placement import RayPlacement, placement_group

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
                         ray: RayPlacement | dict | None = None, restarts: int = 3,
                         keep_weights: bool = True, max_waiting: int | None = None
                         ) -> ReplicaPool:
    if placement not in PLACEMENTS:
        raise InvalidRequestError("placement", f"got {placement!r}", ", ".join(PLACEMENTS))
    if not isinstance(count, int) or count < 1:
        raise InvalidRequestError("replicas", f"got {count!r}", "an integer >= 1")
    key = secrets.token_urlsafe(24)
    on_close = None
    if placement == "ray":
        on_ray = RayReplicas(backend, model, options, key, RayPlacement.of(ray),
                             startup_timeout, request_timeout)
        started = await asyncio.to_thread(on_ray.start_all, count)
        restart = {i: on_ray.restarter(i) for i in range(count)}
        on_close = on_ray.close
    else:
        env = {KEY_VARIABLE: key, NODE_VARIABLE: this_node()}
        shares = cpu_shares(count)
        started = await asyncio.gather(*(asyncio.to_thread(
            _start_local, f"replica-{i}", backend, model, options, env, startup_timeout,
            shares[i]) for i in range(count)), return_exceptions=True)
        failed = [s for s in started if isinstance(s, BaseException)]
        if failed:
            for s in started:
                if not isinstance(s, BaseException):
                    await asyncio.to_thread(s[1].stop)
            raise failed[0]
        restart = {i: _restarter(f"replica-{i}", backend, model, options, env, startup_timeout,
                                 request_timeout, shares[i]) for i in range(count)}
    replicas = [Replica(RemoteService(url, key, request_timeout), process, restart.get(i),
                        restarts) for i, (url, process) in enumerate(started)]
    # Kept weights bring a restarted replica to the pool's version (one copy of the model
    # in this process); without them it waits, serving nothing, for the next update.
    return await ReplicaPool(replicas, name=model, max_in_flight=max_in_flight,
                             keep_weights=keep_weights and bool(restart) and restarts > 0,
                             on_close=on_close, max_waiting=max_waiting).start()


def _restarter(name: str, backend: str, model: str, options: Mapping, env: dict,
               startup_timeout: float, request_timeout: float, share: list[int] | None):
    async def restart() -> tuple[RemoteService, ServerProcess]:
        url, process = await asyncio.to_thread(_start_local, name, backend, model, options,
                                               env, startup_timeout, share)
        return RemoteService(url, env[KEY_VARIABLE], request_timeout), process
    return restart


# Engines that bind their OpenMP threads to every core their process may use: each replica
# is also kept to its share of the cores (its affinity), or their threads would stack up.
BINDS_THREADS = ("vllm", "sglang")


def cpu_shares(count: int) -> list[list[int] | None]:
    """Each local replica's share of the cores this process may use: an equal one, as many
    OpenMP threads as it has cores (one each, shared round robin, when there are more
    replicas than cores). With every core each, replicas that are busy at once run more
    threads than there are cores, and each parallel step waits on threads the others hold
    off their cores: two HF replicas on two cores answered about half as many requests a
    second as with one thread each (issue 50, docs/serve-profile.md). None for each where
    the user chose the threads (OMP_NUM_THREADS set)."""
    if "OMP_NUM_THREADS" in os.environ:
        return [None] * count
    cores = sorted(os.sched_getaffinity(0))
    each = max(1, len(cores) // count)
    return [[cores[(i * each + j) % len(cores)] for j in range(each)] for i in range(count)]


def _start_local(name: str, backend: str, model: str, options: Mapping, env: dict,
                 timeout: float, share: list[int] | None = None) -> tuple[str, ServerProcess]:
    """A replica with as many threads as its `share` has cores, kept to them where its
    engine binds its threads (transformers' float: a core another replica leaves idle
    is used)."""
    port = free_port()
    threads = {"OMP_NUM_THREADS": str(len(share))} if share else {}
    process = ServerProcess(name, replica_argv(backend, model, options, HOST, port),
                            env={**env, **threads, REPLICA_VARIABLE: name},
                            cpus=share if backend in BINDS_THREADS else None,
                            keep_log=True)  # its request lines, for operators
    url = f"http://{HOST}:{port}"
    process.wait_healthy(f"{url}/health", timeout,
                         {"Authorization": f"Bearer {env[KEY_VARIABLE]}"})
    return url, process


# --- Ray ------------------------------------------------------------------------------

def node_address() -> str:
    """In a Ray worker, the address its node is known by in the cluster: the one the node
    was started with (`ray start --node-ip-address`) or that Ray chose for it, not one looked
    up apart from Ray. A replica binds and advertises it, so the driver and other nodes
    reach it there, and on a cluster started on 127.0.0.1 (the tests') it stays on loopback."""
    import ray

    # In a worker this is its node's own address, as registered with the cluster (Ray
    # looks an address up only in a process that is not connected to a node).
    return ray.util.get_node_ip_address()


class ReplicaHost:
    """A Ray actor that starts one replica on its node and owns its process."""

    def start(self, backend: str, model: str, options: dict, key: str, timeout: float,
              env: dict | None = None) -> str:
        host = node_address()
        port = free_port()
        self.process = ServerProcess("replica", replica_argv(backend, model, options, host, port),
                                     env={KEY_VARIABLE: key, NODE_VARIABLE: this_node(),
                                          **(env or {})}, keep_log=True)
        url = f"http://{host}:{port}"
        self.process.wait_healthy(f"{url}/health", timeout, {"Authorization": f"Bearer {key}"})
        return url

    def alive(self) -> bool:
        return self.process.alive()

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

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
        except ray.exceptions.RayActorError:
            pass  # it died, with its node or its process: its replica is gone too
        finally:
            ray.kill(self.actor)


class RayReplicas:
    """Replicas in the bundles of one placement group. A replica whose actor or node died
    is started again in its bundle, which Ray moves to a live node when its own is gone."""

    def __init__(self, backend: str, model: str, options: Mapping, key: str,
                 placement: RayPlacement, startup_timeout: float, request_timeout: float):
        self.args = (backend, model, dict(options), key, startup_timeout)
        self.placement = placement
        self.request_timeout = request_timeout
        self.group = None

    def start_all(self, count: int) -> list[tuple[str, RayReplicaProcess]]:
        try:
            import ray
        except ImportError:
            raise InvalidRequestError("placement", "Ray is not installed",
                                      'local, or pip install "rollout-core[ray]"') from None
        if not ray.is_initialized():
            ray.init(address=self.placement.address, ignore_reinit_error=True,
                     log_to_driver=False)
        self.group = placement_group(self.placement, count)
        hosts = [self._host(i) for i in range(count)]
        timeout = self.args[-1] + self.placement.ready_timeout
        try:
            urls = ray.get([h.start.remote(*self.args, env=self._env(i))
                            for i, h in enumerate(hosts)], timeout=timeout)
        except BaseException:
            for host in hosts:
                ray.kill(host)
            ray.util.remove_placement_group(self.group)
            raise
        return [(url, RayReplicaProcess(h)) for url, h in zip(urls, hosts)]

    def close(self) -> None:
        """Give the placement group's resources back to the cluster."""
        import ray

        if self.group is not None:
            ray.util.remove_placement_group(self.group)
            self.group = None

    def restarter(self, index: int):
        async def restart() -> tuple[RemoteService, RayReplicaProcess]:
            url, process = await asyncio.to_thread(self._start_one, index)
            return RemoteService(url, self.args[3], self.request_timeout), process
        return restart

    def _start_one(self, index: int) -> tuple[str, RayReplicaProcess]:
        import ray

        host = self._host(index)
        try:
            url = ray.get(host.start.remote(*self.args, env=self._env(index)),
                          timeout=self.args[-1] + self.placement.ready_timeout)
        except BaseException:
            ray.kill(host)
            raise
        return url, RayReplicaProcess(host)

    def _env(self, index: int) -> dict:
        """A replica's name in its logs, this process's log settings (an actor's
        environment is its node's, not this process's), and its threads: as many as its
        bundle has CPUs, unless this process's OMP_NUM_THREADS says otherwise."""
        threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, int(self.placement.cpus)))
        return {REPLICA_VARIABLE: f"replica-{index}", "OMP_NUM_THREADS": threads,
                **log_settings()}

    def _host(self, index: int):
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return ray.remote(ReplicaHost).options(
            **self.placement.actor_options(),
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self.group, placement_group_bundle_index=index)).remote()
