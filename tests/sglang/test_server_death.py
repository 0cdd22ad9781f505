"""An SGLang server that dies mid-request fails the waiting call fast, with its log."""

import os
import signal
import threading
import time

from conftest import ENGINE

import rollout


def test_killed_server_fails_waiting_calls_within_seconds(tiny_model):
    backend = rollout.load_backend("sglang", model=str(tiny_model), mode="server", **ENGINE)
    server = backend._backend.engine.process
    outcome = {}

    def call():
        try:
            outcome["value"] = backend.generate([{"prompt": "the ka lo", "sampling": {
                "temperature": 0.0, "max_tokens": 1000, "ignore_eos": True}}])
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            outcome["error"] = exc

    worker = threading.Thread(target=call)
    try:
        worker.start()
        time.sleep(1.0)
        killed = time.monotonic()
        os.killpg(server.proc.pid, signal.SIGKILL)
        worker.join(30)
        elapsed = time.monotonic() - killed
        assert not worker.is_alive()
        assert elapsed < 10, f"the waiting call took {elapsed:.1f} s to fail"
        error = outcome.get("error")
        assert isinstance(error, rollout.EngineDeadError), outcome
        assert "exited with code" in str(error) and "end of its log" in str(error)
        # Later calls fail at once too.
        started = time.monotonic()
        try:
            backend.generate([{"prompt": "x"}])
            raise AssertionError("generate on a dead server returned")
        except rollout.EngineDeadError:
            assert time.monotonic() - started < 5
    finally:
        backend.close()
