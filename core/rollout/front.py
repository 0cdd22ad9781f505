"""The request front both samplers share: `generate`, `agenerate`, `stream` and `abort`,
with the registry of running calls (so that an abort finds a call made before it runs),
timeouts and the assembly of a batch's completions in order.

`Rollout` (the backend in this process) and `ServedRollout` (a backend in other
processes) are this front over their own way of running one request: a subclass gives
`_validate` (the Request, or a Completion that carries why it is not one), `_run(flight,
timeout, sink)` (one registered request on `_loop`, its chunks into `sink` when streamed)
and `_stop(flights)` (on `_loop`: stop them where they run), and its `Flight` kind.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from typing import Any

from rollout.contract.errors import RolloutTimeoutError
from rollout.contract.schemas import Chunk, Completion, Request, Result
from rollout.kit.aio import Relay, on_loop


class Flight:
    """One call for one request."""

    __slots__ = ("request", "task", "aborted", "finished")

    def __init__(self, request: Request):
        self.request = request
        self.task: asyncio.Task | None = None  # once it runs on the loop
        self.aborted = False  # by `abort` or its timeout
        self.finished = False  # forgotten: it ran, or will not


class RequestFront:
    flight_type = Flight
    call_timeout: float | None = None  # the longest `generate` waits for its batch

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop  # where requests run
        self._gate = threading.Lock()  # guards the registry: calls register on any thread
        self._flights: dict[str, set[Flight]] = {}  # request id -> its running calls

    def generate(self, requests: Sequence[Request | Mapping],
                 timeout: float | None = None) -> list[Completion]:
        """One Completion per request, in order, every request run as `agenerate` runs it,
        together. A request that is invalid, or fails, carries its error; the rest
        complete. With `timeout`, requests still running then are aborted and return what
        they have."""
        if on_loop(self._loop):
            raise RuntimeError(f"{type(self).__name__}.generate() blocks; on its event loop "
                               "use agenerate()")
        checked = [self._validate(item, i) for i, item in enumerate(requests)]
        flights = [self._register(r) for r in checked if isinstance(r, Request)]

        async def run_all():
            return await asyncio.gather(*(self._run(f, timeout) for f in flights),
                                        return_exceptions=True)

        future = asyncio.run_coroutine_threadsafe(run_all(), self._loop)
        try:
            outputs = iter(future.result(self.call_timeout))
        except BaseException as exc:
            future.cancel()  # (a KeyboardInterrupt) its requests stop where they run too
            if isinstance(exc, TimeoutError):
                raise RolloutTimeoutError(f"generate did not finish within "
                                          f"{self.call_timeout:.0f} s") from None
            raise
        finally:
            for flight in flights:
                self._forget(flight)
        completions = [item if isinstance(item, Completion) else next(outputs)
                       for item in checked]
        for c in completions:
            if isinstance(c, BaseException):
                raise c
        return completions

    async def agenerate(self, request: Request | Mapping,
                        timeout: float | None = None) -> Completion:
        """One request, awaited on any event loop; no thread is taken. The Completion
        carries the request's own error. Cancelling the call stops the request."""
        checked = self._validate(request, 0)
        if isinstance(checked, Completion):
            return checked
        flight = self._register(checked)
        try:
            if on_loop(self._loop):
                return await self._run(flight, timeout)
            return await asyncio.wrap_future(
                asyncio.run_coroutine_threadsafe(self._run(flight, timeout), self._loop))
        finally:
            self._forget(flight)  # (also when cancelled before it ran)

    def stream(self, request: Request | Mapping, timeout: float | None = None) -> Stream:
        """Iterate (`async for`) over the request's `Chunk`s as they are made, each with its
        new text; afterwards `.completion` holds the whole Completion, the same as
        agenerate's. The request's own error is raised from the iteration. Leaving the
        iteration early stops the request."""
        return Stream(self, request, timeout)

    def abort(self, request_ids: Iterable[str] | None = None) -> None:
        """Stop requests (all of this sampler's when None), from any thread; they return
        what they made, with finish reason "abort". A request whose call has been made is
        stopped even if its engine has not seen it yet. Unknown ids are ignored."""
        with self._gate:
            ids = list(self._flights) if request_ids is None else list(request_ids)
            flights = [f for i in ids for f in self._flights.get(i, ())]
            for flight in flights:
                flight.aborted = True
        if flights:
            self._loop.call_soon_threadsafe(self._stop, flights)

    # --- what a subclass gives ----------------------------------------------------------

    def _validate(self, item: Request | Mapping, index: int) -> Request | Completion:
        raise NotImplementedError

    async def _run(self, flight: Flight, timeout: float | None, sink=None) -> Completion:
        raise NotImplementedError

    def _stop(self, flights: list[Flight]) -> None:
        raise NotImplementedError

    # --- the registry -------------------------------------------------------------------

    def _register(self, request: Request) -> Flight:
        """On the caller's thread, before anything runs: an abort from now on finds it."""
        flight = self.flight_type(request)
        with self._gate:
            self._flights.setdefault(request.id, set()).add(flight)
        return flight

    def _forget(self, flight: Flight) -> None:
        flight.finished = True
        with self._gate:
            same = self._flights.get(flight.request.id)
            if same is not None:
                same.discard(flight)
                if not same:
                    del self._flights[flight.request.id]


class Stream:
    """The chunks of one request as they come (see `RequestFront.stream`). `aclose()` (or
    leaving an `async for` over it) stops the request if it still runs."""

    def __init__(self, owner: RequestFront, request: Request | Mapping,
                 timeout: float | None):
        self.completion: Completion | None = None
        self._chunks = self._iterate(owner, request, timeout)

    def __aiter__(self) -> AsyncIterator[Chunk]:
        return self._chunks

    async def aclose(self) -> None:
        await self._chunks.aclose()

    async def _iterate(self, owner: RequestFront, request, timeout) -> AsyncIterator[Chunk]:
        checked = owner._validate(request, 0)
        if isinstance(checked, Completion):
            self.completion = checked
            raise checked.error
        flight = owner._register(checked)
        relay = Relay(owner._loop, lambda sink: owner._run(flight, timeout, sink))
        try:
            async for chunk in relay:
                yield chunk
        finally:
            await relay.aclose()  # the caller left early: the request stops
            owner._forget(flight)  # (also when it was left before it ran)
        self.completion = relay.result
        if self.completion.error is not None:
            raise self.completion.error


def aborted_completion(request: Request) -> Completion:
    """What a request stopped before it made anything returns."""
    return Completion(request.id, tuple(
        Result(request_id=request.id, index=i, token_ids=(), text="", finish_reason="abort",
               prompt_tokens=0) for i in range(request.sampling.n)))


def raw_id(item: Any, index: int) -> str:
    """The id of what may not be a valid request: its own where it has one."""
    rid = item.get("id") if isinstance(item, Mapping) else None
    return rid if isinstance(rid, str) and rid else f"#{index}"
