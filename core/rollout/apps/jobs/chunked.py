"""The chunked, resumable run that the batch job and the agent job share.

The input's rows are cut into chunks of `chunk_size`; each chunk is written as a part into
`OUTPUT.parts/` (rollout.apps.parts) as soon as its items are done, with at most a window
of items in flight across chunks. A run killed and started again with the same settings
skips the chunks already written; a failure of the whole sampler stops the job and keeps
them. The last step joins the parts onto the input into OUTPUT.

A variant says what a chunk's items are, how one is produced, the part it writes, how the
parts join onto the input, and what its summary holds.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from rollout.apps.jobs.config import GenerateConfig
from rollout.apps.parts import Parts, atomic_write_table
from rollout.contract.sampler import Sampler


class ChunkedJob:
    """A job over an input table's rows, run chunk by chunk on a sampler; a variant (the
    batch job, the agent job) fills in the methods below the constructor."""

    unit = "prompt"  # what the progress bar counts

    def __init__(self, config: GenerateConfig, table, settings: dict, what: str,
                 per_row: int = 1):
        self.config = config
        self.output = Path(config.output)
        self.table = table
        self.per_row = per_row  # items per input row
        self.parts = Parts(self.output, settings, what)

    # --- what a variant says --------------------------------------------------------------

    def begin(self):
        """Get ready to run on `self.sampler` (refusing it before any part is written);
        the run's summary, which gets each chunk's results (`add`)."""
        raise NotImplementedError

    def window(self) -> int:
        """Items in flight at once, by default."""
        raise NotImplementedError

    def items(self, start: int, stop: int) -> list:
        """The items of the rows start to stop."""
        raise NotImplementedError

    async def produce(self, item):
        """One item's result; it carries its own failure, and raises only when the whole
        sampler fails (which stops the job)."""
        raise NotImplementedError

    def part_schema(self):
        raise NotImplementedError

    def part(self, items: list, results: list):
        """A chunk's part: its results, as a table of `part_schema()`."""
        raise NotImplementedError

    def join(self, generated):
        """The output: the input with every part (`generated`, in row order) joined on."""
        raise NotImplementedError

    def finish(self, output) -> dict:
        """The summary's JSON, once the output is written."""
        return self.summary.finish()

    # --- the run ---------------------------------------------------------------------------

    async def run(self, sampler: Sampler, progress: bool = True, in_flight: int | None = None
                  ) -> dict:
        """Produce every item not written by an earlier run, with at most `in_flight` out
        at once, and write each chunk as soon as its items are done."""
        from tqdm import tqdm

        self.sampler = sampler
        self.summary = summary = self.begin()
        done = self.parts.open()
        size, rows = self.config.chunk_size, self.table.num_rows
        bar = tqdm(total=rows * self.per_row, unit=self.unit, disable=not progress,
                   initial=self.per_row * sum(min(size, rows - s) for s in done))
        window = asyncio.Semaphore(in_flight or self.window())

        async def one(item):
            try:
                return await self.produce(item)
            finally:
                window.release()

        async def write_chunk(start: int, items: list, pending: list) -> None:
            results = await asyncio.gather(*pending)
            await asyncio.to_thread(self._write_part, start, items, results)
            summary.add(results)
            bar.update(len(results))

        writers = []
        try:
            for start in range(0, rows, size):
                if start in done:
                    continue
                items = self.items(start, min(start + size, rows))
                pending = []
                for item in items:
                    await window.acquire()
                    pending.append(asyncio.ensure_future(one(item)))
                writers.append(asyncio.ensure_future(write_chunk(start, items, pending)))
                _raise_first_failure(writers)  # stop sending once the sampler has failed
            await asyncio.gather(*writers)
        finally:
            for writer in writers:
                writer.cancel()
            bar.close()
        output = await asyncio.to_thread(self._write_output)
        return self.finish(output)

    def _write_part(self, start: int, items: list, results: list) -> None:
        self.parts.write(start, self.part(items, results))  # off the loop: Arrow's work

    def _write_output(self):
        output = self.join(self.parts.read(self.part_schema()))
        atomic_write_table(self.output, output)
        self.parts.remove()
        return output


def _raise_first_failure(tasks: list[asyncio.Future]) -> None:
    for task in tasks:
        if task.done() and task.exception() is not None:
            raise task.exception()
