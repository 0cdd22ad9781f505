"""`rollout eval`: judge the responses that `rollout generate` wrote, and report the figures.

The input needs `responses` (a list of texts per row, as `rollout generate` writes them)
and `tests` (per row, see rollout.apps.judges.verdicts). The output parquet has one row per
sample; beside it go a JSON summary and a PNG bar chart of the statuses. A row whose tests
cannot be read, or that has no responses (its generation failed), is skipped with the
reason in the summary; the other rows are judged.

Verdicts are written chunk by chunk into `OUTPUT.parts/`, as `rollout generate` does: a
killed run started again with the same settings judges only what was not finished.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import attrs

from rollout.contract.errors import InvalidRequestError
from rollout.apps.parts import Parts, atomic_write, atomic_write_table
from rollout.apps.judges import DEFAULT_JUDGE, Sample, Verdict, load_judge, parse_tests
from rollout.apps.pass_at_k import summarize

REQUIRED = ("responses", "tests")
ID_COLUMNS = ("task_id", "id")  # the problem id, when the input has one; else the row number
SKIPPED_SHOWN = 20


@attrs.frozen
class EvalConfig:
    input: str
    output: str
    judge: str = DEFAULT_JUDGE
    judge_options: dict = attrs.field(factory=dict)
    summary: str | None = None  # OUTPUT with .json by default
    chart: str | None = None  # OUTPUT with .png by default; "" for none
    id_column: str | None = None
    chunk_size: int = 1024  # samples per chunk written to disk

    def __attrs_post_init__(self):
        if not isinstance(self.chunk_size, int) or self.chunk_size < 1:
            raise InvalidRequestError("chunk_size", f"got {self.chunk_size!r}", "an integer >= 1")

    @property
    def summary_path(self) -> Path:
        return Path(self.summary or Path(self.output).with_suffix(".json"))

    @property
    def chart_path(self) -> Path | None:
        if self.chart == "":
            return None
        return Path(self.chart or Path(self.output).with_suffix(".png"))


class Evaluation:
    def __init__(self, config: EvalConfig):
        """Read and check everything that can be wrong before any code runs."""
        self.config = config
        self.output = Path(config.output)
        self.table = _read(config.input)
        self.ids = self._problem_ids()
        if config.chart_path is not None:
            try:
                import matplotlib  # noqa: F401
            except ImportError:
                raise InvalidRequestError("chart", "needs matplotlib, which is not installed",
                                          "pip install 'rollout-core[eval]', or --no-chart") from None
        self.judge = load_judge(config.judge, **config.judge_options)

    def _problem_ids(self) -> list[str]:
        names = self.table.column_names
        column = self.config.id_column
        if column is not None and column not in names:
            raise InvalidRequestError("id_column", f"{self.config.input} has no {column!r} column",
                                      ", ".join(names))
        column = column or next((c for c in ID_COLUMNS if c in names), None)
        if column is None:
            return [str(row) for row in range(self.table.num_rows)]
        return [str(value) for value in self.table.column(column).to_pylist()]

    def samples(self) -> tuple[list[tuple[int, int, Sample]], list[dict]]:
        """The samples to judge as (row, index, sample), and the rows skipped, with why."""
        names = self.table.column_names
        responses = self.table.column("responses").to_pylist()
        tests = self.table.column("tests").to_pylist()
        errors = self.table.column("error").to_pylist() if "error" in names else [None] * len(tests)
        samples, skipped = [], []
        for row, (texts, cell, error) in enumerate(zip(responses, tests, errors)):
            try:
                if not texts:
                    raise InvalidRequestError("responses", f"none: {error or 'empty'}")
                spec = parse_tests(cell)
            except InvalidRequestError as exc:
                skipped.append({"row": row, "problem_id": self.ids[row], "reason": str(exc)})
                continue
            samples.extend((row, i, Sample(text or "", spec)) for i, text in enumerate(texts))
        return samples, skipped

    def _parts(self, samples: int) -> Parts:
        c = self.config
        return Parts(self.output, {
            "input": os.path.abspath(c.input), "rows": self.table.num_rows, "samples": samples,
            "judge": c.judge, "judge_options": c.judge_options, "chunk_size": c.chunk_size,
        }, "evaluation")

    def run(self, progress: bool = True) -> dict:
        import pyarrow as pa
        from tqdm import tqdm

        started = time.monotonic()
        samples, skipped = self.samples()
        parts = self._parts(len(samples))
        done = parts.open()
        size = self.config.chunk_size
        resumed = sum(min(size, len(samples) - start) for start in done)
        with self.judge, tqdm(total=len(samples), initial=resumed, unit="sample",
                              disable=not progress) as bar:
            for start in range(0, len(samples), size):
                if start in done:
                    continue
                chunk = samples[start:start + size]
                verdicts = self.judge.judge([s for _, _, s in chunk], progress=bar.update)
                rows = [self._row(row, index, v) for (row, index, _), v in zip(chunk, verdicts)]
                parts.write(start, pa.Table.from_pylist(rows, schema=_output_schema(pa)))
        table = parts.read(_output_schema(pa))
        rows = table.to_pylist()
        by_problem: dict[int, list[str]] = {}
        for r in rows:
            by_problem.setdefault(r["row"], []).append(r["status"])
        seconds = time.monotonic() - started
        summary = {
            **summarize(list(by_problem.values()), [r["pass_ratio"] for r in rows],
                        [s for r in rows for s in r["case_statuses"]]),
            "skipped_rows": len(skipped),
            "skipped": skipped[:SKIPPED_SHOWN],
            "judge": self.judge.describe(),
            "input": self.config.input,
            "output": self.config.output,
            "resumed_samples": resumed,
            "seconds": round(seconds, 3),
            "samples_per_second": round((len(rows) - resumed) / max(seconds, 1e-9), 2),
        }
        self._write(table, summary)
        parts.remove()
        return summary

    def _row(self, row: int, index: int, verdict: Verdict) -> dict:
        return {"problem_id": self.ids[row], "row": row, "sample": index,
                "status": verdict.status, "pass_ratio": verdict.pass_ratio,
                "case_statuses": [c.status for c in verdict.cases],
                "seconds": round(sum(c.seconds for c in verdict.cases), 4),
                "detail": verdict.detail, "code": verdict.code}

    def _write(self, table, summary: dict) -> None:
        for path in (self.output, self.config.summary_path, self.config.chart_path):
            if path is not None:
                path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_table(self.output, table)
        atomic_write(self.config.summary_path, (json.dumps(summary, indent=2) + "\n").encode())
        if self.config.chart_path is not None:
            status_chart(summary, self.config.chart_path)


def _read(path: str):
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as exc:
        raise InvalidRequestError("input", f"cannot read {path} as parquet: {exc}") from None
    missing = [c for c in REQUIRED if c not in table.column_names]
    if missing:
        raise InvalidRequestError(
            "input", f"{path} has no {', '.join(map(repr, missing))} column",
            f"'responses' (from rollout generate) and 'tests'; it has {', '.join(table.column_names)}")
    return table


def _output_schema(pa):
    return pa.schema([
        ("problem_id", pa.string()), ("row", pa.int64()), ("sample", pa.int64()),
        ("status", pa.string()), ("pass_ratio", pa.float64()),
        ("case_statuses", pa.list_(pa.string())), ("seconds", pa.float64()),
        ("detail", pa.string()), ("code", pa.string()),
    ])


COLOURS = {"success": "#2e7d32", "wrong_answer": "#f9a825", "runtime_error": "#c62828",
           "timeout": "#6a1b9a", "syntax_error": "#ef6c00", "no_code": "#757575",
           "api_error": "#1565c0"}


def status_chart(summary: dict, path: Path) -> None:
    """A bar chart of how many samples got each status."""
    import matplotlib

    matplotlib.use("Agg", force=True)  # files only; no display needed
    import matplotlib.pyplot as plt

    statuses = summary["statuses"]
    figure, axes = plt.subplots(figsize=(8, 4.5), dpi=100)
    bars = axes.bar(list(statuses), list(statuses.values()),
                    color=[COLOURS.get(s, "#455a64") for s in statuses])
    axes.bar_label(bars)
    axes.set_ylabel("samples")
    axes.set_title(f"{summary['problems']} problems, {summary['samples']} samples: "
                   f"accepted@1 {summary['accepted@1']:.3f}, "
                   f"mean pass ratio {summary['mean_pass_ratio']:.3f}", fontsize=10)
    axes.tick_params(axis="x", labelrotation=20)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def report(summary: dict, out=sys.stderr) -> None:
    """The figures, for a person."""
    print(f"problems {summary['problems']}  samples {summary['samples']}  "
          f"skipped rows {summary['skipped_rows']}  ({summary['seconds']} s)", file=out)
    print(f"accepted@1 {summary['accepted@1']:.4f}  mean pass ratio "
          f"{summary['mean_pass_ratio']:.4f}  " + "  ".join(
              f"pass@{k} {v:.4f}" for k, v in summary["pass@k"].items()), file=out)
    print("statuses: " + "  ".join(f"{s} {n}" for s, n in summary["statuses"].items()), file=out)
    for skip in summary["skipped"]:
        print(f"skipped row {skip['row']} ({skip['problem_id']}): {skip['reason']}", file=out)
