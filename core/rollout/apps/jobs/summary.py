"""What a job run did, as its summary file's JSON and the line the command prints.

`Summary` is the batch job's, on the driver or on Ray Data: counts, throughput, time
percentiles (per request, or per chunk on Ray Data), errors by kind and right answers.
`AgentSummary` is the trajectories' (turns, tool calls, end reasons, cache hits); both time
the run the same way (`Clock`)."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable

from rollout.apps.jobs.tables import answer_counts
from rollout.contract.schemas import Completion

COUNTS = ("rows", "samples", "completion_tokens", "errors")
QUANTILES = {"p50": 0.5, "p90": 0.9, "p99": 0.99, "max": 1.0}


def percentiles(values: Iterable[float], names: Iterable[str]) -> dict:
    ordered = sorted(values)

    def at(q: float) -> float | None:
        if not ordered:
            return None
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 4)

    return {name: at(QUANTILES[name]) for name in names}


def count(completions: list[Completion]) -> dict:
    """A batch of completions' counts (what a Ray Data actor sends back for its chunk)."""
    kinds: dict[str, int] = {}
    for c in completions:
        if not c.ok:
            kind = getattr(c.error, "kind", "error")
            kinds[kind] = kinds.get(kind, 0) + 1
    return {"rows": len(completions), "samples": sum(len(c.results) for c in completions),
            "completion_tokens": sum(r.completion_tokens for c in completions
                                     for r in c.results),
            "errors": sum(kinds.values()), "errors_by_kind": kinds}


class Clock:
    """The time since the run began, and a rate of tokens over it."""

    def __init__(self):
        self.started = time.monotonic()
        self.stopped: float | None = None

    def stop(self) -> None:
        """The run ends here: what follows (counting the answers) is not timed."""
        self.stopped = time.monotonic()

    def elapsed(self, tokens: int) -> tuple[float, float]:
        seconds = (self.stopped or time.monotonic()) - self.started
        return round(seconds, 3), round(tokens / max(seconds, 1e-9), 1)


class Summary(Clock):
    """Counts, throughput, time percentiles, errors by kind, and right answers."""

    def __init__(self, prompts: int, **first):
        super().__init__()
        self.head = {"prompts": prompts, **first}  # first: what the variant names up front
        self.counts = dict.fromkeys(COUNTS, 0)
        self.errors_by_kind: dict[str, int] = {}
        self.times: list[float] = []  # seconds per request, or per chunk on Ray Data
        self.answers: dict | None = None

    def add(self, completions: list[Completion]) -> None:
        self.add_counts(count(completions))

    def add_counts(self, counts: dict) -> None:
        for key in COUNTS:
            self.counts[key] += int(counts[key])
        for kind, number in counts["errors_by_kind"].items():
            self.errors_by_kind[kind] = self.errors_by_kind.get(kind, 0) + int(number)

    def add_answers(self, table) -> None:
        """The right answers of (a part of) the output: the whole output is counted, the
        parts of earlier runs included, so a resumed run reports them all."""
        found = answer_counts(table).get("answers")
        if found is None:
            return
        before = self.answers or {"checked": 0, "right": 0}
        checked, right = before["checked"] + found["checked"], before["right"] + found["right"]
        self.answers = {"checked": checked, "right": right,
                        "accuracy": round(right / checked, 4) if checked else None}

    def finish(self, times: str, quantiles: Iterable[str], **this_run) -> dict:
        """`times`: the key of the time percentiles; `this_run`: the variant's counts of what
        this run did (not earlier runs of a resumed job), placed before them."""
        seconds, rate = self.elapsed(self.counts["completion_tokens"])
        stats = {**self.head, "samples": self.counts["samples"],
                 "completion_tokens": self.counts["completion_tokens"],
                 "errors": self.counts["errors"], "seconds": seconds,
                 "tokens_per_second": rate, **this_run,
                 times: percentiles(self.times, quantiles),
                 "errors_by_kind": self.errors_by_kind}
        if self.answers is not None:
            stats["answers"] = self.answers
        return stats


class AgentSummary(Clock):
    """Turns, tool calls by outcome, end reasons, tokens, and time in the engine vs tools."""

    def __init__(self, trajectories: int):
        super().__init__()
        self.trajectories = trajectories
        self.counts: Counter = Counter()
        self.outcomes: Counter = Counter()
        self.ends: Counter = Counter()
        self.seconds: Counter = Counter()
        self.rewards: list[float] = []

    def add(self, found: list) -> None:
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
        seconds, rate = self.elapsed(self.counts["sampled_tokens"])
        return {"trajectories": self.trajectories, **self.counts,
                "tool_calls": dict(self.outcomes), "end_reasons": dict(self.ends),
                "mean_reward": round(sum(self.rewards) / len(self.rewards), 4)
                if self.rewards else None,
                # Prefix-cache hits over the prompts of turns after the first, where the
                # engine reports them (vLLM, SGLang).
                "history_cache_hit_rate": round(self.counts["history_cached_tokens"]
                                                / self.counts["history_prompt_tokens"], 4)
                if self.counts["history_prompt_tokens"] else None,
                "seconds": seconds,
                "engine_s": round(self.seconds["engine_s"], 3),
                "tools_s": round(self.seconds["tools_s"], 3),
                "sampled_tokens_per_second": rate}


def describe(stats: dict) -> str:
    """A summary in one line, for the terminal."""
    if "trajectories" in stats:
        return (f"{stats['trajectories']} trajectories, {stats.get('turns', 0)} turns, "
                f"end reasons {stats['end_reasons']}, tool calls {stats['tool_calls']}")
    if "latency_s" in stats:
        latency = stats["latency_s"]
        timing = f"latency p50 {latency['p50']} s, p99 {latency['p99']} s"
    else:  # Ray Data: chunks, each generated at once by an actor
        timing = (f"{stats['chunks_this_run']} chunks, p50 "
                  f"{stats['chunk_seconds']['p50']} s each")
    line = (f"{stats['prompts']} prompts, {stats['samples']} samples, "
            f"{stats['completion_tokens']} tokens in {stats['seconds']} s "
            f"({stats['tokens_per_second']} tokens/s); {timing}; "
            f"errors {stats['errors']} {stats['errors_by_kind']}")
    if "answers" in stats:
        answers = stats["answers"]
        line += f"; right answers {answers['right']} of {answers['checked']}"
    return line
