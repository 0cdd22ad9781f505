"""Bringing a replica that came back (a restart loads the checkpoint) to a pool's weights
and adapters, from the copies the pool kept: pushed by shared memory where the replica
runs on this node, else by a gloo group it joins at this host's address towards it."""

from __future__ import annotations

import asyncio
import logging
from typing import Any
from urllib.parse import urlsplit

from rollout.service.replica import MISSING, Replica
from rollout.weights.send import push_weights
from rollout.weights.transports.collective import address_towards
from rollout.weights.update import BUCKET_WAIT_S

# The pool this serves (rollout.service.pool.ReplicaPool, which owns it): not imported,
# as the pool imports this module.
Pool = Any

log = logging.getLogger("rollout.pool")


class CatchUp:
    def __init__(self, pool: Pool):
        self.pool = pool

    def possible(self, replica: Replica) -> bool:
        """A replica behind the pool's weights, which the pool has kept, or without the
        adapters the pool has (and at its weights)."""
        pool = self.pool
        if not replica.healthy or replica.catch_ups_left <= 0:
            return False
        if pool.versioned and replica.weight_version != pool.weight_version:
            return pool.kept is not None and pool.kept.version == pool.weight_version
        return bool(self.missing_adapters(replica))

    def missing_adapters(self, replica: Replica) -> list[str]:
        return [name for name, kept in self.pool.kept_adapters.items()
                if replica.adapters.get(name, MISSING) != kept.version]

    async def run(self, replica: Replica) -> None:
        pool = self.pool
        try:
            await asyncio.wait_for(pool.updating.acquire(), BUCKET_WAIT_S)
        except TimeoutError:  # an update holds it; the next check tries again
            replica.recovering = None
            return
        version, context = pool.weight_version, pool.log_context(replica)
        address = address_towards(urlsplit(replica.service.url).hostname)
        try:
            if self.possible(replica):
                replica.catch_ups_left -= 1
                if pool.versioned and replica.weight_version != version:
                    update = await replica.service.begin_update(version, "wait", BUCKET_WAIT_S)
                    await push_weights(update, list(pool.kept.tensors.items()), address=address)
                    replica.weight_version = version
                    log.info("replica %s brought to weight version %s", replica.service.url,
                             version, extra={**context, "weight_version": version})
                for name in self.missing_adapters(replica):
                    kept = pool.kept_adapters[name]
                    update = await replica.service.begin_update(
                        kept.version, "wait", BUCKET_WAIT_S, {"name": name, "config": kept.config})
                    await push_weights(update, list(kept.tensors.items()), address=address)
                    replica.adapters[name] = kept.version
                    log.info("replica %s given adapter %s", replica.service.url, name,
                             extra=context)
        except Exception as exc:  # noqa: BLE001 - logged; the next check tries again
            log.warning("bringing replica %s to weight version %s failed: %r",
                        replica.service.url, version, exc)
        finally:
            pool.updating.release()
            replica.recovering = None
        await pool.notify()
