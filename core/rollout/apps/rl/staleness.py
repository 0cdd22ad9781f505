"""The staleness bound of asynchronous RL, with no I/O: when a new group may start, and
what happens to a finished group that is too old when the trainer takes it.

Versions count weight updates (from any start). A group's `oldest` is the oldest version any of its tokens
came from; handed to the trainer at version v, its staleness is v - oldest. AReaL's rule
admits a group while (eta + v + 1) * batch_size - (accepted + running) > 0: at most
eta + 1 batches beyond those trained on are sampled or kept at any time, so eta = 0 is the
synchronous loop (a batch is sampled only once the last one's update is in). A group can
still end past the bound (one that started early may finish after later ones took the
batches it was counted in); `policy` says what happens to it then.
"""

from __future__ import annotations

from typing import Any

from rollout.contract.errors import InvalidRequestError

POLICIES = {
    "drop": "left out of every batch; another group is sampled in its place",
    "mask": "handed to the trainer marked masked (train on it with no loss)",
    "tag": "handed to the trainer as it is, its staleness on it",
}


class Staleness:
    """Counts groups running and accepted, and holds finished ones until a batch is taken.
    Not thread-safe: its owner calls it under one lock."""

    def __init__(self, batch_size: int, eta: int, policy: str = "drop", oversample: int = 0,
                 max_running: int | None = None, version: int = 0):
        for field, value, least in (("batch_size", batch_size, 1), ("eta", eta, 0),
                                    ("oversample", oversample, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise InvalidRequestError(field, f"got {value!r}", f"an integer >= {least}")
        if policy not in POLICIES:
            raise InvalidRequestError("stale", f"got {policy!r}", ", ".join(POLICIES))
        if max_running is not None and (not isinstance(max_running, int) or max_running < 1):
            raise InvalidRequestError("max_running", f"got {max_running!r}",
                                      "an integer >= 1 or null")
        self.batch_size, self.eta, self.policy = batch_size, eta, policy
        self.oversample, self.max_running = oversample, max_running
        self.version = self.first = version  # the weights' version now, and at the start
        self.accepted = 0  # groups kept: handed to the trainer or ready
        self.running = 0
        self.ready: list[Any] = []  # finished groups (with `.oldest`), oldest first
        self.dropped = 0  # over the bound, with policy "drop"

    def capacity(self) -> int:
        """How many groups may start now."""
        updates = self.version - self.first
        room = ((self.eta + updates + 1) * self.batch_size + self.oversample
                - (self.accepted + self.running))
        if self.max_running is not None:
            room = min(room, self.max_running - self.running)
        return max(0, room)

    def start(self) -> None:
        if not self.capacity():
            raise RuntimeError("no capacity: a group started past the staleness bound")
        self.running += 1

    def finish(self, group: Any, kept: bool) -> None:
        """A group ended; `kept` is False where a filter (or its error) rejected it."""
        self.running -= 1
        if kept:
            self.accepted += 1
            self.ready.append(group)

    def advance(self) -> None:
        """The weights moved on by one version."""
        self.version += 1

    def staleness(self, group: Any) -> int:
        return self.version - group.oldest

    def take(self) -> list[tuple[Any, bool]] | None:
        """A batch of `batch_size` ready groups, each with whether it is over the bound
        (under "drop" none is: those were left out), or None until there are enough."""
        if self.policy == "drop":
            over = [g for g in self.ready if self.staleness(g) > self.eta]
            for group in over:
                self.ready.remove(group)
            self.accepted -= len(over)  # their places are sampled again
            self.dropped += len(over)
        if len(self.ready) < self.batch_size:
            return None
        batch, self.ready = self.ready[:self.batch_size], self.ready[self.batch_size:]
        return [(g, self.staleness(g) > self.eta) for g in batch]
