"""The program a judge runs for one test case, and how its outcome becomes a status.

Every judge runs the same self-contained harness (so a local run and a SandboxFusion run of
an answer agree): it sets CPU-time, memory and file-size limits on itself, installs an
audit hook that refuses network connections, new processes, native code loading and
writes outside its working folder, then runs the answer. The audit hook is a guard against
accidents and lazy reward hacks, not a security boundary: code that wants to can get
around it. Isolation that holds (namespaces, a sandbox server) is the judge's job.

A test program passes only if the harness reaches its end and prints a random marker
unknown to the answer, so an answer that exits early with status 0 is not a success.
"""

from __future__ import annotations

import math
import secrets
import signal

import attrs

from rollout.apps.judges.verdicts import CaseResult, ProgramTests, StdioTests, Tests

WRONG_ANSWER_EXIT = 3  # an AssertionError from check()
ERROR_EXIT = 4  # any other exception, or SystemExit, from the answer or check()
DETAIL_CHARS = 1500

HARNESS = r'''
import os, resource, signal, sys

def _limit(which, soft, hard):
    ceiling = resource.getrlimit(which)[1]
    if ceiling != resource.RLIM_INFINITY:
        soft, hard = min(soft, ceiling), min(hard, ceiling)
    resource.setrlimit(which, (soft, hard))

def _guard(home):
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    devices = ("/dev/null", "/dev/stdout", "/dev/stderr")
    denied = {"socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg",
              "subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn",
              "os.fork", "os.forkpty", "os.kill", "os.killpg", "ctypes.dlopen",
              "os.symlink", "os.link"}
    changes = {"os.remove": 1, "os.rmdir": 1, "os.mkdir": 1, "os.rename": 2, "os.chmod": 1,
               "os.chown": 1, "os.truncate": 1, "os.utime": 1, "shutil.rmtree": 1}

    def outside(path):
        if isinstance(path, int):
            return False  # an open file descriptor
        path = os.path.abspath(os.fsdecode(path))
        return not (path == home or path.startswith(home + os.sep) or path in devices)

    def hook(event, args):
        if event == "open":
            path, mode, flags = args
            writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & write_flags)
            if writes and outside(path):
                raise PermissionError("judge: writing outside the working folder is not "
                                      "allowed: %s" % (path,))
        elif event in denied:
            raise PermissionError("judge: %s is not allowed" % event)
        elif event in changes and any(outside(p) for p in args[:changes[event]]):
            raise PermissionError("judge: %s outside the working folder is not allowed: %s"
                                  % (event, args[0]))

    sys.addaudithook(hook)

def _main(settings):
    _limit(resource.RLIMIT_CPU, settings["cpu_seconds"], settings["cpu_seconds"] + 1)
    _limit(resource.RLIMIT_AS, settings["memory_bytes"], settings["memory_bytes"])
    _limit(resource.RLIMIT_FSIZE, settings["output_bytes"], settings["output_bytes"])
    _limit(resource.RLIMIT_CORE, 0, 0)
    # The judge kills a run at its timeout; should the judge itself die first, the alarm
    # (default action: terminate) still ends a run that sleeps instead of using CPU.
    signal.alarm(settings["alarm_seconds"])
    os.environ["TMPDIR"] = os.getcwd()  # temporary files go where writing is allowed
    _guard(os.getcwd())
    solution = compile(settings["solution"], "solution.py", "exec", dont_inherit=True)
    if settings["entry_point"] is None:  # a stdin/stdout program: run it as a script
        exec(solution, {"__name__": "__main__", "__builtins__": __builtins__})
        return
    import traceback
    marker = settings.pop("marker")
    space = {"__name__": "solution", "__builtins__": __builtins__}
    try:
        exec(solution, space)
        exec(compile(settings["test"], "test.py", "exec", dont_inherit=True), space)
        check, candidate = space["check"], space[settings["entry_point"]]
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(__ERROR__)
    try:
        check(candidate)
        sys.stdout.write("\n" + marker + "\n")
        sys.stdout.flush()
    except AssertionError:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(__WRONG__)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(__ERROR__)
    os._exit(0)  # skip atexit handlers and threads the answer left behind
'''.replace("__ERROR__", str(ERROR_EXIT)).replace("__WRONG__", str(WRONG_ANSWER_EXIT))


