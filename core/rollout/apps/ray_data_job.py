"""`rollout generate --ray-data`: the batch job on Ray Data, for datasets larger than one
process should hold.

The driver reads only the input's parquet metadata (the rows of each row group) and hands
Ray Data the numbers of the chunks not yet written. A pool of actors, each holding the
backend (one replica each), maps them: an actor reads its chunk's rows from the parquet
file (keeping the row group it read last, since chunks come in order), generates, and
writes the chunk with the input's columns and the responses as `OUTPUT/part-<first
row>.parquet`, whole or absent (a hidden name, then a rename). Only each chunk's counts
come back to the driver, so its memory stays flat whatever the dataset's size.

A run killed and started again with the same settings skips the chunks written, and a
chunk that Ray retries after its actor died is written once: no finished row is computed
again, none is lost or written twice. OUTPUT is a folder of parquet files in row order
(`pyarrow.parquet.read_table(OUTPUT)`, `ray.data.read_parquet(OUTPUT)`); on a cluster it
must be on a filesystem that every node sees.
"""

from __future__ import annotations

import bisect
import json
import time
from pathlib import Path

import attrs

from rollout.contract import convert
from rollout.contract.errors import InvalidRequestError, RolloutError
from rollout.contract.schemas import Completion, SamplingParams
from rollout.apps.job import (ANSWER_COLUMN, OUTPUT_COLUMNS, PROMPT_COLUMN, GenerateConfig,
                              answer_counts, fingerprint, output_row, output_schema,
                              to_request)
from rollout.apps.parts import Parts, atomic_write_table
from rollout.service.ray_placement import RayPlacement

COUNTS = ("rows", "samples", "completion_tokens", "errors")
MAX_BLOCKS = 4096


