"""An in-process SGLang engine whose scheduler dies mid-request fails the waiting call
fast: SGLang's watchdog sends this process SIGQUIT, and the backend's handler fails what
waits on the engine loop."""


from conftest import ENGINE

import rollout
from rollout.testing.server_death import check_failure_fails_calls, kill_later


def test_killed_scheduler_fails_waiting_calls_within_seconds(tiny_model):
    with rollout.load_backend("sglang", model=str(tiny_model), mode="engine", **ENGINE) as backend:
        llm = backend._backend.engine.llm
        schedulers = llm.get_all_child_pids()
        check_failure_fails_calls(backend, lambda: kill_later(schedulers), ("SIGQUIT",))
