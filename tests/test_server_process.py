"""An engine server's process never outlives its use: closing it takes its whole process
group, and a server whose owner dies without closing it gets SIGTERM (Linux)."""

import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from rollout.contract.errors import InvalidRequestError
from rollout.kit.process import ServerProcess

# A server that starts a worker in its process group; the worker ignores SIGTERM, as an
# engine's busy worker may, and so outlives the server.
SERVER = textwrap.dedent("""
    import signal, subprocess, sys, time
    worker = subprocess.Popen([sys.executable, "-c",
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
    print(worker.pid, flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    time.sleep(600)
""")


def gone(pid: int, within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z":
                return True  # exited; only its entry waits to be reaped
        except FileNotFoundError:
            return True
        time.sleep(0.1)
    return False


def first_line(path: Path, within: float = 30.0) -> str:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        text = path.read_text() if path.exists() else ""
        if "\n" in text:
            return text.split("\n", 1)[0]
        time.sleep(0.1)
    raise AssertionError(f"nothing written to {path} within {within} s")


pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")


def test_stop_takes_workers_that_outlive_the_server():
    server = ServerProcess("test", [sys.executable, "-c", SERVER])
    try:
        worker = int(first_line(server.log_path))
        assert not gone(worker, within=0.5)
    finally:
        server.stop(grace=5)
    assert not server.alive()
    assert gone(worker), "a worker of the server outlived stop()"


def test_server_gets_sigterm_when_its_owner_dies(tmp_path):
    pid_file = tmp_path / "server.pid"
    owner = textwrap.dedent(f"""
        import os, sys
        from rollout.kit.process import ServerProcess
        server = ServerProcess("test", [sys.executable, "-c", "import time; time.sleep(600)"],
                               die_with_parent=True)
        open({str(pid_file)!r}, "w").write(f"{{server.proc.pid}}\\n")
        os._exit(1)  # dies without stopping it
    """)
    subprocess.run([sys.executable, "-c", owner], check=False, timeout=60)
    server = int(first_line(pid_file))
    assert gone(server), "the server outlived its owner"


def test_without_the_flag_a_server_is_not_tied_to_its_starting_thread(tmp_path):
    """Replicas started from a worker thread that then ends must keep running."""
    import threading

    started: list = []
    thread = threading.Thread(target=lambda: started.append(
        ServerProcess("test", [sys.executable, "-c", "import time; time.sleep(600)"])))
    thread.start()
    thread.join()
    try:
        assert not gone(started[0].proc.pid, within=1.0)
    finally:
        started[0].stop(grace=5)


def test_engine_arguments_become_the_servers_flags():
    from rollout.kit.process import cli_flags

    assert cli_flags({"enable_lora": True, "max_lora_rank": 8, "quiet": False, "seed": None,
                      "lora_target_modules": ["q_proj", "v_proj"]}) == [
        "--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "q_proj", "v_proj"]


def test_the_log_goes_with_a_clean_stop_and_stays_otherwise():
    """/tmp does not fill with the logs of servers stopped by their owners; a replica's
    (asked to be kept) and the log of a server that died on its own stay."""
    sleeper = [sys.executable, "-c", "print('up', flush=True); import time; time.sleep(600)"]
    stopped = ServerProcess("test", sleeper)
    kept = ServerProcess("test", sleeper, keep_log=True)
    died = ServerProcess("test", [sys.executable, "-c", "print('failing'); raise SystemExit(3)"])
    try:
        died.proc.wait(30)
        assert first_line(stopped.log_path) == first_line(kept.log_path) == "up"
    finally:
        for server in (stopped, kept, died):
            server.stop(grace=5)
    assert not stopped.log_path.exists()
    assert kept.log_path.read_text() == "up\n"
    assert died.log_path.read_text() == "failing\n"
    for server in (kept, died):
        server.log_path.unlink()


def test_free_ports_are_outside_the_ephemeral_range_and_never_handed_out_twice():
    """A child server's port is not one the kernel may give an outgoing connection before
    the server binds it (an SGLang server lost its port that way in CI), and no two callers,
    in this process or another, get the same one while it is held."""
    from rollout.kit.process import free_port

    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    script = "from rollout.kit.process import free_port; print(*(free_port() for _ in range(50)))"
    other = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                           check=True, timeout=60).stdout.split()
    ours = [free_port() for _ in range(50)]
    ports = ours + [int(p) for p in other]
    assert len(set(ports)) == len(ports) == 100
    assert all(p < low for p in ports), [p for p in ports if p >= low]


def test_a_port_someone_listens_on_is_not_handed_out(monkeypatch):
    import socket

    from rollout.kit import process

    with socket.create_server((process.HOST, 0)) as taken:
        port = taken.getsockname()[1]
        (Path(tempfile.gettempdir()) / "rollout-ports" / str(port)).unlink(missing_ok=True)
        first, draw = [port], process.random.randrange
        monkeypatch.setattr(process.random, "randrange",
                            lambda *bounds: first.pop() if first else draw(*bounds))
        assert process.free_port() != port
        assert not first  # it was offered the taken port, and passed it over


def test_a_killed_server_slow_to_go_does_not_fail_its_stop(monkeypatch, caplog):
    """A server killed on a loaded machine may take a while to be gone (the kernel frees
    an engine's gigabytes): its owner's stop logs it and returns; it does not raise."""
    sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
    server = ServerProcess("test", sleeper)
    real_wait = subprocess.Popen.wait

    def slow(self, timeout=None):
        if self is server.proc and timeout is not None:
            raise subprocess.TimeoutExpired(self.args, timeout)  # (as the kernel was)
        return real_wait(self, timeout)

    monkeypatch.setattr(subprocess.Popen, "wait", slow)
    server.stop(grace=0.1)
    assert "killed, not yet gone" in caplog.text
    monkeypatch.undo()
    assert server.proc.wait(30) in (-signal.SIGTERM, -signal.SIGKILL)  # stopped, and gone


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="Linux: niceness per thread")
def test_renice_takes_every_thread_of_a_process_tree_and_leaves_its_owner_alone():
    """A child with a second thread, and a grandchild: all at the niceness asked, this
    process's threads as they were; a thread the child starts after it has it too; and a
    lower niceness asked later leaves them as they are. At 19 every thread is idle too
    (SCHED_IDLE), the later one as well."""
    import os

    from rollout.kit.process import descendants, niceness, renice

    tree = textwrap.dedent("""
        import os, subprocess, sys, threading, time
        grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
        print(grandchild.pid, flush=True)
        sys.stdin.readline()  # reniced: start one more thread, and say its niceness
        threading.Thread(target=lambda: print(os.getpriority(os.PRIO_PROCESS,
                         threading.get_native_id()), os.sched_getscheduler(0),
                         flush=True)).start()
        time.sleep(600)
    """)
    child = subprocess.Popen([sys.executable, "-c", tree], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        grandchild = int(child.stdout.readline())
        assert descendants(child.pid) == [grandchild]
        ours = niceness([os.getpid()])
        renice([child.pid, grandchild], 19)
        assert niceness([child.pid]) == niceness([grandchild]) == {19}
        threads = list(Path(f"/proc/{child.pid}/task").iterdir())
        assert len(threads) >= 2
        # The nicest is also idle: it runs only on a core nothing else wants.
        assert {os.sched_getscheduler(int(t.name)) for t in threads} == {os.SCHED_IDLE}
        renice([child.pid], 5)  # never a higher priority than a thread has
        assert niceness([child.pid]) == {19}
        assert niceness([os.getpid()]) == ours
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.stdout.readline().split() == ["19", str(os.SCHED_IDLE)]
    finally:
        for pid in (*descendants(child.pid), child.pid):
            os.kill(pid, signal.SIGKILL)
        child.wait(30)


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="Linux: niceness per thread")
def test_nice_is_refused_for_an_engine_that_starts_no_process():
    """An engine that runs in this process (vLLM's worker with VLLM_ENABLE_V1_MULTIPROCESSING=0)
    has nothing to renice: the option is refused by name, and nothing of ours is reniced."""
    import os

    from rollout.kit.process import niced_children, niceness

    ours = niceness([os.getpid()])
    with pytest.raises(InvalidRequestError) as refused, niced_children(5):
        pass  # starts nothing
    assert refused.value.field == "nice" and "runs in this one" in str(refused.value)
    assert niceness([os.getpid()]) == ours
    with niced_children(0):  # the default: nothing to check
        pass
