"""An update open on a `rollout serve` process, stepped through its weight routes
(`/rollout/weights/group`, `/bucket`, `/end`, `/cancel`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rollout.service.client import RemoteService


class RemoteUpdate:
    """A weight update open on a replica, by the id its server gave it."""

    def __init__(self, service: RemoteService, update_id: str, receivers: int, nodes=()):
        self.service = service
        self.id = update_id
        self.receivers = receivers  # the ranks its server brings to a collective group
        self.nodes = frozenset(nodes)  # none from an older server: not known to be here

    async def join(self, group: dict) -> None:
        await self.service._control("/rollout/weights/group", {"update": self.id, **group})

    async def send(self, message: dict) -> None:
        await self.service._control("/rollout/weights/bucket",
                                    {"update": self.id, "bucket": message})

    async def end(self) -> int | None:
        return (await self.service._control("/rollout/weights/end", {"update": self.id}))[
            "version"]

    async def cancel(self, reason: str) -> None:
        await self.service._control("/rollout/weights/cancel",
                                    {"update": self.id, "reason": reason})
