"""Shared checks for engines that can die: killing the server (or failing the engine)
mid-request fails the waiting call within seconds with EngineDeadError saying why, and
later calls at once."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable

from rollout import EngineDeadError, Rollout

LONG = {"prompt": "the ka lo", "sampling": {"temperature": 0.0, "max_tokens": 2000,
                                            "ignore_eos": True}}


def check_killed_server_fails_fast(backend: Rollout, server_pid: int) -> None:
    check_failure_fails_calls(backend, lambda: os.killpg(server_pid, signal.SIGKILL),
                              ("exited with code", "end of its log"))


def check_failure_fails_calls(backend: Rollout, fail: Callable[[], None],
                              clues: tuple[str, ...]) -> None:
    """Call `fail()` while a batch runs: the waiting call must raise EngineDeadError within
    10 s, its message holding every one of `clues`, and later calls must fail at once."""
    outcome: dict = {}

    def call():
        try:
            outcome["value"] = backend.generate([dict(LONG) for _ in range(16)])
        except Exception as exc:  # noqa: BLE001 - inspected below
            outcome["error"] = exc

    worker = threading.Thread(target=call)
    worker.start()
    time.sleep(0.5)  # in flight: an idle machine finishes this batch in a few seconds
    assert worker.is_alive(), "the requests finished before the failure came"
    failed = time.monotonic()
    fail()
    worker.join(30)
    elapsed = time.monotonic() - failed
    assert not worker.is_alive()
    assert elapsed < 10, f"the waiting call took {elapsed:.1f} s to fail"
    error = outcome.get("error")
    assert isinstance(error, EngineDeadError), outcome
    assert all(clue in str(error) for clue in clues), str(error)
    started = time.monotonic()
    try:
        backend.generate([{"prompt": "x"}])
        raise AssertionError("generate after the failure returned")
    except EngineDeadError:
        assert time.monotonic() - started < 5
