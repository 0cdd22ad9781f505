"""An engine that fails fails the waiting calls with EngineDeadError, and later calls at
once; nothing hangs. Engine mode: an engine step that fails (injected: the real engine
cannot be made to fail on demand). Async mode: the engine core's process killed."""

import os
import signal

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


def test_killed_engine_core_fails_waiting_and_later_calls(tiny_model):
    with rollout.load_backend("vllm", model=str(tiny_model), mode="async", **ENGINE) as backend:
        manager = backend._backend.engine.engine.engine_core.resources.engine_manager
        (core,) = manager.processes

        check_failure_fails_calls(backend, lambda: os.kill(core.pid, signal.SIGKILL),
                                  ("engine core", f"exited with code {-signal.SIGKILL}"))