@attrs.frozen
class Limits:
    timeout: float = 10.0  # wall-clock seconds per test case
    memory_mb: int = 1024
    output_mb: int = 16  # stdout, stderr and any file written


@attrs.frozen
class Run:
    """One test case ready to run: the harness program and what to feed it."""

    program: str
    stdin: str = ""
    expected: str | None = None  # the expected stdout of a stdin/stdout case
    marker: str | None = None  # printed by a test program that passed


@attrs.frozen
class Outcome:
    """What happened to a run, as a judge saw it."""

    exit_code: int | None = None  # negative: killed by that signal
    timed_out: bool = False
    stdout: str = ""
    stderr: str = ""
    seconds: float = 0.0
    api_error: str | None = None  # the judge could not run it; the cause


def solution_source(tests: Tests, code: str) -> str:
    return tests.prefix + code if isinstance(tests, ProgramTests) else code


def build_runs(tests: Tests, code: str, limits: Limits) -> list[Run]:
    settings = {
        "solution": solution_source(tests, code),
        "cpu_seconds": math.ceil(limits.timeout) + 1,  # the wall clock should stop it first
        "alarm_seconds": math.ceil(limits.timeout) + 5,
        "memory_bytes": limits.memory_mb << 20,
        "output_bytes": limits.output_mb << 20,
        "entry_point": None,
    }
    if isinstance(tests, StdioTests):
        program = _program(settings)
        return [Run(program, stdin, expected) for stdin, expected in
                zip(tests.inputs, tests.outputs)]
    marker = f"rollout-judge-passed-{secrets.token_hex(16)}"
    settings.update(test=tests.test, entry_point=tests.entry_point, marker=marker)
    return [Run(_program(settings), marker=marker)]


def _program(settings: dict) -> str:
    return f"{HARNESS}\n_main({settings!r})\n"


def classify(run: Run, outcome: Outcome) -> CaseResult:
    def result(status: str, detail: str = "") -> CaseResult:
        return CaseResult(status, round(outcome.seconds, 4), detail[-DETAIL_CHARS:])

    if outcome.api_error is not None:
        return result("api_error", outcome.api_error)
    code = outcome.exit_code
    if outcome.timed_out or code in (-signal.SIGXCPU, 128 + signal.SIGXCPU):
        return result("timeout", outcome.stderr or "time limit exceeded")
    if run.marker is not None:  # a test program
        if code == 0 and outcome.stdout.rstrip().endswith(run.marker):
            return result("success")
        if code == WRONG_ANSWER_EXIT:
            return result("wrong_answer", outcome.stderr)
        if code == 0:
            return result("runtime_error", "exited before the tests finished")
        return result("runtime_error", _exit_detail(code, outcome.stderr))
    if code != 0:
        return result("runtime_error", _exit_detail(code, outcome.stderr))
    if same_output(outcome.stdout, run.expected or ""):
        return result("success")
    return result("wrong_answer", f"expected {run.expected[:500]!r}, got {outcome.stdout[:500]!r}")


def same_output(got: str, expected: str) -> bool:
    """Equal up to trailing spaces on each line and trailing blank lines."""
    def normal(text: str) -> list[str]:
        return [line.rstrip() for line in text.rstrip().splitlines()]

    return normal(got) == normal(expected)


def _exit_detail(code: int | None, stderr: str) -> str:
    if code is not None and code < 0:
        try:
            why = f"killed by {signal.Signals(-code).name}"
        except ValueError:
            why = f"killed by signal {-code}"
    else:
        why = f"exit status {code}"
    return f"{why}\n{stderr}" if stderr else why
