"""What a judge takes (a sample: a response and its problem's tests) and what it gives back
(a verdict per sample, a result per test case)."""

from __future__ import annotations

import json
from typing import Any, Union

import attrs

from rollout.contract.errors import InvalidRequestError

# Every status a sample can get. A test case gets one of the first four or api_error; the
# sample-only ones (syntax_error, no_code) mean that no test ran.
STATUSES = ("success", "wrong_answer", "runtime_error", "timeout", "syntax_error", "no_code",
            "api_error")
TESTS_SHAPES = '{"inputs": [...], "outputs": [...]} or {"test": ..., "entry_point": ...}'


def _nonempty(instance, attribute, value):
    if not value:
        raise InvalidRequestError(attribute.name, "must not be empty")


@attrs.frozen
class StdioTests:
    """Each case feeds `inputs[i]` to the program's stdin and expects `outputs[i]` on stdout."""

    inputs: tuple[str, ...] = attrs.field(validator=_nonempty)
    outputs: tuple[str, ...]
    whole_response: bool = False  # the code is the whole response, not a fenced block

    def __attrs_post_init__(self):
        if len(self.inputs) != len(self.outputs):
            raise InvalidRequestError("outputs", f"{len(self.outputs)} outputs for "
                                      f"{len(self.inputs)} inputs", "one output per input")


@attrs.frozen
class ProgramTests:
    """One case: `test` defines `check(candidate)`, called with the answer's `entry_point`.

    `prefix` (HumanEval's prompt: imports, helpers, the signature) is put before the answer,
    so an answer may be the whole function or only its body.
    """

    test: str = attrs.field(validator=_nonempty)
    entry_point: str = attrs.field(validator=_nonempty)
    prefix: str = ""
    whole_response: bool = False


Tests = Union[StdioTests, ProgramTests]


def parse_tests(cell: Any) -> Tests:
    """A `tests` cell (a JSON string, or a mapping from a parquet struct) as test specs."""
    from rollout.contract import convert

    if isinstance(cell, (str, bytes)):
        try:
            cell = json.loads(cell)
        except json.JSONDecodeError as exc:
            raise InvalidRequestError("tests", f"not valid JSON: {exc}", TESTS_SHAPES) from None
    if not isinstance(cell, dict):
        raise InvalidRequestError("tests", f"got {type(cell).__name__}", TESTS_SHAPES)
    cell = {k: v for k, v in cell.items() if v is not None}  # struct columns fill gaps with None
    cls = ProgramTests if "test" in cell else StdioTests if "inputs" in cell else None
    if cls is None:
        raise InvalidRequestError("tests", f"has neither 'test' nor 'inputs' (keys: "
                                  f"{', '.join(cell) or 'none'})", TESTS_SHAPES)
    try:
        return convert.structure(cell, cls)
    except InvalidRequestError as exc:
        raise InvalidRequestError(f"tests.{exc.field}", exc.detail, exc.allowed) from None


@attrs.frozen
class Sample:
    response: str
    tests: Tests


@attrs.frozen
class CaseResult:
    status: str
    seconds: float = 0.0
    detail: str = ""  # why it failed: the end of stderr, the expected output, the cause


@attrs.frozen
class Verdict:
    """The judgement of one sample. `status` is api_error if any case is (the verdict is then
    not trustworthy), success if every case passed, else the first failing case's status."""

    status: str
    cases: tuple[CaseResult, ...] = ()
    code: str | None = None  # what was judged: the extracted code
    detail: str = ""

    @property
    def pass_ratio(self) -> float:
        if not self.cases:
            return 0.0
        return sum(c.status == "success" for c in self.cases) / len(self.cases)

    @classmethod
    def of_cases(cls, cases: list[CaseResult], code: str) -> Verdict:
        failed = [c for c in cases if c.status != "success"]
        api = [c for c in failed if c.status == "api_error"]
        first = (api or failed or [None])[0]
        if first is None:
            return cls("success", tuple(cases), code)
        return cls(first.status, tuple(cases), code, first.detail)
