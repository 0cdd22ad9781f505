"""An in-process SGLang engine whose scheduler dies mid-request fails the waiting call
fast: SGLang's watchdog sends this process SIGQUIT, and the backend's handler fails what
waits on the engine loop. Closing it then ends its own processes and no other child of
this process (SGLang's shutdown alone kills them all). Started with `nice`, its processes
run at that niceness, and no other child of this process does."""

import os
import subprocess
import sys

import psutil
from conftest import ENGINE

import rollout
from rollout.kit.process import niceness
from rollout.testing.server_death import check_failure_fails_calls, kill_when_running


def test_killed_scheduler_fails_waiting_calls_within_seconds(tiny_model):
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        ours = niceness([os.getpid()])
        with rollout.load_backend("sglang", model=str(tiny_model), mode="engine", nice=5,
                                  **ENGINE) as backend:
            engine = backend._backend.engine
            schedulers = engine.llm.get_all_child_pids()
            assert niceness(engine._children) == {max(5, *ours)}  # (never above ours)
            assert niceness([bystander.pid]) == ours
            check_failure_fails_calls(backend, kill_when_running(backend, schedulers),
                                      ("SIGQUIT",))
        assert engine._children, "the engine's processes were not recorded"
        assert not [pid for pid in engine._children if psutil.pid_exists(pid)
                    and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
        assert bystander.poll() is None, "closing the engine killed another child"
    finally:
        bystander.kill()
        bystander.wait(10)
