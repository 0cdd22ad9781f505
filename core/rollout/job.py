"""`rollout generate`: prompts from parquet to responses in parquet, resumable.

Results are written chunk by chunk into `OUTPUT.parts/` as they finish; a run that is
killed and started again with the same settings skips the chunks already written, and the
last step joins the parts into OUTPUT. Rows whose prompt is bad carry an error and do not
stop the others.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import attrs

from rollout import convert
from rollout.errors import InvalidRequestError, RolloutError
from rollout.schemas import Completion, Message, Request, SamplingParams

PROMPT_COLUMN = "prompt"
OUTPUT_COLUMNS = ("responses", "response_token_ids", "prompt_tokens", "completion_tokens",
                  "finish_reasons", "error")


@attrs.frozen
class GenerateConfig:
    backend: str
    model: str
    input: str
    output: str
    sampling: SamplingParams = attrs.field(factory=SamplingParams)
    backend_options: dict = attrs.field(factory=dict)
    chunk_size: int = 256

    def __attrs_post_init__(self):
        if not isinstance(self.chunk_size, int) or self.chunk_size < 1:
            raise InvalidRequestError("chunk_size", f"got {self.chunk_size!r}", "an integer >= 1")


def load_config(path: str | None, overrides: dict[str, Any]) -> GenerateConfig:
    """Settings from a YAML file, then from the command line (which wins)."""
    data: dict = {}
    if path:
        import yaml

        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise InvalidRequestError("config", f"cannot read {path}: {exc}") from None
        if not isinstance(data, dict):
            raise InvalidRequestError("config", f"{path} is not a mapping of settings")
    sampling = dict(data.get("sampling") or {})
    for key, value in overrides.items():
        if value is None:
            continue
        if key in attrs.fields_dict(SamplingParams):
            sampling[key] = value
        else:
            data[key] = value
    data["sampling"] = sampling
    for key in ("backend", "model", "input", "output"):
        if key not in data:
            raise InvalidRequestError(key, "missing", f"--{key} or `{key}:` in the config file")
    return convert.structure(data, GenerateConfig)


def read_prompts(path: str):
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as exc:
        raise InvalidRequestError("input", f"cannot read {path} as parquet: {exc}") from None
    if PROMPT_COLUMN not in table.column_names:
        raise InvalidRequestError("input", f"{path} has no {PROMPT_COLUMN!r} column",
                                  f"a {PROMPT_COLUMN!r} column; it has {', '.join(table.column_names)}")
    clash = [c for c in OUTPUT_COLUMNS if c in table.column_names]
    if clash:
        raise InvalidRequestError("input", f"{path} already has output columns {clash}")
    return table


def to_request(row: int, prompt: Any, sampling: SamplingParams) -> Request:
    """A parquet cell (text, or a list of {role, content}) as a request."""
    if sampling.seed is not None:
        sampling = attrs.evolve(sampling, seed=sampling.seed + row)  # distinct per prompt
    rid = f"row-{row}"
    if isinstance(prompt, str):
        return Request(id=rid, prompt=prompt, sampling=sampling)
    if isinstance(prompt, (list, tuple)):
        messages = convert.structure(
            [{k: v for k, v in m.items() if v is not None} if isinstance(m, dict) else m
             for m in prompt], tuple[Message, ...])
        return Request(id=rid, messages=messages, sampling=sampling)
    raise InvalidRequestError(PROMPT_COLUMN, f"got {type(prompt).__name__}",
                              "text or a list of chat messages")


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


def _output_schema():
    import pyarrow as pa

    return pa.schema([
        ("responses", pa.list_(pa.string())),
        ("response_token_ids", pa.list_(pa.list_(pa.int64()))),
        ("prompt_tokens", pa.int64()),
        ("completion_tokens", pa.list_(pa.int64())),
        ("finish_reasons", pa.list_(pa.string())),
        ("error", pa.string()),
    ])


class Job:
    def __init__(self, config: GenerateConfig):
        self.config = config
        self.output = Path(config.output)
        self.parts = self.output.with_name(self.output.name + ".parts")
        self.table = read_prompts(config.input)

    def _fingerprint(self) -> dict:
        c = self.config
        return {"input": os.path.abspath(c.input), "rows": self.table.num_rows,
                "model": c.model, "backend": c.backend, "chunk_size": c.chunk_size,
                "sampling": convert.unstructure(c.sampling)}

    def _open_parts(self) -> set[int]:
        """Chunks already done by an earlier run of this same job."""
        stamp = self.parts / "job.json"
        if stamp.exists():
            if json.loads(stamp.read_text()) != self._fingerprint():
                raise InvalidRequestError(
                    "output", f"{self.parts} holds parts of a different job",
                    f"the same settings as before, or delete {self.parts}")
        else:
            self.parts.mkdir(parents=True, exist_ok=True)
            _atomic_write(stamp, json.dumps(self._fingerprint()).encode())
        return {int(p.stem.split("-")[1]) for p in self.parts.glob("part-*.parquet")}

    def run(self, backend, progress: bool = True) -> dict:
        import pyarrow as pa
        import pyarrow.parquet as pq
        from tqdm import tqdm

        done = self._open_parts()
        size, rows = self.config.chunk_size, self.table.num_rows
        prompts = self.table.column(PROMPT_COLUMN).to_pylist()
        stats = {"prompts": rows, "samples": 0, "completion_tokens": 0, "errors": 0}
        started = time.monotonic()
        bar = tqdm(total=rows, unit="prompt", disable=not progress,
                   initial=sum(min(size, rows - s) for s in done))
        for start in range(0, rows, size):
            if start in done:
                continue
            batch, failed = [], {}
            for row in range(start, min(start + size, rows)):
                try:
                    batch.append(to_request(row, prompts[row], self.config.sampling))
                except RolloutError as exc:
                    failed[row] = Completion(f"row-{row}", error=exc)
            completions = iter(backend.generate(batch))
            ordered = [failed.get(row) or next(completions)
                       for row in range(start, min(start + size, rows))]
            out = pa.Table.from_pylist([output_row(c) for c in ordered], schema=_output_schema())
            _atomic_write_table(self.parts / f"part-{start:09d}.parquet", out, pq)
            for c in ordered:
                stats["samples"] += len(c.results)
                stats["completion_tokens"] += sum(r.completion_tokens for r in c.results)
                stats["errors"] += not c.ok
            bar.update(len(ordered))
        bar.close()
        self._join(pa, pq)
        stats["seconds"] = round(time.monotonic() - started, 3)
        stats["tokens_per_second"] = round(stats["completion_tokens"] / max(stats["seconds"], 1e-9), 1)
        return stats

    def _join(self, pa, pq) -> None:
        parts = sorted(self.parts.glob("part-*.parquet"))
        generated = pa.concat_tables([pq.read_table(p) for p in parts]) if parts else (
            _output_schema().empty_table())
        table = self.table
        for name in generated.column_names:
            table = table.append_column(name, generated.column(name))
        _atomic_write_table(self.output, table, pq)
        shutil.rmtree(self.parts)


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _atomic_write_table(path: Path, table, pq) -> None:
    tmp = path.with_name(path.name + ".tmp")
    pq.write_table(table, tmp)
    os.replace(tmp, path)
