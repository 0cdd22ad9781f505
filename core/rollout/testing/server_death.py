"""A shared check for server-backed engines: killing the server mid-request fails the
waiting call within seconds with EngineDeadError and the server's log, and later calls at
once."""

from __future__ import annotations

import os
import signal
import threading
import time

from rollout import EngineDeadError, Rollout

LONG = {"prompt": "the ka lo", "sampling": {"temperature": 0.0, "max_tokens": 2000,
                                            "ignore_eos": True}}


def check_killed_server_fails_fast(backend: Rollout, server_pid: int) -> None:
    outcome: dict = {}

    def call():
        try:
            outcome["value"] = backend.generate([dict(LONG) for _ in range(16)])
        except Exception as exc:  # noqa: BLE001 - inspected below
            outcome["error"] = exc

    worker = threading.Thread(target=call)
    worker.start()
    time.sleep(0.5)  # in flight: an idle machine finishes this batch in a few seconds
    assert worker.is_alive(), "the requests finished before the server could be killed"
    killed = time.monotonic()
    os.killpg(server_pid, signal.SIGKILL)
    worker.join(30)
    elapsed = time.monotonic() - killed
    assert not worker.is_alive()
    assert elapsed < 10, f"the waiting call took {elapsed:.1f} s to fail"
    error = outcome.get("error")
    assert isinstance(error, EngineDeadError), outcome
    assert "exited with code" in str(error) and "end of its log" in str(error)
    started = time.monotonic()
    try:
        backend.generate([{"prompt": "x"}])
        raise AssertionError("generate on a dead server returned")
    except EngineDeadError:
        assert time.monotonic() - started < 5
