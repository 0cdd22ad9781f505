"""The lifecycle state machine (`rollout.lifecycle`) under random interleavings, no engine:
requests on an event loop, lifecycle calls (each pause mode, releases, resumes, adapter
loads, failing and full weight updates) on threads of their own, aborts and request ends in
any order. It checks that a call runs alone (no request admitted, no other call; a
"keep_kv" call beside the requests already running), calls run in the order they came, a
keep call's requests go on after it, the dirty and released rules hold, and every request
and call ends (every wait is bounded)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from rollout.contract.errors import BackendReleasedError, RolloutTimeoutError, \
    WeightsDirtyError
from rollout.lifecycle import Lifecycle, State

ENDS_WITHIN_S = 30.0
WAIT_S = 120.0  # the tests' own waits for what comes by itself
CALL = ("update", "failing update", "release", "resume", "adapter load")


class _Request:
    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.end = asyncio.Event()  # the engine is done with it (set on the loop)
        self.hold = asyncio.Event()  # a keep call took it out of the engine
        self.outcome: str | None = None
        self.admissions = 0
        self.future = None


class LifecycleInterleavings(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.life = Lifecycle("machine", self.loop, timeout=ENDS_WITHIN_S)
        self.auto_resume = True
        self.requests: list[_Request] = []
        self.admitted: set[_Request] = set()  # touched on the loop only
        self.calls: list[threading.Thread] = []
        self.arrived: list[int] = []  # calls in the order they joined the line
        self.entered: list[int] = []  # ... and in the order their bodies ran
        self.inside = 0  # call bodies running now
        self.violations: list[str] = []
        self.lock = threading.Lock()

    # --- requests -------------------------------------------------------------------------

    def _on_loop(self, fn):
        async def run():
            return fn()
        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(ENDS_WITHIN_S)

    async def _run(self, req: _Request) -> None:
        resume = self._resume if self.auto_resume else None
        while True:
            try:
                await self.life.admit(resume)
            except WeightsDirtyError:
                req.outcome = "refused: dirty"
                return
            except BackendReleasedError:
                req.outcome = "refused: released"
                return
            req.admissions += 1
            if self.life.dirty is not None or self.life.released:  # (no call runs now)
                self.violations.append(f"admitted with dirty={self.life.dirty!r} and "
                                       f"released={self.life.released}")
            self.admitted.add(req)
            try:
                ended, held = asyncio.ensure_future(req.end.wait()), \
                    asyncio.ensure_future(req.hold.wait())
                await asyncio.wait([ended, held], return_when=asyncio.FIRST_COMPLETED)
                ended.cancel(), held.cancel()
            finally:
                self.admitted.discard(req)
                self.life.leave()
            if req.end.is_set():
                req.outcome = "done"
                return
            req.hold.clear()  # held by a keep call: it goes on once the call is done

    @rule()
    def start_request(self):
        req = _Request(self.loop)
        req.future = asyncio.run_coroutine_threadsafe(self._run(req), self.loop)
        self.requests.append(req)

    @precondition(lambda self: self.requests)
    @rule(which=st.integers(0, 1000))
    def engine_ends_a_request(self, which):
        req = self.requests[which % len(self.requests)]
        self.loop.call_soon_threadsafe(req.end.set)

    def _stop_running(self, pause: str) -> None:
        def stop():
            for req in list(self.admitted):
                (req.end if pause == "abort" else req.hold).set()
        self.loop.call_soon_threadsafe(stop)

    # --- lifecycle calls ------------------------------------------------------------------

    def _resume(self) -> None:
        with self.life.call():
            self.life.released.clear()

    def _body(self, number: int, kind: str, pause: str) -> None:
        with self.lock:
            self.inside += 1
            self.entered.append(number)
            if self.inside > 1:
                self.violations.append(f"call {number} ran beside another")
        running = self._on_loop(lambda: (len(self.admitted), self.life.running))
        if running != (0, 0) and pause != "keep_kv":
            self.violations.append(f"call {number} ran beside requests {running}")
        if self.life.state is not State.CHANGING:
            self.violations.append(f"call {number} ran in state {self.life.state}")
        time.sleep(0.001)
        with self.lock:
            self.inside -= 1
        if kind == "failing update":
            self.life.dirty = "a weight update failed midway"
            raise RuntimeError("the engine refused a bucket")
        if kind == "update":
            self.life.dirty = None
        elif kind == "release":
            self.life.released.update({"weights", "kv_cache"})
        elif kind == "resume":
            self.life.released.clear()

    @rule(kind=st.sampled_from(CALL),
          pause=st.sampled_from(["wait", "abort", "keep", "keep_kv"]))
    def lifecycle_call(self, kind, pause):
        number = len(self.arrived)
        if kind in ("release", "resume", "adapter load"):
            pause = "abort" if kind == "adapter load" and pause == "abort" else "wait"

        def call():
            try:
                with self.life.call(pause, self._stop_running):
                    self._body(number, kind, pause)
            except RuntimeError as exc:
                if "refused a bucket" not in str(exc):
                    self.violations.append(f"call {number}: {exc!r}")
            except RolloutTimeoutError as exc:
                self.violations.append(f"call {number} timed out: {exc}")

        before = self._known_calls()
        thread = threading.Thread(target=call, daemon=True)
        thread.start()
        # In line (or already through it) before the next rule: the order of arrival.
        deadline = time.monotonic() + ENDS_WITHIN_S
        while number not in self.entered and not self._known_calls() - before \
                and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.0005)
        self.arrived.append(number)
        self.calls.append(thread)

    def _known_calls(self) -> set[int]:
        return {id(c) for c in (*self.life._line, self.life._current) if c is not None}

    @rule()
    def abort_all(self):
        self._stop_running("abort")

    @rule(auto=st.booleans())
    def backend_resumes_itself(self, auto):
        self.auto_resume = auto

    # --- what must hold -------------------------------------------------------------------

    @invariant()
    def a_request_runs_only_while_no_call_runs(self):
        def look():
            with self.life._gate:  # (a call changes _current on its own thread)
                return len(self.admitted), self.life.running, self.life._current
        admitted, running, current = self._on_loop(look)
        assert admitted == running
        assert not (running and current is not None and current.pause != "keep_kv")

    def teardown(self):
        try:
            for req in self.requests:
                self.loop.call_soon_threadsafe(req.end.set)
            for thread in self.calls:
                thread.join(ENDS_WITHIN_S)
                assert not thread.is_alive(), "a lifecycle call never ended"
            for req in self.requests:
                req.future.result(ENDS_WITHIN_S)  # (raises a wait past its bound)
                assert req.outcome is not None
            assert not self.violations, self.violations
            assert self.entered == self.arrived, "calls ran out of the order they came in"
            assert self.life.running == 0 and not self.life.busy
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(ENDS_WITHIN_S)
            self.loop.close()


LifecycleInterleavings.TestCase.settings = settings(
    max_examples=40, stateful_step_count=30, deadline=None)
test_lifecycle_interleavings = LifecycleInterleavings.TestCase


def _serving(timeout: float = WAIT_S) -> tuple[Lifecycle, asyncio.AbstractEventLoop,
                                                threading.Thread]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    return Lifecycle("t", loop, timeout=timeout), loop, thread


def _stop(loop, thread):
    loop.call_soon_threadsafe(loop.stop)
    thread.join(WAIT_S)
    loop.close()


def test_two_keep_calls_in_line_hold_requests_until_both_have_run():
    """Each call in line is its own: the first keep call to get through does not end the
    hold the second asks for (the old `_holding` flag, shared by both, did)."""
    life, loop, thread = _serving()
    try:
        asyncio.run_coroutine_threadsafe(life.admit(), loop).result(WAIT_S)  # a request runs
        gates = [threading.Event(), threading.Event()]
        entered: list[int] = []

        def keep(i):
            with life.call("keep"):
                entered.append(i)
                gates[i].wait(120)  # the test opens it

        calls = [threading.Thread(target=keep, args=(i,)) for i in (0, 1)]
        for call in calls:
            call.start()
            _until(lambda: len(life._line) == calls.index(call) + 1)
        assert life.holding and life.state is State.DRAINING
        life.leave()  # the request was held out of the engine: the first call runs
        _until(lambda: entered == [0])
        assert life.state is State.CHANGING
        assert life.holding  # the second still waits, and holds
        gates[0].set()
        _until(lambda: entered == [0, 1])
        assert not life.holding
        gates[1].set()
        for call in calls:
            call.join(WAIT_S)
        assert life.state is State.SERVING
    finally:
        _stop(loop, thread)


def _until(condition, within: float = WAIT_S) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, "never came"
        time.sleep(0.001)


def test_every_wait_is_bounded():
    """A request that waits for a call that never ends, and a call that waits for a request
    that never ends, each give up after the timeout with the reason."""
    life, loop, thread = _serving(timeout=0.5)
    try:
        asyncio.run_coroutine_threadsafe(life.admit(), loop).result(WAIT_S)  # runs, never ends
        with pytest.raises(RolloutTimeoutError, match="running requests"):
            with life.call():
                pass
        assert not life.busy  # the call that gave up left the line
        life.leave()
        stuck = threading.Event()

        def stays():
            with life.call():
                stuck.wait(120)  # the test ends it

        holder = threading.Thread(target=stays)
        holder.start()
        _until(lambda: life.state is State.CHANGING)
        with pytest.raises(RolloutTimeoutError, match="weight update or release"):
            asyncio.run_coroutine_threadsafe(life.admit(), loop).result(WAIT_S)
        stuck.set()
        holder.join(WAIT_S)
    finally:
        _stop(loop, thread)


def test_a_closed_lifecycle_admits_nothing_and_wakes_what_waits():
    life, loop, thread = _serving()
    try:
        assert life.close(lambda: None)
        assert not life.close(lambda: None)
        with pytest.raises(BackendReleasedError, match="closed"):
            asyncio.run_coroutine_threadsafe(life.admit(), loop).result(WAIT_S)
        with pytest.raises(BackendReleasedError, match="closed"):
            with life.call():
                pass
        assert life.state is State.CLOSED
    finally:
        _stop(loop, thread)
