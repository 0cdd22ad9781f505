"""What the jobs read and write: the input parquet (read and checked once for all three
jobs), a prompt cell as a request, a completion as output columns, the right answers in an
output, and the settings a job's parts must agree on to be resumed."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import attrs

from rollout.apps.jobs.config import GenerateConfig
from rollout.contract import convert
from rollout.contract.errors import InvalidRequestError
from rollout.contract.schemas import Completion, Message, Request, SamplingParams

PROMPT_COLUMN = "prompt"
ANSWER_COLUMN = "answer"  # optional: the summary then counts the responses that give it
OUTPUT_COLUMNS = ("responses", "response_token_ids", "prompt_tokens", "completion_tokens",
                  "finish_reasons", "error")


def check_columns(path: str, names: Iterable[str], outputs: Iterable[str],
                  prompt: bool = True) -> None:
    """An input's column names: a prompt column where the job reads one, and none of the
    columns the job adds (a table's names, or a schema's when only metadata is read)."""
    names = list(names)
    if prompt and PROMPT_COLUMN not in names:
        raise InvalidRequestError("input", f"{path} has no {PROMPT_COLUMN!r} column",
                                  f"a {PROMPT_COLUMN!r} column; it has {', '.join(names)}")
    clash = [c for c in outputs if c in names]
    if clash:
        raise InvalidRequestError("input", f"{path} already has output columns {clash}")


def read_input(path: str, outputs: Iterable[str] = OUTPUT_COLUMNS, prompt: bool = True):
    """The whole input table, its columns checked."""
    import pyarrow.parquet as pq

    table = _parquet(pq.read_table, path)
    check_columns(path, table.column_names, outputs, prompt)
    return table


def read_metadata(path: str, outputs: Iterable[str] = OUTPUT_COLUMNS):
    """One input file's parquet metadata (its row groups), its columns checked, without
    reading its rows: for a dataset larger than the driver should hold."""
    import pyarrow.parquet as pq

    parquet = _parquet(pq.ParquetFile, path)
    check_columns(path, parquet.schema_arrow.names, outputs)
    return parquet.metadata


def _parquet(read, path: str):
    try:
        return read(path)
    except Exception as exc:  # pyarrow's errors for a missing or broken file vary
        raise InvalidRequestError("input", f"cannot read {path} as parquet: {exc}") from None


def to_request(row: int, prompt: Any, sampling: SamplingParams) -> Request:
    """A parquet cell (text, or a list of {role, content}) as a request."""
    if sampling.seed is not None:
        sampling = attrs.evolve(sampling, seed=sampling.seed + row)  # distinct per prompt
    rid = f"row-{row}"
    if isinstance(prompt, str):
        return Request(id=rid, prompt=prompt, sampling=sampling)
    if isinstance(prompt, (list, tuple)):
        messages = convert.structure(_without_nulls(list(prompt)), tuple[Message, ...])
        return Request(id=rid, messages=messages, sampling=sampling)
    raise InvalidRequestError(PROMPT_COLUMN, f"got {type(prompt).__name__}",
                              "text or a list of chat messages")


def _without_nulls(value):
    """A parquet cell's messages without the null fields that Arrow gives every struct of a
    column (a text part's `image`, an image part's `text`)."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, (list, tuple)):
        return [_without_nulls(v) for v in value]
    return value


def output_row(completion: Completion) -> dict:
    if not completion.ok:
        return {"responses": None, "response_token_ids": None, "prompt_tokens": None,
                "completion_tokens": None, "finish_reasons": None,
                "error": str(completion.error)}
    results = completion.results
    return {
        "responses": [r.text for r in results],
        "response_token_ids": [list(r.token_ids) for r in results],
        "prompt_tokens": results[0].prompt_tokens,
        "completion_tokens": [r.completion_tokens for r in results],
        "finish_reasons": [r.finish_reason for r in results],
        "error": None,
    }


def output_schema():
    import pyarrow as pa

    return pa.schema([
        ("responses", pa.list_(pa.string())),
        ("response_token_ids", pa.list_(pa.list_(pa.int64()))),
        ("prompt_tokens", pa.int64()),
        ("completion_tokens", pa.list_(pa.int64())),
        ("finish_reasons", pa.list_(pa.string())),
        ("error", pa.string()),
    ])


def outputs_of(completions: list[Completion]):
    """Completions as a table of the output columns."""
    import pyarrow as pa

    return pa.Table.from_pylist([output_row(c) for c in completions], schema=output_schema())


def joined(table, outputs, names: Iterable[str] | None = None):
    """`table` with the columns `names` (all by default) of `outputs`, row for row."""
    for name in outputs.column_names if names is None else names:
        table = table.append_column(name, outputs.column(name))
    return table


def answer_counts(table) -> dict:
    """Where the prompts carry an `answer`: how many responses give it (see
    rollout.apps.datasets.sums.is_right)."""
    if ANSWER_COLUMN not in table.column_names:
        return {}
    from rollout.apps.datasets.sums import is_right

    checked = right = 0
    for answer, responses in zip(table.column(ANSWER_COLUMN).to_pylist(),
                                 table.column("responses").to_pylist()):
        if answer is None:
            continue
        for text in responses or [None]:  # a failed row counts as a wrong answer
            checked += 1
            right += text is not None and is_right(text, answer)
    return {"answers": {"checked": checked, "right": right,
                        "accuracy": round(right / checked, 4) if checked else None}}


def fingerprint(config: GenerateConfig, rows: int) -> dict:
    """What a job's parts must agree on to be resumed."""
    return {"input": os.path.abspath(config.input), "rows": rows, "model": config.model,
            "backend": config.backend, "server": config.server,
            "chunk_size": config.chunk_size, "sampling": convert.unstructure(config.sampling)}
