"""`rollout generate --environment`: one trajectory per sample, from parquet to parquet,
resumable exactly as the single-turn job (rollout.apps.jobs.chunked).

Each output row is one trajectory: the input row's columns, `sample` (0 to n-1), and the
trajectory's ids, loss mask, logprobs, messages and turns (JSON), reward and end reason.
"""

from __future__ import annotations

import json

import attrs

from rollout.apps.agents.environment import load_environment
from rollout.apps.agents.runner import AgentConfig, AgentRunner
from rollout.apps.agents.trajectory import Trajectory
from rollout.apps.jobs.config import GenerateConfig
from rollout.apps.jobs.chunked import ChunkedJob
from rollout.apps.jobs.summary import AgentSummary
from rollout.apps.jobs.tables import fingerprint, joined, read_input
from rollout.contract import convert
from rollout.contract.errors import InvalidRequestError

COLUMNS = ("sample", "trajectory_id", "prompt_ids", "response_ids", "mask", "logprobs",
           "weight_versions", "messages", "turns", "num_turns", "reward", "end_reason", "end_detail", "render")


def _schema():
    import pyarrow as pa

    ids = pa.list_(pa.int64())
    return pa.schema([
        ("row", pa.int64()), ("sample", pa.int64()), ("trajectory_id", pa.string()),
        ("prompt_ids", ids), ("response_ids", ids), ("mask", pa.list_(pa.int8())),
        ("logprobs", pa.list_(pa.float32())),
        ("weight_versions", pa.list_(pa.struct([("version", pa.int64()), ("start", pa.int64()),
                                                ("end", pa.int64())]))),
        ("messages", pa.string()),
        ("turns", pa.string()), ("num_turns", pa.int64()), ("reward", pa.float64()),
        ("end_reason", pa.string()), ("end_detail", pa.string()), ("render", pa.string())])


def agent_config(config: GenerateConfig) -> AgentConfig:
    """The job's AgentConfig: `agent:` settings, with the job's sampling for each turn (one
    sample per request; `n` trajectories per row)."""
    sampling = attrs.evolve(config.sampling, n=1)
    try:
        return convert.structure({**config.agent, "sampling": convert.unstructure(sampling)},
                                 AgentConfig)
    except InvalidRequestError as exc:
        raise InvalidRequestError(f"agent.{exc.field}", exc.detail, exc.allowed) from None


class AgentJob(ChunkedJob):
    """`n` items per row, (row, sample): each a trajectory run by an AgentRunner."""

    unit = "trajectory"

    def __init__(self, config: GenerateConfig):
        self.agent = agent_config(config)
        self.environment = load_environment(config.environment, **config.environment_options)
        # The environment reads what columns it needs: no prompt column is required.
        table = read_input(config.input, COLUMNS, prompt=False)
        super().__init__(config, table, {
            **fingerprint(config, table.num_rows), "environment": config.environment,
            "environment_options": config.environment_options, "agent": config.agent},
            "agent job", per_row=config.sampling.n)

    def begin(self) -> AgentSummary:
        if self.sampler.encoder is None:  # a server, and no --model to read its tokenizer
            raise InvalidRequestError("model", "the tokenizer of the served model is needed",
                                      "--model, the model folder, with --server")
        self.runner = AgentRunner(self.sampler, self.environment, self.agent)
        self.records = self.table.to_pylist()
        return AgentSummary(self.table.num_rows * self.per_row)

    def window(self) -> int:
        # A chunk's trajectories at once, within the runner's own concurrency bound.
        return self.config.chunk_size * self.per_row

    def items(self, start: int, stop: int) -> list[tuple[int, int]]:
        return [(row, sample) for row in range(start, stop) for sample in range(self.per_row)]

    async def produce(self, item: tuple[int, int]) -> Trajectory:
        row, sample = item
        seed = self.config.sampling.seed
        # A seed distinct per trajectory, and the same on a rerun.
        return await self.runner.run(self.records[row], id=f"row-{row}-{sample}",
                                     seed=None if seed is None
                                     else seed + row * self.per_row + sample)

    def part_schema(self):
        return _schema()

    def part(self, items: list[tuple[int, int]], results: list[Trajectory]):
        import pyarrow as pa

        rows = [{"row": r, "sample": k, **trajectory_row(t)}
                for (r, k), t in zip(items, results)]
        return pa.Table.from_pylist(rows, schema=_schema())

    def join(self, generated):
        return joined(self.table.take(generated.column("row")), generated, COLUMNS)


def trajectory_row(t: Trajectory) -> dict:
    return {"trajectory_id": t.id, "prompt_ids": t.prompt_ids, "response_ids": t.response_ids,
            "mask": t.mask, "logprobs": t.logprobs,
            "weight_versions": convert.unstructure(t.weight_versions),
            "messages": json.dumps(convert.unstructure(t.messages)),
            "turns": json.dumps(convert.unstructure(t.turns)), "num_turns": t.num_turns,
            "reward": t.reward, "end_reason": t.end_reason, "end_detail": t.end_detail,
            "render": t.render}
