"""HumanEval canonical solutions, and variants of them made wrong in known ways, as the
responses a model would give; shared by the local and SandboxFusion judge tests."""

from __future__ import annotations

import functools
import secrets

from rollout.apps.datasets.humaneval import load_problems
from rollout.apps.judges import ProgramTests, Sample

# Lines put at the start of the function body, and the status each must get.
BROKEN = {
    "crashing": ("    raise RuntimeError('boom')\n", "runtime_error"),
    "looping": ("    while True:\n        pass\n", "timeout"),
    "memory_hungry": ("    hog = []\n    while True:\n        hog.append(bytearray(1 << 20))\n",
                      "runtime_error"),
    "network": ("    import socket\n    socket.create_connection(('127.0.0.1', 80), timeout=2)\n",
                "runtime_error"),
    "wrong": ("    return None\n", "wrong_answer"),
}
ESCAPE_PATH = f"/tmp/rollout-judge-escape-{secrets.token_hex(4)}"
BROKEN["writes_outside"] = (f"    open({ESCAPE_PATH!r}, 'w').write('out')\n", "runtime_error")
# Problems the variants are made of: spread over the set, and ones where `return None`
# fails an assertion (rather than a TypeError first).
VARIANT_PROBLEMS = (0, 12, 22, 51, 100, 163)


@functools.lru_cache(maxsize=1)
def problems() -> list[dict]:
    return load_problems()


def tests_of(problem: dict) -> ProgramTests:
    return ProgramTests(problem["test"], problem["entry_point"], problem["prompt"])


def fenced(code: str) -> str:
    return f"Here it is:\n```python\n{code}```\nDone."


def canonical(problem: dict) -> Sample:
    return Sample(fenced(problem["prompt"] + problem["canonical_solution"]), tests_of(problem))


def broken(problem: dict, kind: str) -> Sample:
    if kind == "syntax":
        return Sample(fenced(problem["prompt"] + problem["canonical_solution"] + "    return (\n"),
                      tests_of(problem))
    head, _ = BROKEN[kind]
    return Sample(fenced(problem["prompt"] + head + problem["canonical_solution"]),
                  tests_of(problem))


def expected(kind: str) -> str:
    return "syntax_error" if kind == "syntax" else BROKEN[kind][1]


KINDS = (*BROKEN, "syntax")
