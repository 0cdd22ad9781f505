"""`rollout generate`: prompts from parquet to responses in parquet, resumable.

Results are written chunk by chunk into `OUTPUT.parts/` as they finish (see
rollout.apps.jobs.chunked); a run that is killed and started again with the same settings
skips the chunks already written, and the last step joins the parts into OUTPUT. Rows whose
prompt is bad carry an error and do not stop the others.
"""

from __future__ import annotations

import time

from rollout.apps.jobs.config import GenerateConfig
from rollout.apps.jobs.chunked import ChunkedJob
from rollout.apps.jobs.summary import Summary
from rollout.apps.jobs.tables import (PROMPT_COLUMN, answer_counts, fingerprint, joined,
                                      outputs_of, output_schema, read_input, to_request)
from rollout.contract.errors import RolloutError
from rollout.contract.schemas import Completion, Request
from rollout.service.backoff import patiently

__all__ = ["GenerateJob", "GenerateConfig", "Job", "answer_counts"]


class GenerateJob(ChunkedJob):
    """One item per row: its request, sent to the sampler (or, for a bad prompt, the
    row's error at once)."""

    def __init__(self, config: GenerateConfig):
        table = read_input(config.input)  # checked before any model loads
        super().__init__(config, table, fingerprint(config, table.num_rows), "job")

    def begin(self) -> Summary:
        self.prompts = self.table.column(PROMPT_COLUMN).to_pylist()
        return Summary(self.table.num_rows)

    def window(self) -> int:
        # A backend here gets a chunk per call; replicas get enough to fill their batches.
        return self.config.in_flight or max(self.config.chunk_size,
                                            64 * (self.config.replicas or 0))

    def items(self, start: int, stop: int) -> list[Request | Completion]:
        found = []
        for row in range(start, stop):
            try:
                found.append(to_request(row, self.prompts[row], self.config.sampling))
            except RolloutError as exc:
                found.append(Completion(f"row-{row}", error=exc))
        return found

    async def produce(self, item: Request | Completion) -> Completion:
        if isinstance(item, Completion):  # a bad prompt: its row's error
            return item
        started = time.monotonic()
        completion = await patiently(lambda: self.sampler.agenerate(item))
        self.summary.times.append(time.monotonic() - started)
        return completion

    def part_schema(self):
        return output_schema()

    def part(self, items: list, results: list[Completion]):
        return outputs_of(results)

    def join(self, generated):
        return joined(self.table, generated)

    def finish(self, output) -> dict:
        self.summary.stop()
        self.summary.add_answers(output)
        return self.summary.finish("latency_s", ("p50", "p90", "p99", "max"),
                                   requests_this_run=len(self.summary.times))


Job = GenerateJob  # the name in rollout.apps.job, until 0.3
