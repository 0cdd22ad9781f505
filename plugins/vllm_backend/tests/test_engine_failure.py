"""An engine that fails fails the waiting calls with EngineDeadError, and later calls at
once; nothing hangs. Engine mode: an engine step that fails (injected: the real engine
cannot be made to fail on demand). Async mode: the engine core's process killed."""

import itertools
import signal

from conftest import ENGINE

import rollout
from rollout.testing.server_death import check_failure_fails_calls, kill_when_running

# 4 sequences a step: the failing batch runs for tens of seconds.
SLOW = {"max_num_seqs": 4}


def test_failed_engine_step_fails_waiting_and_later_calls(tiny_model):
    with rollout.load_backend("vllm", model=str(tiny_model), mode="engine", **ENGINE,
                              engine_args=SLOW) as backend:
        engine = backend._backend.engine.engine

        def fail_from_step_20():
            step, steps = engine.step, itertools.count()

            def failing_step():
                if next(steps) >= 20:
                    raise RuntimeError("injected step failure")
                return step()

            engine.step = failing_step

        check_failure_fails_calls(backend, fail_from_step_20, ("injected step failure",))


def test_killed_engine_core_fails_waiting_and_later_calls(tiny_model):
    with rollout.load_backend("vllm", model=str(tiny_model), mode="async", **ENGINE,
                              engine_args=SLOW) as backend:
        manager = backend._backend.engine.engine.engine_core.resources.engine_manager
        (core,) = manager.processes

        check_failure_fails_calls(backend, kill_when_running(backend, [core.pid]),
                                  ("engine core", f"exited with code {-signal.SIGKILL}"))
