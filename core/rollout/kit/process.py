"""An engine server run as a child process on the loopback address.

Its output goes to a log file; waiting for it to become healthy has a timeout; if it dies,
`check()` raises EngineDeadError carrying the end of its log, so callers fail in seconds
instead of hanging. The log goes when its owner stops a running server, unless asked to be
kept (replicas', which operators read); a server that died on its own, or did not start in
time, keeps it.
"""

from __future__ import annotations

import ctypes
import logging
import os
import random
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Collection, Iterable, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

from rollout.contract.errors import EngineDeadError, InvalidRequestError, RolloutTimeoutError

HOST = "127.0.0.1"
LOG_TAIL_LINES = 40
GROUP_GRACE_S = 5.0
REAP_WAIT_S = 60.0  # for a killed server to be gone
log = logging.getLogger("rollout.process")


def usable_cores() -> int:
    """How many cores this process may run on (its affinity where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


PORTS_FROM = 20000  # above Ray's worker ports (10002-19999)
PORT_HELD_S = 600.0


def free_port() -> int:
    """A port for a child server that binds it later (an engine's server may bind only once
    its model has loaded, a minute on). Taken below the kernel's ephemeral range: a port
    that bind(0) hands out is in the range the kernel also gives the local end of outgoing
    connections, and in CI one of those took an SGLang server's port before it bound it.
    Each port handed out is held for ten minutes across processes (a file created
    exclusively), so no two callers get the same one."""
    top = _ephemeral_start()
    if top - PORTS_FROM < 1000:  # a machine whose ephemeral range starts low
        return _kernel_port()
    held = Path(tempfile.gettempdir()) / "rollout-ports"
    held.mkdir(exist_ok=True)
    for _ in range(1000):
        port = random.randrange(PORTS_FROM, top)
        if _hold(held / str(port)) and _bindable(port):
            return port
    return _kernel_port()


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default; other systems start higher


def _hold(mark: Path) -> bool:
    """Whether this process now holds the port named by `mark` (it was free of holders,
    or its holder's ten minutes are over)."""
    try:
        if time.time() - mark.stat().st_mtime > PORT_HELD_S:
            mark.unlink(missing_ok=True)
    except FileNotFoundError:
        pass
    try:
        os.close(os.open(mark, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((HOST, port))
            return True
        except OSError:
            return False


def _kernel_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def cli_flags(options: Mapping[str, object]) -> list[str]:
    """Engine arguments as a server's command-line flags: `True` is a bare flag, `False`
    and `None` are left out, a list or tuple is `--key v1 v2 ...` (argparse's nargs),
    anything else is `--key value`."""
    argv: list[str] = []
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif isinstance(value, list | tuple):
            argv += [flag, *map(str, value)]
        elif value not in (False, None):
            argv += [flag, str(value)]
    return argv


def children(pid: int) -> list[int]:
    """The pids of a process's children (Linux; none elsewhere or once it is gone)."""
    try:
        return [int(c) for task in Path(f"/proc/{pid}/task").iterdir()
                for c in (task / "children").read_text().split()]
    except OSError:
        return []


def descendants(pid: int) -> list[int]:
    """A process's children, theirs, and so on (Linux; none elsewhere)."""
    found, todo = [], children(pid)
    while todo:
        found.append(todo.pop())
        todo += children(found[-1])
    return found


NICEST = 19


def check_nice(nice) -> None:
    """A backend's `nice` option: the niceness of its engine's processes, 0 (as this
    process) to NICEST; below 0 would be a higher priority than ours, which needs
    privileges and is not this option's job."""
    if not isinstance(nice, int) or isinstance(nice, bool) or not 0 <= nice <= NICEST:
        raise InvalidRequestError("nice", f"got {nice!r}", f"an integer from 0 to {NICEST}")


@contextmanager
def niced_children(nice: int):
    """The processes this one starts within the block, and theirs, at niceness `nice` once it
    ends (every thread: `renice`); with 0, nothing is changed. An engine that started none
    (it runs in this process) has nothing to renice: `nice` is refused, not dropped."""
    if not nice:
        yield
        return
    before = set(descendants(os.getpid()))
    yield
    started = set(descendants(os.getpid())) - before
    if not started:
        raise InvalidRequestError("nice", f"got {nice}, but the engine started no process of "
                                  "its own: it runs in this one, beside the caller", "0")
    renice(started, nice)


def _threads(pid: int) -> list[int]:
    """A process's threads (Linux); elsewhere, the process."""
    try:
        return [int(t.name) for t in Path(f"/proc/{pid}/task").iterdir()]
    except OSError:
        return [pid]


def renice(pids: Iterable[int], nice: int) -> None:
    """Every thread of each process at niceness `nice`, or its own where that is higher (a
    higher priority needs privileges): Linux keeps one per thread, and a thread starts with
    its creator's, so those the processes start later have it too. At NICEST also under
    Linux's SCHED_IDLE policy (inherited the same way): such a thread runs only where
    nothing else wants the core (at niceness 19 alone it still takes a share of a busy
    one: docs/rl-loop.md). One gone meanwhile is skipped."""
    idle = nice == NICEST and hasattr(os, "SCHED_IDLE")
    for pid in pids:
        for thread in _threads(pid):
            try:
                if os.getpriority(os.PRIO_PROCESS, thread) < nice:
                    os.setpriority(os.PRIO_PROCESS, thread, nice)
                if idle:
                    os.sched_setscheduler(thread, os.SCHED_IDLE, os.sched_param(0))
            except ProcessLookupError:  # ended meanwhile
                pass


def niceness(pids: Iterable[int]) -> set[int]:
    """The niceness of every thread of `pids`."""
    return {os.getpriority(os.PRIO_PROCESS, thread) for pid in pids for thread in _threads(pid)}


PR_SET_PDEATHSIG = 1


def die_with_parent_hook():
    """A preexec_fn for Linux: SIGTERM the child when the thread that started it ends (the
    owner crashed or was killed), so an engine server is never left running alone."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux
        return None
    return lambda: prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _before_exec(hook, cpus: Collection[int] | None):
    """The child's preexec_fn: `hook`, then (with `cpus`) the child kept to those cores, it
    and every process and thread it starts."""
    if not cpus:
        return hook

    def run():
        if hook is not None:
            hook()
        os.sched_setaffinity(0, cpus)
    return run


class ServerProcess:
    """`die_with_parent`: for a server owned by a thread that lives as long as it is used
    (an engine's event loop); the signal comes when that thread ends. `keep_log`: the log
    stays after `stop()` (it always does for a server that exited by itself)."""

    def __init__(self, name: str, argv: Sequence[str], env: Mapping[str, str] | None = None,
                 die_with_parent: bool = False, cpus: Collection[int] | None = None,
                 keep_log: bool = False):
        self.name = name
        self.keep_log = keep_log
        handle, path = tempfile.mkstemp(prefix=f"rollout-{name}-", suffix=".log")
        self.log_path = Path(path)
        self._log = os.fdopen(handle, "wb")
        self.proc = subprocess.Popen(
            list(argv), stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})}, start_new_session=True,  # its own process group
            preexec_fn=_before_exec(die_with_parent_hook() if die_with_parent else None, cpus),
        )

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def alive(self) -> bool:
        return self.proc.poll() is None

    def check(self) -> None:
        """Raise EngineDeadError if the process has exited."""
        code = self.proc.poll()
        if code is not None:
            raise EngineDeadError(
                f"{self.name} server (pid {self.proc.pid}) exited with code {code}; "
                f"end of its log ({self.log_path}):\n{self.log_tail()}")

    def wait_healthy(self, url: str, timeout: float,
                     headers: Mapping[str, str] | None = None) -> None:
        """Poll `url` until it answers 200; fail early if the process dies."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check()
            try:
                request = urllib.request.Request(url, headers=dict(headers or {}))
                with urllib.request.urlopen(request, timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        self.keep_log = True  # a failed start's whole log may be wanted
        self.stop()
        raise RolloutTimeoutError(
            f"{self.name} server did not become healthy at {url} within {timeout:.0f} s; "
            f"end of its log ({self.log_path}):\n{self.log_tail()}")

    def stop(self, grace: float = 15.0) -> None:
        """SIGTERM the whole process group, then SIGKILL what is left after `grace` s."""
        stopped_running = self.alive()
        if stopped_running:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(grace)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                pass
        # Children (an engine's workers) may outlive their parent: they get a few seconds
        # to finish their own clean-up (shared memory), then SIGKILL.
        deadline = time.monotonic() + GROUP_GRACE_S
        while _group_alive(self.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if self.proc.poll() is None:  # not reaped yet, so the pid is still its own
            self.proc.kill()  # (had it left its group)
        try:
            self.proc.wait(REAP_WAIT_S)
        except subprocess.TimeoutExpired:
            # SIGKILL cannot be refused: the kernel is still freeing its memory (gigabytes
            # for an engine, slow on a loaded machine: once over 10 s in CI). It ends; the
            # exit status is read later.
            log.warning("%s server (pid %d) killed, not yet gone after %.0f s", self.name,
                        self.proc.pid, REAP_WAIT_S)
        self._log.close()
        if stopped_running and not self.keep_log:
            self.log_path.unlink(missing_ok=True)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False
