"""`rollout generate`: prompts from parquet to responses in parquet, resumable.

Results are written chunk by chunk into `OUTPUT.parts/` as they finish; a run that is
killed and started again with the same settings skips the chunks already written, and the
last step joins the parts into OUTPUT. Rows whose prompt is bad carry an error and do not
stop the others.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import attrs

from rollout.contract import convert
from rollout.contract.errors import InvalidRequestError, RolloutError
from rollout.apps.parts import Parts, atomic_write_table
from rollout.contract.schemas import Completion, Message, Request, SamplingParams
from rollout.service.backoff import patiently
from rollout.service.service import Service

PROMPT_COLUMN = "prompt"
ANSWER_COLUMN = "answer"  # optional: the summary then counts the responses that give it
OUTPUT_COLUMNS = ("responses", "response_token_ids", "prompt_tokens", "completion_tokens",
                  "finish_reasons", "error")


@attrs.frozen
class GenerateConfig:
    """Where the job runs (see rollout.service.connect for the modes): a backend in this
    process (the default), `replicas` processes of it (placed locally or by Ray), or a
    running `rollout serve` at `server`."""

    input: str
    output: str
    backend: str | None = None
    model: str | None = None
    sampling: SamplingParams = attrs.field(factory=SamplingParams)
    backend_options: dict = attrs.field(factory=dict)
    chunk_size: int = 256
    mode: str | None = None
    replicas: int | None = None
    placement: str = "local"
    ray: dict = attrs.field(factory=dict)  # RayPlacement's fields, with placement ray
    # The job on Ray Data (rollout.apps.ray_data_job): `replicas` actors each hold the
    # backend, and `output` is a folder of parquet parts.
    ray_data: bool = False
    server: str | None = None
    api_key: str | None = None
    in_flight: int | None = None
    # Trajectories instead of single responses (rollout.apps.agents.job): an environment by
    # entry-point name or module:object, its options, and AgentConfig's limits.
    environment: str | None = None
    environment_options: dict = attrs.field(factory=dict)
    agent: dict = attrs.field(factory=dict)

    def __attrs_post_init__(self):
        for name in ("chunk_size", "in_flight", "replicas"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise InvalidRequestError(name, f"got {value!r}", "an integer >= 1")
        if self.placement not in ("local", "ray"):
            raise InvalidRequestError("placement", f"got {self.placement!r}", "local, ray")
        if self.ray:
            from rollout.service.ray_placement import RayPlacement

            RayPlacement.of(self.ray)  # its errors name the setting, before anything starts
        if self.ray_data and self.mode not in (None, "standalone"):
            raise InvalidRequestError("mode", f"{self.mode} with ray_data, whose replicas "
                                      "are Ray Data's actors", "standalone, or no mode")
        if self.server and self.replicas:
            raise InvalidRequestError("server", "given with replicas",
                                      "either --server URL or --replicas N")
        if not self.server:
            for key in ("backend", "model"):
                if getattr(self, key) is None:
                    raise InvalidRequestError(key, "missing",
                                              f"--{key} or `{key}:` in the config file")


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
    for key in ("input", "output"):
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


class Job:
    def __init__(self, config: GenerateConfig):
        self.config = config
        self.output = Path(config.output)
        self.table = read_prompts(config.input)
        self.parts = Parts(self.output, fingerprint(config, self.table.num_rows), "job")

    async def run(self, service: Service, progress: bool = True, in_flight: int | None = None
                  ) -> dict:
        """Generate every prompt not done by an earlier run, with at most `in_flight`
        requests out at once, and write each chunk as soon as its rows are done. A service
        that cannot serve at all (dead engine, no replica) stops the job; the chunks already
        written stay for the next run."""
        from tqdm import tqdm

        done = self.parts.open()
        size, rows = self.config.chunk_size, self.table.num_rows
        prompts = self.table.column(PROMPT_COLUMN).to_pylist()
        summary = Summary(rows)
        bar = tqdm(total=rows, unit="prompt", disable=not progress,
                   initial=sum(min(size, rows - s) for s in done))
        # A backend here gets a chunk per call; replicas get enough to fill their batches.
        window = asyncio.Semaphore(in_flight or self.config.in_flight
                                   or max(size, 64 * (self.config.replicas or 0)))

        async def one(request: Request) -> Completion:
            try:
                started = time.monotonic()
                completion = await patiently(lambda: service.generate(request))
                summary.latencies.append(time.monotonic() - started)
                return completion
            finally:
                window.release()

        async def write_chunk(start: int, pending: list) -> None:
            completions = await asyncio.gather(*pending)
            await asyncio.to_thread(self._write_part, start, completions)
            summary.add(completions)
            bar.update(len(completions))

        writers = []
        try:
            for start in range(0, rows, size):
                if start in done:
                    continue
                pending = []
                for row in range(start, min(start + size, rows)):
                    try:
                        request = to_request(row, prompts[row], self.config.sampling)
                    except RolloutError as exc:
                        pending.append(_ready(Completion(f"row-{row}", error=exc)))
                        continue
                    await window.acquire()
                    pending.append(asyncio.ensure_future(one(request)))
                writers.append(asyncio.ensure_future(write_chunk(start, pending)))
                _raise_first_failure(writers)
            await asyncio.gather(*writers)
        finally:
            for writer in writers:
                writer.cancel()
            bar.close()
        table = await asyncio.to_thread(self._join)
        return {**summary.finish(), **answer_counts(table)}

    def _write_part(self, start: int, completions: list[Completion]) -> None:
        import pyarrow as pa

        self.parts.write(start, pa.Table.from_pylist([output_row(c) for c in completions],
                                                     schema=output_schema()))

    def _join(self) -> None:
        generated = self.parts.read(output_schema())
        table = self.table
        for name in generated.column_names:
            table = table.append_column(name, generated.column(name))
        atomic_write_table(self.output, table)
        self.parts.remove()
        return table


def answer_counts(table) -> dict:
    """Where the prompts carry an `answer`: how many responses give it (see
    rollout.apps.datasets.sums.is_right), over the whole output, resumed parts included."""
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


def _ready(value) -> asyncio.Future:
    future = asyncio.get_running_loop().create_future()
    future.set_result(value)
    return future


def _raise_first_failure(tasks: list[asyncio.Future]) -> None:
    for task in tasks:
        if task.done() and task.exception() is not None:
            raise task.exception()


class Summary:
    """What a run did: counts, throughput, latency percentiles, errors by kind."""

    def __init__(self, prompts: int):
        self.stats = {"prompts": prompts, "samples": 0, "completion_tokens": 0, "errors": 0}
        self.errors_by_kind: dict[str, int] = {}
        self.latencies: list[float] = []
        self.started = time.monotonic()

    def add(self, completions: list[Completion]) -> None:
        for c in completions:
            self.stats["samples"] += len(c.results)
            self.stats["completion_tokens"] += sum(r.completion_tokens for r in c.results)
            if not c.ok:
                self.stats["errors"] += 1
                kind = getattr(c.error, "kind", "error")
                self.errors_by_kind[kind] = self.errors_by_kind.get(kind, 0) + 1

    def finish(self) -> dict:
        seconds = time.monotonic() - self.started
        latencies = sorted(self.latencies)

        def percentile(q: float) -> float | None:
            if not latencies:
                return None
            return round(latencies[min(len(latencies) - 1, int(q * len(latencies)))], 4)

        tokens = self.stats["completion_tokens"]
        return {**self.stats, "seconds": round(seconds, 3),
                "tokens_per_second": round(tokens / max(seconds, 1e-9), 1),
                "requests_this_run": len(latencies),
                "latency_s": {"p50": percentile(0.5), "p90": percentile(0.9),
                              "p99": percentile(0.99), "max": percentile(1.0)},
                "errors_by_kind": self.errors_by_kind}
