"""Judges: they run generated code against a problem's tests and say how it did.

Judges are plugins in the entry-point group `rollout.judges`, like backends: `local`
(child processes on this machine) and `sandbox-fusion` (a SandboxFusion server) ship with
the core. A judge is a class built from keyword options whose `judge(samples)` returns one
`Verdict` per `Sample`; subclassing `rollout.apps.judges.base.Judge` gives all but the running
of one test case.
"""

from __future__ import annotations

from rollout.apps.judges.verdicts import (
    STATUSES,
    CaseResult,
    ProgramTests,
    Sample,
    StdioTests,
    Verdict,
    parse_tests,
)

DEFAULT_JUDGE = "local"

__all__ = ["DEFAULT_JUDGE", "STATUSES", "CaseResult", "ProgramTests", "Sample", "StdioTests",
           "Verdict", "available_judges", "load_judge", "parse_tests"]


def available_judges() -> list[str]:
    from rollout.contract.plugins import JUDGE_GROUP, installed

    return list(installed(JUDGE_GROUP))


def load_judge(name: str = DEFAULT_JUDGE, **options):
    """The judge called `name`, built with `options` (InvalidRequestError if either is bad)."""
    from rollout.contract.errors import InvalidRequestError
    from rollout.contract.plugins import JUDGE_GROUP, installed, load_one

    found = installed(JUDGE_GROUP)
    if name not in found:
        raise InvalidRequestError("judge", f"no judge named {name!r} is installed",
                                  ", ".join(found) or "none installed")
    return load_one("judge", name, found[name])(**options)
