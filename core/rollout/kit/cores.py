"""Cores shared over time by the threads of one process that compute with torch: a
trainer's and an in-process engine's. Each busy phase gets an even share of the cores and
a phase alone gets them all, so neither idles on cores the other has left: while the
engine waits for the next batch, the trainer trains on every core, and the other way
round. torch's thread count is per thread (OpenMP's), so each thread applies its own
share, the engine before each step and the trainer before each module it runs
(`follow`)."""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager


class CoreShare:
    def __init__(self, cores: int | None = None):
        self.cores = cores or len(os.sched_getaffinity(0))
        self._busy: set[str] = set()
        self._lock = threading.Lock()

    def threads(self, phase: str) -> int:
        """The threads `phase` computes on now: its share among the busy phases."""
        with self._lock:
            others = len(self._busy - {phase})
        return max(1, self.cores // (others + 1))

    def apply(self, phase: str) -> None:
        """This thread computes on `phase`'s share from now on."""
        import torch

        threads = self.threads(phase)
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)

    def take(self, phase: str) -> None:
        with self._lock:
            self._busy.add(phase)
        self.apply(phase)

    def leave(self, phase: str) -> None:
        with self._lock:
            self._busy.discard(phase)

    @contextmanager
    def busy(self, phase: str):
        self.take(phase)
        try:
            yield
        finally:
            self.leave(phase)

    def follow(self, model, phase: str) -> list:
        """Apply `phase`'s share before each module of `model` runs forward and as each
        parameter's gradient is made (the backward pass runs on the caller's thread on
        CPU), so a change of share reaches a pass under way. Returns the hooks' handles."""
        handles = [m.register_forward_pre_hook(lambda *_: self.apply(phase))
                   for m in model.modules()]
        handles += [p.register_post_accumulate_grad_hook(lambda _: self.apply(phase))
                    for p in model.parameters() if p.requires_grad]
        return handles
