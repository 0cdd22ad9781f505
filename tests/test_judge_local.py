"""The local judge against HumanEval and against answers that misbehave."""

import ctypes
import os
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from humaneval_variants import (ESCAPE_PATH, KINDS, VARIANT_PROBLEMS, broken, canonical,
                                expected, problems)
from rollout.contract.errors import InvalidRequestError
from rollout.apps.judges import STATUSES, ProgramTests, Sample, StdioTests, load_judge
from rollout.apps.judges.local import isolation

PR_SET_CHILD_SUBREAPER = 36
# The judge's timeout is wall-clock: a case that ends by itself gets this much, so that a
# starved machine never turns it into a timeout.
ENDS_S = 120.0


def test_accepts_all_164_canonical_solutions(tmp_path):
    judge = load_judge("local", timeout=ENDS_S, work_root=str(tmp_path))
    verdicts = judge.judge([canonical(p) for p in problems()])
    failed = {p["task_id"]: v.detail for p, v in zip(problems(), verdicts) if v.status != "success"}
    assert len(verdicts) == 164 and not failed, failed
    assert all(v.pass_ratio == 1.0 for v in verdicts)
    assert not list(tmp_path.iterdir())


def judged(cases, timeout: float, work_root) -> list:
    judge = load_judge("local", timeout=timeout, memory_mb=256, work_root=str(work_root))
    return judge.judge([broken(problems()[i], kind) for i, kind in cases])


def test_broken_variants_get_the_right_status(tmp_path):
    # The timeout is wall-clock: only the loops, which never end, are judged under a short
    # one. Every other case ends by itself, so a starved machine must not make it a timeout.
    loops = [(i, "looping") for i in VARIANT_PROBLEMS]
    ending = [(i, kind) for i in VARIANT_PROBLEMS for kind in KINDS if kind != "looping"]
    cases = loops + ending
    verdicts = judged(loops, 1.5, tmp_path) + judged(ending, ENDS_S, tmp_path)
    wrong = [(problems()[i]["task_id"], kind, v.status, v.detail[-200:])
             for (i, kind), v in zip(cases, verdicts) if v.status != expected(kind)]
    assert not wrong, wrong
    by_kind = {kind: v for (_, kind), v in zip(cases, verdicts)}
    assert "MemoryError" in by_kind["memory_hungry"].detail
    assert "not allowed" in by_kind["writes_outside"].detail
    assert not Path(ESCAPE_PATH).exists()
    assert "SyntaxError" in by_kind["syntax"].detail
    assert not list(tmp_path.iterdir())


def test_the_platform_isolates_the_network_here():
    # This machine allows namespaces (root in a sandbox); elsewhere the judge falls back.
    prefix, what = isolation()
    if not prefix:
        pytest.skip(f"no namespaces on this machine: {what}")
    assert "network" in what


def test_stdin_stdout_cases_and_sample_status():
    judge = load_judge("local", timeout=ENDS_S)  # every case ends by itself
    echo_double = "```python\nx = int(input())\nprint(x * 2)\n```"
    tests = StdioTests(inputs=("3\n", "4\n", "oops\n"), outputs=("6\n", "9", "0"))
    verdict = judge.judge([Sample(echo_double, tests)])[0]
    assert [c.status for c in verdict.cases] == ["success", "wrong_answer", "runtime_error"]
    assert verdict.status == "wrong_answer"  # the first failing case
    assert verdict.pass_ratio == pytest.approx(1 / 3)
    whole = StdioTests(inputs=("5",), outputs=("10  \n\n",), whole_response=True)
    assert judge.judge([Sample("x = int(input())\nprint(x * 2)", whole)])[0].status == "success"
    # A stdin/stdout program may end itself with status 0 after printing its answer.
    exits = "```python\nimport sys\nprint(10)\nsys.exit(0)\n```"
    assert judge.judge([Sample(exits, StdioTests(("",), ("10",)))])[0].status == "success"


def test_an_answer_cannot_pass_by_leaving_early():
    tests = ProgramTests("def check(f):\n    assert f() == 1\n", "f")
    for code in ("import os\nos._exit(0)", "import sys\nsys.exit(0)",
                 "def f():\n    raise SystemExit(0)"):
        verdict = load_judge("local", timeout=ENDS_S).judge(
            [Sample(f"```python\n{code}\n```", tests)])[0]
        assert verdict.status == "runtime_error", (code, verdict)


