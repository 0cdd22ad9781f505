"""An engine step that fails (injected: the real engine cannot be made to fail on demand)
fails the waiting calls with EngineDeadError, and later calls at once; nothing hangs."""

from conftest import ENGINE

import rollout
from rollout.testing.server_death import check_failure_fails_calls


def test_failed_engine_step_fails_waiting_and_later_calls(tiny_model):
    with rollout.load_backend("vllm", model=str(tiny_model), mode="engine", **ENGINE) as backend:
        def broken_step():
            raise RuntimeError("injected step failure")

        def fail():
            backend._backend.engine.engine.step = broken_step

        check_failure_fails_calls(backend, fail, ("injected step failure",))
