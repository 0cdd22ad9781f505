"""Async mode: vLLM's engine core runs in child processes, and none outlives its owner,
whether the backend is closed or the process that owns it is killed; nor do its sockets."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import ENGINE

import rollout
from rollout.kit.process import children

OWNER = """
import pathlib, sys, time, rollout
backend = rollout.load_backend("vllm", model=sys.argv[1], mode="async", **eval(sys.argv[2]))
core = backend._backend.engine.engine.engine_core.resources.engine_manager.processes[0]
pathlib.Path(sys.argv[3]).write_text(str(core.pid))
time.sleep(600)
"""

CLOSER = """
import os, sys, rollout
backend = rollout.load_backend("vllm", model=sys.argv[1], mode="async", **eval(sys.argv[2]))
folder = os.environ["VLLM_RPC_BASE_PATH"]
print("sockets in", folder, len(os.listdir(folder)), flush=True)
backend.close()
"""


def gone(pid: int) -> bool:
    """Exited: no such process, or a zombie that only waits to be reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def wait_gone(pids: list[int], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not all(gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    return all(gone(p) for p in pids)


def test_close_stops_the_engine_core_and_its_workers(tiny_model):
    backend = rollout.load_backend("vllm", model=str(tiny_model), mode="async", **ENGINE)
    (core,) = backend._backend.engine.engine.engine_core.resources.engine_manager.processes
    workers = children(core.pid)
    assert workers  # the executor's worker
    backend.close()
    assert wait_gone([core.pid, *workers], 60)


def test_a_killed_owner_leaves_no_engine_core(tiny_model, tmp_path):
    pid_file = tmp_path / "core.pid"
    owner = subprocess.Popen([sys.executable, "-c", OWNER, str(tiny_model), repr(ENGINE),
                              str(pid_file)], stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while not (pid_file.exists() and pid_file.read_text()) and owner.poll() is None \
                and time.monotonic() < deadline:
            time.sleep(0.5)
        core = int(pid_file.read_text())
        workers = children(core)
        os.kill(owner.pid, signal.SIGKILL)
        assert wait_gone([core, *workers], 60)
    finally:
        owner.kill()
        owner.wait()


def test_the_engines_sockets_go_with_their_owner(tiny_model):
    env = {k: v for k, v in os.environ.items() if k != "VLLM_RPC_BASE_PATH"}
    out = subprocess.run([sys.executable, "-c", CLOSER, str(tiny_model), repr(ENGINE)], env=env,
                         capture_output=True, text=True, timeout=300, check=True).stdout
    (line,) = [x for x in out.splitlines() if x.startswith("sockets in ")]
    folder, sockets = line.split()[2:]
    assert Path(folder).name.startswith("rollout-vllm-sockets-") and int(sockets) > 0
    assert not Path(folder).exists()  # removed, with what the engine left there