@attrs.frozen
class Plan:
    """Where every chunk's rows are. Chunks never cross a row group, so that a chunk is
    read from one; each is named by its first row in the whole input."""

    groups: tuple[tuple[str, int, int, int], ...]  # (file, row group, first row, rows)
    chunk_size: int
    first_chunks: tuple[int, ...]  # each group's first chunk number
    chunks: int
    rows: int

    @classmethod
    def of(cls, path: str, chunk_size: int) -> Plan:
        groups, first_chunks, chunks, rows = [], [], 0, 0
        for file in input_files(path):
            metadata = _metadata(file)
            for index in range(metadata.num_row_groups):
                count = metadata.row_group(index).num_rows
                if count:
                    groups.append((file, index, rows, count))
                    first_chunks.append(chunks)
                    chunks += -(-count // chunk_size)
                    rows += count
        return cls(tuple(groups), chunk_size, tuple(first_chunks), chunks, rows)

    def locate(self, chunk: int) -> tuple[str, int, int, int, int]:
        """A chunk's file, row group, offset in it, rows, and first row in the input."""
        at = bisect.bisect_right(self.first_chunks, chunk) - 1
        file, group, first, count = self.groups[at]
        offset = (chunk - self.first_chunks[at]) * self.chunk_size
        return file, group, offset, min(self.chunk_size, count - offset), first + offset

    def start(self, chunk: int) -> int:
        return self.locate(chunk)[4]


def input_files(path: str) -> list[str]:
    """A parquet file, or every parquet file of a folder in name order."""
    where = Path(path)
    files = sorted(str(p) for p in where.glob("*.parquet")) if where.is_dir() else [path]
    if not files:
        raise InvalidRequestError("input", f"{path} holds no .parquet file",
                                  "a parquet file, or a folder of them")
    return files


def _metadata(file: str):
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(file)
    except Exception as exc:
        raise InvalidRequestError("input", f"cannot read {file} as parquet: {exc}") from None
    names = parquet.schema_arrow.names
    if PROMPT_COLUMN not in names:
        raise InvalidRequestError("input", f"{file} has no {PROMPT_COLUMN!r} column",
                                  f"a {PROMPT_COLUMN!r} column; it has {', '.join(names)}")
    clash = [c for c in OUTPUT_COLUMNS if c in names]
    if clash:
        raise InvalidRequestError("input", f"{file} already has output columns {clash}")
    return parquet.metadata


class ChunkWriter:
    """A Ray Data actor: one replica of the backend, turning chunk numbers into parts."""

    def __init__(self, plan: Plan, folder: str, backend: str, model: str, options: dict,
                 sampling: dict):
        from rollout.api import load_backend

        self.plan, self.folder = plan, Path(folder)
        self.sampling = convert.structure(sampling, SamplingParams)
        self.rollout = load_backend(backend, model=model, **options)
        self._group = (None, None)  # the row group read last, and its table

    def __call__(self, batch: dict) -> dict:
        rows = [self.write(int(chunk)) for chunk in batch["item"]]
        return {key: [row[key] for row in rows] for key in rows[0]}

    def write(self, chunk: int) -> dict:
        file, group, offset, count, start = self.plan.locate(chunk)
        part = self.folder / f"part-{start:09d}.parquet"
        started = time.monotonic()
        if part.exists():  # Ray retried a chunk that an actor had finished before it died
            return _counts(start, [], started)
        table = self._read(file, group).slice(offset, count)
        completions: list = [None] * count
        requests = []
        for i, prompt in enumerate(table.column(PROMPT_COLUMN).to_pylist()):
            try:
                requests.append((i, to_request(start + i, prompt, self.sampling)))
            except RolloutError as exc:
                completions[i] = Completion(f"row-{start + i}", error=exc)
        for (i, _), completion in zip(requests, self.rollout.generate(
                [request for _, request in requests])):
            completions[i] = completion
        atomic_write_table(part, _with_outputs(table, completions))
        return _counts(start, completions, started)

    def _read(self, file: str, group: int):
        import pyarrow.parquet as pq

        if self._group[0] != (file, group):
            self._group = ((file, group), pq.ParquetFile(file).read_row_group(group))
        return self._group[1]


def _counts(start: int, completions: list[Completion], started: float) -> dict:
    kinds: dict[str, int] = {}
    for c in completions:
        if not c.ok:
            kind = getattr(c.error, "kind", "error")
            kinds[kind] = kinds.get(kind, 0) + 1
    return {"start": start, "rows": len(completions),
            "samples": sum(len(c.results) for c in completions),
            "completion_tokens": sum(r.completion_tokens for c in completions
                                     for r in c.results),
            "errors": sum(kinds.values()), "errors_by_kind": json.dumps(kinds),
            "seconds": time.monotonic() - started}


def _with_outputs(table, completions: list[Completion]):
    import pyarrow as pa

    outputs = pa.Table.from_pylist([output_row(c) for c in completions],
                                   schema=output_schema())
    for name in outputs.column_names:
        table = table.append_column(name, outputs.column(name))
    return table


class RayDataJob:
    """The job's driver: plans the chunks, runs the actor pool, sums what comes back."""

    def __init__(self, config: GenerateConfig):
        for name, value in (("server", config.server), ("environment", config.environment)):
            if value:
                raise InvalidRequestError(name, "not supported with --ray-data yet",
                                          "no --server or --environment with --ray-data")
        self.placement = RayPlacement.of(config.ray)
        if self.placement.strategy != "SPREAD":
            raise InvalidRequestError("ray.strategy", "Ray Data places its actors itself, "
                                      "spread over the nodes", "SPREAD (the default)")
        self.config = config
        self.plan = Plan.of(config.input, config.chunk_size)
        folder = Path(config.output)
        if folder.exists() and not folder.is_dir():
            raise InvalidRequestError("output", f"{folder} is a file; --ray-data writes a "
                                      "folder of parquet files", "a folder's path")
        self.parts = Parts(folder, fingerprint(config, self.plan.rows), "job", folder=folder)

    def run(self, options: dict, progress: bool = True) -> dict:
        import ray

        from rollout.service.ray_placement import check_fits

        placement = self.placement
        replicas = self.config.replicas or 1
        done = self.parts.open()
        todo = [c for c in range(self.plan.chunks) if self.plan.start(c) not in done]
        started = time.monotonic()
        totals = dict.fromkeys(COUNTS, 0)
        kinds: dict[str, int] = {}
        seconds: list[float] = []
        if todo:
            if not ray.is_initialized():
                ray.init(address=placement.address, log_to_driver=False)
            nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
            check_fits(placement.bundle(), replicas, placement.strategy, nodes)
            ray.data.DataContext.get_current().enable_progress_bars = progress
            # A block per chunk up to a bound: a block is what one actor task takes.
            blocks = min(len(todo), MAX_BLOCKS)
            mapped = ray.data.from_items(todo, override_num_blocks=blocks).map_batches(
                ChunkWriter, batch_size=1,
                compute=ray.data.ActorPoolStrategy(size=replicas),
                fn_constructor_kwargs={
                    "plan": self.plan, "folder": str(self.parts.folder),
                    "backend": self.config.backend, "model": self.config.model,
                    "options": options, "sampling": convert.unstructure(self.config.sampling)},
                **placement.actor_options())
            for row in mapped.iter_rows():
                for key in COUNTS:
                    totals[key] += int(row[key])
                for kind, count in json.loads(row["errors_by_kind"]).items():
                    kinds[kind] = kinds.get(kind, 0) + count
                seconds.append(float(row["seconds"]))
        elapsed = time.monotonic() - started
        stats = {"prompts": self.plan.rows, "output": str(self.parts.folder),
                 "samples": totals["samples"],
                 "completion_tokens": totals["completion_tokens"], "errors": totals["errors"],
                 "seconds": round(elapsed, 3),
                 "tokens_per_second": round(totals["completion_tokens"] / max(elapsed, 1e-9), 1),
                 "rows_this_run": totals["rows"], "chunks_this_run": len(todo),
                 "chunk_seconds": _percentiles(seconds), "errors_by_kind": kinds}
        if self._has_answers():
            stats["answers"] = self._answers()
        return stats

    def _has_answers(self) -> bool:
        import pyarrow.parquet as pq

        return ANSWER_COLUMN in pq.read_schema(self.plan.groups[0][0]).names \
            if self.plan.groups else False

    def _answers(self) -> dict:
        """Over the whole output, earlier runs' chunks included: a part at a time."""
        import pyarrow.parquet as pq

        checked = right = 0
        for part in sorted(self.parts.folder.glob("part-*.parquet")):
            found = answer_counts(pq.read_table(part, columns=[ANSWER_COLUMN, "responses"]))
            checked += found["answers"]["checked"]
            right += found["answers"]["right"]
        return {"checked": checked, "right": right,
                "accuracy": round(right / checked, 4) if checked else None}


def _percentiles(values: list[float]) -> dict:
    ordered = sorted(values)

    def at(q: float) -> float | None:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 4) \
            if ordered else None

    return {"p50": at(0.5), "p90": at(0.9), "max": at(1.0)}
