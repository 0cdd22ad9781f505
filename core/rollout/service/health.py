"""A replica pool's health monitor. Every `interval` each replica is checked: one whose
process exited is taken out and started again (after a backoff that doubles, at most its
`restarts` times); one whose health check fails HEALTH_STRIKES times in a row is taken out,
and put back once it answers; one behind the pool's weights or adapters is caught up
(`rollout.service.catch_up`)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from rollout.contract.errors import RolloutError, WeightsDirtyError
from rollout.service.replica import MAX_CATCH_UPS, Replica

# The pool this serves (rollout.service.pool.ReplicaPool, which owns it): not imported,
# as the pool imports this module.
Pool = Any

RESTART_BACKOFF_S = 1.0  # before the first restart; doubled before each next one
HEALTH_STRIKES = 2  # failed health checks in a row before a running replica is taken out
log = logging.getLogger("rollout.pool")


class HealthMonitor:
    def __init__(self, pool: Pool, interval: float):
        self.pool = pool
        self.interval = interval

    async def run(self) -> None:
        while True:
            await asyncio.gather(*(self.check(r) for r in self.pool.replicas))
            await asyncio.sleep(self.interval)

    async def check(self, replica: Replica) -> None:
        pool = self.pool
        if replica.recovering is not None:
            return
        if replica.process is not None and not await asyncio.to_thread(replica.process.alive):
            await pool.take_out(replica, "its process exited")
            if replica.restart is not None and replica.restarts_left > 0:
                replica.recovering = asyncio.create_task(self.restart(replica))
            return
        updates = pool.updates_ended
        try:
            state = await replica.service.health()
        except RolloutError as exc:
            replica.dirty = isinstance(exc, WeightsDirtyError)
            replica.failed_checks += 1
            if replica.failed_checks >= HEALTH_STRIKES:
                await pool.take_out(replica, str(exc))
        else:
            replica.failed_checks, replica.dirty = 0, False
            await pool.saw_version(replica, state.get("weight_version"), updates)
            if not replica.healthy:
                await pool.put_back(replica)
            if pool.catch_up.possible(replica):
                replica.recovering = asyncio.create_task(pool.catch_up.run(replica))

    async def restart(self, replica: Replica) -> None:
        """A new process for a dead replica, after a backoff. It loads the checkpoint, so
        once the pool has pushed weights it stays out of rotation until an update or a
        catch-up brings it to the pool's version."""
        context = self.pool.log_context(replica)
        tail = getattr(replica.process, "log_tail", lambda: "")()
        log.warning("replica %s exited; restarting it (%d more times at most). Its log "
                    "ends:\n%s", replica.service.url, replica.restarts_left - 1, tail,
                    extra=context)
        await asyncio.sleep(RESTART_BACKOFF_S * 2 ** replica.restarts)
        replica.restarts += 1
        replica.restarts_left -= 1
        try:
            service, process = await replica.restart()
        except Exception as exc:  # noqa: BLE001 - logged; the next check tries again
            log.warning("restarting replica %s failed: %r", replica.service.url, exc,
                        extra=context)
        else:
            await replica.service.close()
            log.info("replica restarted at %s", service.url, extra=context)
            replica.service, replica.process = service, process
            replica.weight_version, replica.failed_checks = None, 0
            replica.adapters = {}
            replica.catch_ups_left = MAX_CATCH_UPS
            replica.down_reason = "restarted; waiting for its first health check"
        finally:
            replica.recovering = None
