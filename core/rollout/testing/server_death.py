"""Shared checks for engines that can die: killing the server (or failing the engine)
mid-request fails the waiting call within seconds with EngineDeadError saying why, and
later calls at once."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable

import pytest

from rollout import EngineDeadError, Rollout

LONG = {"prompt": "the ka lo", "sampling": {"temperature": 0.0, "max_tokens": 2000,
                                            "ignore_eos": True}}
# 16 x 16 samples of 2000 tokens: about a minute of work for an idle engine, so the failure
# comes while they run even when this process is starved for seconds (a loaded machine);
# 16 requests alone may all be made, and sit unread in this process's socket, by then.
BATCH, SAMPLES = 16, 16
# Failing "fast" is against the request timeout the call would hang to otherwise; the
# margin takes a starved process (seconds) in its stride.
FAIL_WITHIN_S = 60


def check_killed_server_fails_fast(backend: Rollout, server_pid: int) -> None:
    check_failure_fails_calls(backend, lambda: os.killpg(server_pid, signal.SIGKILL),
                              ("exited with code", "end of its log"))


def check_failure_fails_calls(backend: Rollout, fail: Callable[[], None],
                              clues: tuple[str, ...]) -> None:
    """Call `fail()` while a batch runs: the waiting call must raise EngineDeadError within
    seconds, its message holding every one of `clues`, and later calls must fail at once."""
    outcome: dict = {}

    def call():
        try:
            long = {**LONG, "sampling": {**LONG["sampling"], "n": SAMPLES, "temperature": 1.0}}
            outcome["value"] = backend.generate([dict(long) for _ in range(BATCH)])
        except Exception as exc:  # noqa: BLE001 - inspected below
            outcome["error"] = exc

    worker = threading.Thread(target=call)
    worker.start()
    time.sleep(0.5)  # in flight
    assert worker.is_alive(), "the requests finished before the failure came"
    fail()
    worker.join(FAIL_WITHIN_S)
    assert not worker.is_alive(), f"the waiting call did not fail within {FAIL_WITHIN_S} s"
    error = outcome.get("error")
    assert isinstance(error, EngineDeadError), outcome
    assert all(clue in str(error) for clue in clues), str(error)
    # A later call fails with the same error, not a timeout.
    with pytest.raises(EngineDeadError):
        backend.generate([{"prompt": "x"}], timeout=FAIL_WITHIN_S)
