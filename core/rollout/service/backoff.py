"""Backing off from a server that refuses work because it is overloaded (429): the batch job
and the agent runner call again after growing, jittered delays, for a bounded time."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from rollout.contract.errors import OverloadedError
from rollout.contract.schemas import Completion

T = TypeVar("T")
LONGEST_DELAY_S = 10.0
PATIENCE_S = 900.0  # the longest a call keeps trying before the refusal is its error


async def patiently(call: Callable[[], Awaitable[T]], patience: float = PATIENCE_S,
                    rng: random.Random = random.Random()) -> T:
    """`call()`; while it is refused as overloaded (raised, or as a Completion's error),
    again after the server's Retry-After doubled at each refusal, up to LONGEST_DELAY_S,
    each delay jittered by half (so refused clients do not come back at once). After
    `patience` seconds the last refusal stands."""
    deadline, attempt = time.monotonic() + patience, 0
    while True:
        try:
            result = await call()
        except OverloadedError as exc:
            refusal, result = exc, None
        else:
            if not (isinstance(result, Completion) and isinstance(result.error, OverloadedError)):
                return result
            refusal = result.error
        delay = min(LONGEST_DELAY_S, refusal.retry_after * 2 ** min(attempt, 16))
        delay *= rng.uniform(0.5, 1.0)
        attempt += 1
        if time.monotonic() + delay > deadline:
            if result is None:
                raise refusal
            return result
        await asyncio.sleep(delay)
