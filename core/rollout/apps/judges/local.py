"""The local judge: every test case runs in a child process of its own, on this machine.

Each child gets a fresh temporary folder as its working folder (removed afterwards), a
minimal environment, a wall-clock timeout after which its whole process group is killed,
and the harness's CPU-time, memory and output limits. Where `unshare` may create
namespaces (root, or unprivileged user namespaces), the child also has no network (an
empty network namespace) and its own PID namespace, so nothing it starts outlives it.
Without them, the harness's audit hook is the only thing keeping it off the network: see
docs/evaluation.md for what that does and does not stop.
"""

from __future__ import annotations

import functools
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import attrs

from rollout.apps.judges.base import Judge, parse_options, positive
from rollout.apps.judges.harness import Limits, Outcome, Run
from rollout.kit.process import usable_cores

CASE_ENV = "ROLLOUT_JUDGE_CASE"  # set in every child: its folder, to find strays by
FOLDER_PREFIX = "rollout-judge-"  # then the judging process's id: rollout-judge-PID-...


@attrs.frozen
class LocalOptions:
    timeout: float = attrs.field(default=10.0, validator=positive)  # wall-clock s per case
    memory_mb: int = attrs.field(default=1024, validator=positive)
    output_mb: int = attrs.field(default=16, validator=positive)
    concurrency: int | None = attrs.field(default=None, validator=positive)  # CPU count
    python: str | None = None  # the interpreter that runs answers; this one by default
    site_packages: bool = False  # let answers import installed packages (slower start)
    isolate: bool = True  # network and PID namespaces, where the platform allows them
    work_root: str | None = None  # where case folders go; the system's temp folder by default


@functools.lru_cache(maxsize=None)
def isolation() -> tuple[tuple[str, ...], str]:
    """The command prefix that puts a child in new network and PID namespaces, and what it
    gives; an empty prefix where this platform does not allow it."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return (), "none: no unshare command"
    namespaces = ["--net", "--pid", "--fork", "--kill-child"]
    for extra, what in (([], "network and PID namespaces"),
                        (["--user", "--map-root-user"], "user, network and PID namespaces")):
        command = [unshare, *extra, *namespaces]
        try:
            works = subprocess.run([*command, "true"], capture_output=True,
                                   timeout=10).returncode == 0
        except (OSError, subprocess.SubprocessError):
            works = False
        if works:
            # The answer must not be PID 1 of its namespace: PID 1 ignores signals it has
            # no handler for, CPU-limit signals included. sh stays as PID 1 and reports a
            # signal as exit status 128 + N; when it dies, the kernel kills the rest.
            return (*command, "/bin/sh", "-c", '"$@"; exit $?', "sh"), f"{what} (unshare)"
    return (), "none: unshare is not permitted here"


class LocalJudge(Judge):
    name = "local"

    def __init__(self, **options):
        self.options = parse_options(options, LocalOptions)
        o = self.options
        self.limits = Limits(o.timeout, o.memory_mb, o.output_mb)
        self.concurrency = o.concurrency or usable_cores()
        self.command = [o.python or sys.executable, "-I", "-B", *([] if o.site_packages else ["-S"])]
        self.prefix, self.isolation = isolation() if o.isolate else ((), "none: isolate=false")
        remove_folders_of_dead_runs(o.work_root or tempfile.gettempdir())

    def describe(self) -> dict:
        return {**super().describe(), "isolation": self.isolation}

    def execute(self, run: Run) -> Outcome:
        folder = tempfile.mkdtemp(prefix=f"{FOLDER_PREFIX}{os.getpid()}-",
                                  dir=self.options.work_root)
        try:
            return self._run_in(folder, run)
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def _run_in(self, folder: str, run: Run) -> Outcome:
        work = os.path.join(folder, "work")
        os.mkdir(work)
        harness = os.path.join(folder, "harness.py")
        with open(harness, "w", encoding="utf-8") as f:
            f.write(run.program)
        with open(os.path.join(folder, "stdin"), "w", encoding="utf-8") as f:
            f.write(run.stdin)
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": work, "TMPDIR": work,
               "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", CASE_ENV: folder}
        with open(os.path.join(folder, "stdin"), "rb") as stdin, \
                open(os.path.join(folder, "stdout"), "w+b") as stdout, \
                open(os.path.join(folder, "stderr"), "w+b") as stderr:
            started = time.monotonic()
            child = subprocess.Popen([*self.prefix, *self.command, harness], stdin=stdin,
                                     stdout=stdout, stderr=stderr, cwd=work, env=env,
                                     start_new_session=True)
            timed_out = not _wait_unreaped(child, self.limits.timeout)
            try:
                os.killpg(child.pid, signal.SIGKILL)  # the answer, and anything it started
            except ProcessLookupError:
                pass
            code = child.wait(10)
            seconds = time.monotonic() - started
            if self.prefix and code > 128:
                code = 128 - code  # sh's "killed by signal N", as Popen reports it
            limit = self.limits.output_mb << 20
            return Outcome(exit_code=code, timed_out=timed_out, stdout=_read(stdout, limit),
                           stderr=_read(stderr, limit), seconds=seconds)


def remove_folders_of_dead_runs(root: str) -> None:
    """Case folders left by a judging process that was killed (SIGKILL skips every clean-up)."""
    try:
        names = os.listdir(root)
    except OSError:
        return
    for name in names:
        pid = name[len(FOLDER_PREFIX):].split("-")[0]
        if not (name.startswith(FOLDER_PREFIX) and pid.isdigit()):
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        except PermissionError:
            pass  # alive, another user's


def _wait_unreaped(child: subprocess.Popen, timeout: float) -> bool:
    """Wait for the child to exit without reaping it, so that its process group id stays
    ours to kill; False on timeout. pidfd wakes up at once; polling is the fallback."""
    try:
        pidfd = os.pidfd_open(child.pid)
    except (AttributeError, OSError):
        try:
            child.wait(timeout)
            return True
        except subprocess.TimeoutExpired:
            return False
    try:
        return bool(select.select([pidfd], [], [], timeout)[0])
    finally:
        os.close(pidfd)


def _read(file, limit: int) -> str:
    file.seek(0)
    return file.read(limit).decode("utf-8", errors="replace")
