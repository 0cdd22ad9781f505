"""An update open on a `rollout serve` process, stepped through its weight routes
(`/rollout/weights/group`, `/bucket`, `/end`, `/cancel`)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

# A server's control route: (path, JSON body) -> its JSON answer, its failure raised typed.
Control = Callable[[str, dict], Awaitable[dict]]


class RemoteUpdate:
    """A weight update open on a server, by the id the server gave it."""

    def __init__(self, control: Control, update_id: str, receivers: int, nodes=()):
        self.control = control
        self.id = update_id
        self.receivers = receivers  # the ranks its server brings to a collective group
        self.nodes = frozenset(nodes)  # none from an older server: not known to be here

    @classmethod
    async def begin(cls, control: Control, version: int | None, pause: str,
                    timeout: float, adapter: dict | None = None) -> RemoteUpdate:
        body = {"version": version, "pause": pause, "timeout": timeout}
        data = await control("/rollout/weights/begin",
                             body if adapter is None else {**body, "adapter": adapter})
        return cls(control, data["update"], data["receivers"], data.get("nodes", ()))

    async def join(self, group: dict) -> None:
        await self.control("/rollout/weights/group", {"update": self.id, **group})

    async def send(self, message: dict) -> None:
        await self.control("/rollout/weights/bucket", {"update": self.id, "bucket": message})

    async def end(self) -> int | None:
        return (await self.control("/rollout/weights/end", {"update": self.id}))["version"]

    async def cancel(self, reason: str) -> None:
        await self.control("/rollout/weights/cancel", {"update": self.id, "reason": reason})