def test_no_code_and_writes_inside_the_folder(tmp_path):
    tests = ProgramTests("def check(f):\n    assert f() == 'x'\n", "f")
    writes = ("```python\ndef f():\n    with open('note.txt', 'w') as out:\n        out.write('x')\n"
              "    return open('note.txt').read()\n```")
    verdicts = load_judge("local", timeout=ENDS_S).judge([Sample("I cannot do that.", tests),
                                          Sample("```\n\n```", tests), Sample(writes, tests)])
    assert [v.status for v in verdicts] == ["no_code", "no_code", "success"]


@pytest.mark.parametrize("options, field", [
    ({"timeout": 0}, "judge_options.timeout"),
    ({"colour": "red"}, "judge_options.colour"),
    ({"memory_mb": "lots"}, "judge_options.memory_mb"),
])
def test_bad_options_name_the_option(options, field):
    with pytest.raises(InvalidRequestError) as info:
        load_judge("local", **options)
    assert info.value.field == field


def test_unknown_judge_lists_the_installed_ones():
    with pytest.raises(InvalidRequestError) as info:
        load_judge("docker")
    assert info.value.field == "judge" and "local, sandbox-fusion" in str(info.value)


FRAGMENTS = [
    "def f(x):\n    return x", "while True:\n    pass", "import os\nos._exit(3)",
    "import sys\nsys.exit(1)", "print('x' * 100000)", "raise ValueError('no')",
    "import os\nos.fork()", "import subprocess\nsubprocess.Popen(['sleep', '30'])",
    "import time\ntime.sleep(30)", "open('/tmp/../tmp/rollout-hyp', 'w')",
    "open('here.txt', 'w').write('ok')", "def f(x):\n    return f(x)", "x = [0] * (1 << 40)",
    "import threading\nthreading.Thread(target=lambda: __import__('time').sleep(30)).start()",
    "def f(:", "\x00", "  indented = 1", "import socket\nsocket.socket().bind(('', 0))",
    "input()", "import signal\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)",
]
codes = st.one_of(st.text(max_size=120),
                  st.lists(st.sampled_from(FRAGMENTS), min_size=1, max_size=3).map("\n".join))


@pytest.fixture
def subreaper():
    """Orphans of the judge's children are re-parented to this process, where they can be
    seen: the children of this process after a judge call are what it left behind."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        pytest.skip("cannot become a child subreaper here")
    yield
    libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)


def children() -> list[int]:
    pids = []
    for task in Path("/proc/self/task").iterdir():
        try:
            pids += [int(p) for p in (task / "children").read_text().split()]
        except FileNotFoundError:  # that thread ended since the listing
            continue
    return pids


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(code=codes, fenced=st.booleans(), stdio=st.booleans())
def test_any_code_gets_a_status_and_leaves_nothing_behind(subreaper, tmp_path, code, fenced, stdio):
    root = tmp_path / "cases"
    root.mkdir(exist_ok=True)
    tests = (StdioTests(("1\n",), ("1\n",), whole_response=not fenced) if stdio else
             ProgramTests("def check(c):\n    assert c(1) == 1\n", "f", whole_response=not fenced))
    response = f"```python\n{code}\n```" if fenced else code
    judge = load_judge("local", timeout=0.5, memory_mb=256, output_mb=1, work_root=str(root))
    verdict = judge.judge([Sample(response, tests)])[0]
    assert verdict.status in STATUSES and verdict.status != "api_error", verdict
    assert all(c.status in STATUSES for c in verdict.cases)
    assert list(root.iterdir()) == []
    deadline = time.monotonic() + 60  # the kernel may take a moment to take them down
    while children() and time.monotonic() < deadline:
        for pid in children():
            try:
                os.waitpid(pid, os.WNOHANG)  # reap what died; what lives stays a child
            except ChildProcessError:
                pass
        time.sleep(0.05)
    assert children() == []
    assert not Path("/tmp/rollout-hyp").exists()
