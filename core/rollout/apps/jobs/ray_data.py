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

from rollout.apps.jobs.config import GenerateConfig
from rollout.apps.jobs.summary import Summary, count
from rollout.apps.jobs.tables import (ANSWER_COLUMN, PROMPT_COLUMN, fingerprint, joined,
                                      outputs_of, read_metadata, to_request)
from rollout.apps.parts import Parts, atomic_write_table
from rollout.contract import convert
from rollout.contract.errors import InvalidRequestError, RolloutError
from rollout.contract.schemas import Completion, SamplingParams
from rollout.service.ray_placement import RayPlacement

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
            metadata = read_metadata(file)
            for index in range(metadata.num_row_groups):
                group_rows = metadata.row_group(index).num_rows
                if group_rows:
                    groups.append((file, index, rows, group_rows))
                    first_chunks.append(chunks)
                    chunks += -(-group_rows // chunk_size)
                    rows += group_rows
        return cls(tuple(groups), chunk_size, tuple(first_chunks), chunks, rows)

    def locate(self, chunk: int) -> tuple[str, int, int, int, int]:
        """A chunk's file, row group, offset in it, rows, and first row in the input."""
        at = bisect.bisect_right(self.first_chunks, chunk) - 1
        file, group, first, group_rows = self.groups[at]
        offset = (chunk - self.first_chunks[at]) * self.chunk_size
        return file, group, offset, min(self.chunk_size, group_rows - offset), first + offset

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
        file, group, offset, rows, start = self.plan.locate(chunk)
        part = self.folder / f"part-{start:09d}.parquet"
        started = time.monotonic()
        if part.exists():  # Ray retried a chunk that an actor had finished before it died
            return _counts(start, [], started)
        table = self._read(file, group).slice(offset, rows)
        completions: list = [None] * rows
        requests = []
        for i, prompt in enumerate(table.column(PROMPT_COLUMN).to_pylist()):
            try:
                requests.append((i, to_request(start + i, prompt, self.sampling)))
            except RolloutError as exc:
                completions[i] = Completion(f"row-{start + i}", error=exc)
        for (i, _), completion in zip(requests, self.rollout.generate(
                [request for _, request in requests])):
            completions[i] = completion
        atomic_write_table(part, joined(table, outputs_of(completions)))
        return _counts(start, completions, started)

    def _read(self, file: str, group: int):
        import pyarrow.parquet as pq

        if self._group[0] != (file, group):
            self._group = ((file, group), pq.ParquetFile(file).read_row_group(group))
        return self._group[1]


def _counts(start: int, completions: list[Completion], started: float) -> dict:
    """A chunk's counts for the driver's summary: a row of flat columns, so its errors by
    kind go as JSON."""
    counts = count(completions)
    return {**counts, "start": start, "errors_by_kind": json.dumps(counts["errors_by_kind"]),
            "seconds": time.monotonic() - started}


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
        summary = Summary(self.plan.rows, output=str(self.parts.folder))
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
                summary.add_counts({**row, "errors_by_kind": json.loads(row["errors_by_kind"])})
                summary.times.append(float(row["seconds"]))
        summary.stop()
        if self._has_answers():
            # Over the whole output, earlier runs' chunks included: a part at a time, so
            # the driver never holds the output.
            import pyarrow.parquet as pq

            for part in sorted(self.parts.folder.glob("part-*.parquet")):
                summary.add_answers(pq.read_table(part, columns=[ANSWER_COLUMN, "responses"]))
        return summary.finish("chunk_seconds", ("p50", "p90", "max"),
                              rows_this_run=summary.counts["rows"],
                              chunks_this_run=len(todo))

    def _has_answers(self) -> bool:
        import pyarrow.parquet as pq

        return ANSWER_COLUMN in pq.read_schema(self.plan.groups[0][0]).names \
            if self.plan.groups else False
