"""The lifecycle of one backend: requests running, and the calls that must run alone.

A lifecycle call (release, resume, a weight update, an adapter load) runs while no request
does. Calls are served in order of arrival: each joins a line and runs once it is first
in line and every running request has ended. While any call is in line, no new request
is admitted; what a call does to the requests already running is its `pause`: "wait"
lets them finish, "abort" stops them, "keep" holds them out of the engine until it is
done (the request's owner does that; this module only says so with `holding`), and
"keep_kv" runs beside them: the backend keeps them in its engine, with their KV cache.

A request waits for the calls on the engine's event loop without a thread or polling (an
asyncio event renewed at each change), a call waits on its own thread; every wait is
bounded by `timeout`.

    SERVING --a call arrives--> DRAINING --no request runs--> CHANGING --call ends--> SERVING
    a failed weight update ------------------------------------------------> DIRTY
    a full update ----------------------------------------------------------> SERVING
    release --> RELEASED --resume (by a call, or a request where the backend resumes itself)
    close --> CLOSED;  the engine died --> DEAD  (both final)
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import threading
from collections import deque
from collections.abc import Callable, Iterator

from rollout.contract.errors import (
    BackendReleasedError,
    EngineDeadError,
    RolloutTimeoutError,
    WeightsDirtyError,
)

LIFECYCLE_TIMEOUT_S = 600.0
CLOSE_WAIT_S = 30.0
PAUSES = ("wait", "abort", "keep", "keep_kv")


class State(enum.Enum):
    SERVING = "serving"  # requests are admitted
    DRAINING = "draining"  # a call waits for running requests to end; new ones wait
    CHANGING = "changing"  # a call runs alone
    RELEASED = "released"  # memory is released: a resume comes before any request
    DIRTY = "dirty"  # a weight update failed midway: no request until a full one succeeds
    CLOSED = "closed"
    DEAD = "dead"


class _Call:
    __slots__ = ("pause",)

    def __init__(self, pause: str):
        self.pause = pause


class Lifecycle:
    """`admit` / `leave` around each request's engine work (on `loop`); `call(pause)`
    around each lifecycle call (on any other thread)."""

    def __init__(self, name: str, loop: asyncio.AbstractEventLoop,
                 timeout: float = LIFECYCLE_TIMEOUT_S):
        self.name, self.loop, self.timeout = name, loop, timeout
        self.released: set[str] = set()  # the memory tags released now
        self.dirty: str | None = None  # why the weights may be half-updated
        self._gate = threading.Condition()  # guards everything here
        self._running = 0  # requests admitted and not yet left
        self._line: deque[_Call] = deque()  # calls waiting, in order of arrival
        self._current: _Call | None = None  # the call that runs
        self._closed = False
        self._dead: EngineDeadError | None = None
        self._changed = asyncio.Event()  # set (and renewed) on the loop at each change

    # --- what it is ---------------------------------------------------------------------

    @property
    def state(self) -> State:
        with self._gate:
            if self._dead is not None:
                return State.DEAD
            if self._closed:
                return State.CLOSED
            if self._current is not None:
                return State.CHANGING
            if self._line:
                return State.DRAINING
            if self.dirty is not None:
                return State.DIRTY
            return State.RELEASED if self.released else State.SERVING

    @property
    def running(self) -> int:
        return self._running

    @property
    def busy(self) -> bool:
        """A call runs or waits to."""
        return self._current is not None or bool(self._line)

    @property
    def holding(self) -> bool:
        """A "keep" call waits: a running request that can go on later leaves the engine."""
        return any(c.pause == "keep" for c in tuple(self._line))

    def check(self) -> None:
        """Raise what keeps every request out for good, or until a full weight update."""
        with self._gate:
            self._check_open()
            self._check_clean()

    def _check_clean(self) -> None:
        if self.dirty is not None:
            raise WeightsDirtyError(f"backend {self.name!r}: {self.dirty}")

    def _check_open(self) -> None:
        if self._dead is not None:
            raise self._dead
        self._check_closed()

    def _check_closed(self) -> None:
        if self._closed:
            raise BackendReleasedError(f"backend {self.name!r} is closed")

    # --- requests (on the loop) ---------------------------------------------------------

    async def admit(self, resume: Callable[[], None] | None = None) -> None:
        """Count a request as running once no call runs or waits. Released memory is
        brought back by `resume` (blocking; run on a thread), or refused without one."""
        deadline = self.loop.time() + self.timeout
        while True:
            with self._gate:
                self._check_open()
                waiting = self.busy
                if not waiting:
                    self._check_clean()
                    if not self.released:
                        self._running += 1
                        return
                    if resume is None:
                        raise BackendReleasedError(
                            f"backend {self.name!r}: {', '.join(sorted(self.released))} "
                            "released; call resume() before generate()")
                changed = self._changed  # renewed only on this loop: not before we wait
            if not waiting:
                await asyncio.to_thread(resume)
                continue
            try:
                await asyncio.wait_for(changed.wait(), deadline - self.loop.time())
            except TimeoutError:
                raise RolloutTimeoutError(
                    f"backend {self.name!r}: waited {self.timeout:.0f} s for a weight "
                    "update or release") from None

    def leave(self) -> None:
        with self._gate:
            self._running -= 1
            self._gate.notify_all()

    def die(self, error: EngineDeadError) -> None:
        with self._gate:
            self._dead = error
            self._gate.notify_all()
        self._wake()

    # --- lifecycle calls (on their callers' threads) ------------------------------------

    @contextlib.contextmanager
    def call(self, pause: str = "wait",
             stop_running: Callable[[str], None] | None = None) -> Iterator[None]:
        """Run the body alone, after the calls that came before (and, but for "keep_kv",
        once no request runs). `stop_running(pause)` is called once the call is in line,
        for "abort" and "keep"."""
        me = _Call(pause)
        with self._gate:
            self._check_closed()
            self._line.append(me)
        try:
            if pause in ("abort", "keep") and stop_running is not None:
                stop_running(pause)
            beside = pause == "keep_kv"  # the running requests stay in the engine
            with self._gate:
                if not self._gate.wait_for(lambda: self._closed or (
                        self._line[0] is me and (beside or not self._running)
                        and self._current is None),
                                           timeout=self.timeout):
                    raise RolloutTimeoutError(
                        f"backend {self.name!r}: waited {self.timeout:.0f} s for running "
                        "requests or another lifecycle call")
                self._check_closed()
                self._line.popleft()
                self._current = me
        except BaseException:
            with self._gate:
                if me in self._line:
                    self._line.remove(me)
                self._gate.notify_all()
            self._wake()
            raise
        try:
            yield
        finally:
            with self._gate:
                self._current = None
                self._gate.notify_all()
            self._wake()

    def close(self, stop_all: Callable[[], None]) -> bool:
        """Stop what runs (`stop_all`), wait (bounded) for it to end, then admit nothing
        more. False when it was closed already."""
        with self._gate:
            if self._closed:
                return False
        stop_all()
        with self._gate:
            self._gate.wait_for(lambda: not self._running, timeout=CLOSE_WAIT_S)
            self._closed = True
            self._gate.notify_all()
        self._wake()
        return True

    def _wake(self) -> None:
        """Wake the requests waiting on the loop to look again."""
        try:
            self.loop.call_soon_threadsafe(self._renew)
        except RuntimeError:  # the loop is closed: nothing waits on it
            pass

    def _renew(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()
