"""An engine step that fails (injected: the real engine cannot be made to fail on demand)
fails the waiting calls with EngineDeadError, and later calls at once; nothing hangs."""

import threading
import time

import pytest
from conftest import ENGINE

import rollout
from rollout import EngineDeadError

LONG = {"prompt": "the ka lo", "sampling": {"temperature": 0.0, "max_tokens": 1500,
                                            "ignore_eos": True}}


def test_failed_engine_step_fails_waiting_and_later_calls(tiny_model):
    with rollout.load_backend("vllm", model=str(tiny_model), mode="engine", **ENGINE) as backend:
        outcome: dict = {}

        def call():
            try:
                outcome["value"] = backend.generate([dict(LONG) for _ in range(16)])
            except Exception as exc:  # noqa: BLE001 - inspected below
                outcome["error"] = exc

        worker = threading.Thread(target=call)
        worker.start()
        time.sleep(0.5)
        assert worker.is_alive(), "the requests finished before the failure was injected"

        def broken_step():
            raise RuntimeError("injected step failure")

        backend._backend.engine.engine.step = broken_step
        worker.join(30)
        assert not worker.is_alive()
        assert isinstance(outcome.get("error"), EngineDeadError), outcome
        assert "injected step failure" in str(outcome["error"])
        started = time.monotonic()
        with pytest.raises(EngineDeadError):
            backend.generate([{"prompt": "x"}])
        assert time.monotonic() - started < 5
