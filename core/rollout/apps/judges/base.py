"""What every judge shares: finding and parsing the code, running the cases with bounded
concurrency, and turning outcomes into verdicts. A judge only says how to run one case."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any, TypeVar

import attrs

from rollout.contract.errors import InvalidRequestError
from rollout.apps.judges.extract import extract_code, syntax_error
from rollout.apps.judges.harness import Limits, Outcome, Run, build_runs, classify, solution_source
from rollout.apps.judges.verdicts import CaseResult, Sample, Verdict

T = TypeVar("T")


def parse_options(options: dict[str, Any], cls: type[T]) -> T:
    """A judge's options, strictly: an unknown name or a wrong type names the option."""
    from rollout.contract import convert

    try:
        return convert.structure(options, cls)
    except InvalidRequestError as exc:
        raise InvalidRequestError(f"judge_options.{exc.field}", exc.detail,
                                  exc.allowed) from None


def positive(instance, attribute, value) -> None:
    if value is not None and value <= 0:
        raise InvalidRequestError(attribute.name, f"got {value!r}", "a number > 0")


class Judge:
    """Subclasses set `name`, `limits` and `concurrency`, and implement `execute`."""

    name = "judge"
    limits: Limits
    concurrency: int

    def execute(self, run: Run) -> Outcome:
        """Run one test case; every wait in it must be bounded."""
        raise NotImplementedError

    def describe(self) -> dict:
        """What the summary records about this judge."""
        return {"name": self.name, "concurrency": self.concurrency, **attrs.asdict(self.limits)}

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def judge(self, samples: Sequence[Sample],
              progress: Callable[[int], Any] | None = None) -> list[Verdict]:
        """One verdict per sample, in order. `progress(1)` is called as each one is done."""
        verdicts: list[Verdict | None] = [None] * len(samples)
        cases: dict[int, list[CaseResult | None]] = {}
        codes: dict[int, str] = {}
        jobs: list[tuple[int, int, Run]] = []
        for i, sample in enumerate(samples):
            code = extract_code(sample.response, sample.tests.whole_response)
            why = None if code is None else syntax_error(solution_source(sample.tests, code))
            if code is None:
                verdicts[i] = Verdict("no_code", detail="no code block in the response")
            elif why:
                verdicts[i] = Verdict("syntax_error", code=code, detail=why)
            else:
                runs = build_runs(sample.tests, code, self.limits)
                cases[i], codes[i] = [None] * len(runs), code
                jobs.extend((i, j, run) for j, run in enumerate(runs))
            if verdicts[i] is not None and progress:
                progress(1)
        with ThreadPoolExecutor(self.concurrency, thread_name_prefix=f"judge-{self.name}") as pool:
            futures = {pool.submit(self._case, run): (i, j) for i, j, run in jobs}
            for future in as_completed(futures):
                i, j = futures[future]
                cases[i][j] = future.result()
                if all(c is not None for c in cases[i]):
                    verdicts[i] = Verdict.of_cases(cases[i], codes[i])
                    if progress:
                        progress(1)
        return verdicts

    def _case(self, run: Run) -> CaseResult:
        try:
            return classify(run, self.execute(run))
        except Exception as exc:  # a judge's own failure marks the case, not the batch
            return CaseResult("api_error", detail=f"judge failed: {type(exc).__name__}: {exc}")
