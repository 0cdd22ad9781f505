"""Admission control: a bound on the requests a server runs at once, and on those that wait
for a turn. Past the second bound a request is refused at once with OverloadedError
(HTTP 429 with Retry-After), so a flood costs a refusal each, not memory without end.

`rollout serve` bounds its backend (`Gate`, here) or, with replicas, each replica's share
and the line in front of them all (`ReplicaPool`). A service made for a job or a trainer
in its own process bounds nothing: its caller already limits what it sends.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import attrs

from rollout.contract.errors import InvalidRequestError, OverloadedError

RETRY_AFTER_S = 1.0  # what a refused client is told to wait before trying again


def _bound(name: str):
    def check(_, __, value):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < (1 if name == "max_running" else 0)):
            raise InvalidRequestError(name, f"got {value!r}",
                                      "an integer >= 1" if name == "max_running"
                                      else "an integer >= 0")
    return check


@attrs.frozen
class Limits:
    """`max_running`: requests a backend runs at once (with replicas: each replica);
    `max_waiting`: requests that wait for a turn before new ones are refused. None: no
    bound."""

    max_running: int | None = attrs.field(default=256, validator=_bound("max_running"))
    max_waiting: int | None = attrs.field(default=1024, validator=_bound("max_waiting"))


UNBOUNDED = Limits(None, None)


def overloaded(waiting: int, limit: int) -> OverloadedError:
    return OverloadedError(f"the server is overloaded: {waiting} requests wait for a turn "
                           f"(at most {limit}); try again after {RETRY_AFTER_S:.0f} s",
                           RETRY_AFTER_S)


class Gate:
    """Turns for requests: `limits.max_running` at once; the rest wait in line, at most
    `limits.max_waiting` of them."""

    def __init__(self, limits: Limits = UNBOUNDED):
        self.limits = limits
        self.running = 0
        self.waiting = 0
        self._turns: asyncio.Semaphore | None = None  # made on the loop that serves

    @asynccontextmanager
    async def turn(self) -> AsyncIterator[None]:
        """Hold a turn for the request; raises OverloadedError when the line is full."""
        max_running, max_waiting = self.limits.max_running, self.limits.max_waiting
        if max_running is not None:
            if self._turns is None:
                self._turns = asyncio.Semaphore(max_running)
            if self._turns.locked():
                if max_waiting is not None and self.waiting >= max_waiting:
                    raise overloaded(self.waiting, max_waiting)
                self.waiting += 1
                try:
                    await self._turns.acquire()
                finally:
                    self.waiting -= 1
            else:
                await self._turns.acquire()
        self.running += 1
        try:
            yield
        finally:
            self.running -= 1
            if self._turns is not None:
                self._turns.release()
