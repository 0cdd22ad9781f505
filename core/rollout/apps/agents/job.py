"""`rollout generate --environment`: one trajectory per sample, from parquet to parquet,
resumable exactly as the single-turn job (chunks of rows written as they finish into
`OUTPUT.parts/`, skipped by the next run with the same settings).

Each output row is one trajectory: the input row's columns, `sample` (0 to n-1), and the
trajectory's ids, loss mask, logprobs, messages and turns (JSON), reward and end reason.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from pathlib import Path

import attrs

from rollout.contract import convert
from rollout.contract.errors import InvalidRequestError
from rollout.apps.agents.environment import load_environment
from rollout.apps.agents.runner import AgentConfig, AgentRunner
from rollout.apps.agents.trajectory import Trajectory
from rollout.apps.job import GenerateConfig, fingerprint
from rollout.apps.parts import Parts, atomic_write_table

COLUMNS = ("sample", "trajectory_id", "prompt_ids", "response_ids", "mask", "logprobs",
           "messages", "turns", "num_turns", "reward", "end_reason", "end_detail", "render")


def _schema():
    import pyarrow as pa

    ids = pa.list_(pa.int64())
    return pa.schema([
        ("row", pa.int64()), ("sample", pa.int64()), ("trajectory_id", pa.string()),
        ("prompt_ids", ids), ("response_ids", ids), ("mask", pa.list_(pa.int8())),
        ("logprobs", pa.list_(pa.float32())), ("messages", pa.string()),
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


class AgentJob:
    def __init__(self, config: GenerateConfig):
        import pyarrow.parquet as pq

        self.config = config
        self.agent = agent_config(config)
        self.environment = load_environment(config.environment, **config.environment_options)
        self.output = Path(config.output)
        try:
            self.table = pq.read_table(config.input)
        except Exception as exc:
            raise InvalidRequestError("input", f"cannot read {config.input} as parquet: "
                                      f"{exc}") from None
        clash = [c for c in COLUMNS if c in self.table.column_names]
        if clash:
            raise InvalidRequestError("input", f"{config.input} already has output columns "
                                      f"{clash}")
        self.parts = Parts(self.output, {
            **fingerprint(config, self.table.num_rows), "environment": config.environment,
            "environment_options": config.environment_options, "agent": config.agent},
            "agent job")

    def runner(self, service) -> AgentRunner:
        rollout = getattr(service, "rollout", None)  # a backend in this process
        if rollout is None and self.config.model is None:
            raise InvalidRequestError("model", "the tokenizer of the served model is needed",
                                      "--model, the model folder, with --server")
        return AgentRunner(rollout or service, self.environment, self.agent,
                           tokenizer=None if rollout else self.config.model)

    async def run(self, service, progress: bool = True) -> dict:
        """Run every trajectory not written by an earlier run; a failure of the whole
        service stops the job, with the chunks written so far kept."""
        from tqdm import tqdm

        runner = self.runner(service)
        done = self.parts.open()
        size, rows, n = self.config.chunk_size, self.table.num_rows, self.config.sampling.n
        records = self.table.to_pylist()
        summary = AgentSummary(rows * n)
        bar = tqdm(total=rows * n, unit="trajectory", disable=not progress,
                   initial=n * sum(min(size, rows - s) for s in done))
        seed = self.config.sampling.seed

        async def chunk(start: int) -> None:
            indices = [(r, k) for r in range(start, min(start + size, rows)) for k in range(n)]
            found = await asyncio.gather(*(self._one(runner, records[r], r, k, seed)
                                           for r, k in indices))
            await asyncio.to_thread(self._write_part, start, indices, found)
            summary.add(found)
            bar.update(len(found))

        try:
            # Chunks run one after another; the trajectories of a chunk all at once, within
            # the runner's concurrency bound.
            for start in range(0, rows, size):
                if start not in done:
                    await chunk(start)
        finally:
            bar.close()
        await asyncio.to_thread(self._join)
        return summary.finish()

    async def _one(self, runner: AgentRunner, row: dict, index: int, sample: int,
                   seed: int | None) -> Trajectory:
        # A seed distinct per trajectory, and the same on a rerun.
        return await runner.run(row, id=f"row-{index}-{sample}", seed=None if seed is None
                                else seed + index * self.config.sampling.n + sample)

    def _write_part(self, start: int, indices: list, found: list[Trajectory]) -> None:
        import pyarrow as pa

        rows = [{"row": r, "sample": k, **trajectory_row(t)} for (r, k), t in zip(indices, found)]
        self.parts.write(start, pa.Table.from_pylist(rows, schema=_schema()))

    def _join(self) -> None:
        generated = self.parts.read(_schema())
        table = self.table.take(generated.column("row"))
        for name in COLUMNS:
            table = table.append_column(name, generated.column(name))
        atomic_write_table(self.output, table)
        self.parts.remove()


def trajectory_row(t: Trajectory) -> dict:
    return {"trajectory_id": t.id, "prompt_ids": t.prompt_ids, "response_ids": t.response_ids,
            "mask": t.mask, "logprobs": t.logprobs,
            "messages": json.dumps(convert.unstructure(t.messages)),
            "turns": json.dumps(convert.unstructure(t.turns)), "num_turns": t.num_turns,
            "reward": t.reward, "end_reason": t.end_reason, "end_detail": t.end_detail,
            "render": t.render}


class AgentSummary:
    """Turns, tool calls by outcome, end reasons, tokens, and time in the engine vs tools."""

    def __init__(self, trajectories: int):
        self.trajectories = trajectories
        self.counts: Counter = Counter()
        self.outcomes: Counter = Counter()
        self.ends: Counter = Counter()
        self.seconds: Counter = Counter()
        self.rewards: list[float] = []
        self.started = time.monotonic()

    def add(self, found: list[Trajectory]) -> None:
        for t in found:
            self.ends[t.end_reason] += 1
            self.counts["trajectories_this_run"] += 1
            self.counts["turns"] += t.num_turns
            self.counts["sampled_tokens"] += sum(t.mask)
            self.counts["appended_tokens"] += len(t.mask) - sum(t.mask)
            for turn in t.turns:
                if turn.index > 0 and turn.cached_tokens is not None:  # history turns
                    self.counts["history_prompt_tokens"] += turn.prompt_tokens
                    self.counts["history_cached_tokens"] += turn.cached_tokens
                self.seconds["engine_s"] += turn.engine_s
                self.seconds["tools_s"] += turn.tools_s
                self.outcomes.update(c.outcome for c in turn.tool_calls)
            if t.reward is not None:
                self.rewards.append(t.reward)

    def finish(self) -> dict:
        seconds = time.monotonic() - self.started
        return {"trajectories": self.trajectories, **self.counts,
                "tool_calls": dict(self.outcomes), "end_reasons": dict(self.ends),
                "mean_reward": round(sum(self.rewards) / len(self.rewards), 4)
                if self.rewards else None,
                # Prefix-cache hits over the prompts of turns after the first, where the
                # engine reports them (vLLM, SGLang).
                "history_cache_hit_rate": round(self.counts["history_cached_tokens"]
                                                / self.counts["history_prompt_tokens"], 4)
                if self.counts["history_prompt_tokens"] else None,
                "seconds": round(seconds, 3),
                "engine_s": round(self.seconds["engine_s"], 3),
                "tools_s": round(self.seconds["tools_s"], 3),
                "sampled_tokens_per_second": round(self.counts["sampled_tokens"]
                                                   / max(seconds, 1e-9), 1)}
