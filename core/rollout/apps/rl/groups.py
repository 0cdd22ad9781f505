"""`GroupSampler`: asynchronous RL's sampling side, over any `Sampler` (a `Rollout` in
this process, replicas, or a `rollout serve`).

Groups (one prompt, `group_size` samples) run on the engine loop while the trainer trains;
a new one starts only while the staleness bound allows (`Staleness`). The trainer takes
complete groups with `next_batch()` and pushes its weights with `update_weights()`, which
updates the sampler with `pause="keep"` by default: running samples go on under the new
weights, and their `Result.weight_versions` say which weights made each token
(`pause="keep_kv"`: the same without recomputing their KV cache, where the backend offers
it). With `pause="abort"` they stop instead and go on from their tokens (`continue_from`) once the
update is in: the partial rollouts are carried to the next step, not thrown away.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any

import attrs

from rollout.apps.rl.staleness import Staleness
from rollout.contract import convert
from rollout.contract.errors import InvalidRequestError, RolloutError, RolloutTimeoutError
from rollout.contract.sampler import Sampler
from rollout.contract.schemas import Request, Result
from rollout.kit.aio import engine_loop

Score = Callable[[Request, Sequence[Result]], Sequence[float]]
# How one sample is made, where not by one call of the sampler: e.g. an agent program's
# episode (rollout.apps.rl.harness.Harness.run), whose tokens the server recorded.
Sample = Callable[[Request], Awaitable[Any]]
CLOSE_WAIT_S = 60.0


@attrs.frozen
class Group:
    """The samples of one prompt, as the trainer gets them."""

    request: Request  # the prompt as given (each sample ran it with n=1)
    results: tuple[Result, ...]  # (or what `sample` made: e.g. harness Episodes)
    rewards: tuple[float, ...] | None  # from `score`, where one was given
    oldest: int  # the oldest weight version any of its tokens came from
    version: int  # the sampler's weight version when it was handed out
    masked: bool = False  # over the bound under policy "mask": train on it with no loss

    @property
    def staleness(self) -> int:
        return self.version - self.oldest


def has_spread(group: Group) -> bool:
    """A group filter (DAPO's dynamic sampling): keep groups whose rewards differ, the only
    ones with a group-relative advantage to learn from."""
    return group.rewards is not None and len(set(group.rewards)) > 1


class GroupSampler:
    """Keeps up to (eta + 1) batches of groups in flight or ready ahead of the trainer.

    `prompts`: requests (or their dicts), each sampled `group_size` times. `score`, called
    off the loop with a prompt and its results, gives their rewards; `keep`, given the
    scored `Group`, drops it (another is sampled in its place) when it returns False: with
    `oversample` extra groups in flight, the batches fill while some are dropped.
    `stale`: what happens to a group over the bound (`staleness.POLICIES`). Versions are
    the sampler's: the one it has when this starts (0 if none), plus one per update.
    `sample`: makes one sample of a request (n=1) instead of the sampler, e.g. an agent
    program's episode (`harness.Harness.run`); the trainer still updates the sampler's
    weights, and a sample's `weight_versions` say which made its tokens.
    """

    def __init__(self, sampler: Sampler, prompts: Iterable[Request | Mapping], *,
                 group_size: int, batch_size: int, eta: int = 0, score: Score | None = None,
                 keep: Callable[[Group], bool] | None = None, stale: str = "drop",
                 oversample: int = 0, max_running: int | None = None, pause: str = "keep",
                 sample: Sample | None = None):
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
            raise InvalidRequestError("group_size", f"got {group_size!r}", "an integer >= 1")
        if pause not in ("keep", "keep_kv", "abort"):
            raise InvalidRequestError("pause", f"got {pause!r}", "keep, keep_kv, abort")
        self.sampler, self.group_size, self.pause = sampler, group_size, pause
        self.score, self.keep, self.sample = score, keep, sample
        start = sampler.weight_version
        self.version = start if isinstance(start, int) else 0
        self.bound = Staleness(batch_size, eta, stale, oversample, max_running, self.version)
        self._prompts = iter(prompts)
        self._gate = threading.Condition()
        self._error: BaseException | None = None
        self._closed = False
        self._running: dict[str, asyncio.Task] = {}  # group id -> its task (loop only)
        self._ids: set[str] = set()  # request ids of running samples, for abort
        self.filtered = 0  # groups `keep` turned down
        self.continued = 0  # samples that went on from their tokens after an abort
        self._loop = engine_loop()
        self._loop.loop.call_soon_threadsafe(self._fill)

    # --- the trainer's side (any thread but the engine loop) ---------------------------

    def next_batch(self, timeout: float | None = 600.0) -> list[Group]:
        """The next `batch_size` complete groups, oldest first; waits for them (bounded).
        Raises what failed a group, or RolloutTimeoutError."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._gate:
            while True:
                if self._error is not None:
                    raise self._error
                taken = self.bound.take()
                self._loop.loop.call_soon_threadsafe(self._fill)  # dropped ones free room
                if taken is not None:
                    break
                if self._closed or (self._exhausted and not self.bound.running):
                    raise RolloutError(f"the prompts ran out with {len(self.bound.ready)} "
                                       f"groups ready of a batch of {self.bound.batch_size}")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise RolloutTimeoutError(
                        f"waited {timeout:.0f} s for a batch: {len(self.bound.ready)} of "
                        f"{self.bound.batch_size} groups ready, {self.bound.running} running")
                self._gate.wait(left)
            return [attrs.evolve(g, version=self.version,
                                 masked=over and self.bound.policy == "mask")
                    for g, over in taken]

    def update_weights(self, named_tensors: Iterable, bucket_bytes: int | None = None) -> int:
        """Push the trainer's weights as the next version; returns it. Running samples go
        on (pause "keep") or stop and go on afterwards (pause "abort")."""
        version = self.version + 1
        self.sampler.update_weights(named_tensors, bucket_bytes=bucket_bytes, version=version,
                                    pause=self.pause)
        return self._advance(version)

    def load_adapter(self, name: str, named_tensors: Iterable, config: Mapping,
                     bucket_bytes: int | None = None) -> int:
        """Push the trainer's LoRA adapter `name` (its prompts name it) as the next version;
        returns it. Load the adapter first at this sampler's `version`: a sample is as old
        as its adapter version. Only with eta 0: a result has one adapter version, so
        nothing may be sampled across the push."""
        if self.bound.eta:
            raise InvalidRequestError("eta", f"got {self.bound.eta}: a sample holds one "
                                      "adapter version, so none may run across a push", "0")
        version = self.version + 1
        self.sampler.load_adapter(name, named_tensors, config, version=version,
                                  bucket_bytes=bucket_bytes)
        return self._advance(version)

    def _advance(self, version: int) -> int:
        with self._gate:
            self.version = version
            self.bound.advance()
        self._loop.loop.call_soon_threadsafe(self._fill)
        return version

    def stats(self) -> dict:
        with self._gate:
            b = self.bound
            return {"version": self.version, "running": b.running, "ready": len(b.ready),
                    "accepted": b.accepted, "dropped_stale": b.dropped,
                    "filtered": self.filtered, "continued": self.continued}

    def close(self) -> None:
        """Stop the groups still running (their samples are aborted) and start no more."""
        with self._gate:
            if self._closed:
                return
            self._closed = True
            ids = list(self._ids)
        if ids:
            self.sampler.abort(ids)
        self._loop.run(self._stop_all(), CLOSE_WAIT_S, "stopping the group sampler")

    def __enter__(self) -> GroupSampler:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- on the engine loop ------------------------------------------------------------

    @property
    def _exhausted(self) -> bool:
        return self._prompts is None

    def _fill(self) -> None:
        """Start groups while the bound has room."""
        while True:
            with self._gate:
                if self._closed or self._exhausted or not self.bound.capacity():
                    return
                item = next(self._prompts, None)
                if item is None:
                    self._prompts = None
                    self._gate.notify_all()
                    return
                self.bound.start()
            try:
                request = item if isinstance(item, Request) else convert.structure(item, Request)
            except InvalidRequestError as exc:
                self._fail(exc)
                return
            task = asyncio.ensure_future(self._group(request))
            self._running[request.id] = task
            task.add_done_callback(lambda _, rid=request.id: self._running.pop(rid, None))

    async def _group(self, request: Request) -> None:
        try:
            results = await asyncio.gather(*(self._sample(request, k)
                                             for k in range(self.group_size)))
            rewards = None if self.score is None else tuple(
                await asyncio.to_thread(self.score, request, results))
            group = Group(request, tuple(results), rewards, self._oldest(results), self.version)
            kept = self.keep is None or bool(await asyncio.to_thread(self.keep, group))
        except BaseException as exc:  # the group ends unkept; a failure goes to next_batch
            with self._gate:
                self.bound.finish(None, kept=False)
            if isinstance(exc, asyncio.CancelledError):
                raise
            self._fail(exc)
            return
        with self._gate:
            self.filtered += not kept
            self.bound.finish(group, kept)
            self._gate.notify_all()
        self._fill()

    async def _sample(self, request: Request, k: int) -> Result:
        """One sample; one that an update stopped goes on from its tokens."""
        s = request.sampling
        sample = attrs.evolve(request, id=f"{request.id}/{k}", sampling=attrs.evolve(
            s, n=1, seed=None if s.seed is None else s.seed + k))
        if self.sample is not None:
            return await self.sample(sample)
        with self._gate:
            self._ids.add(sample.id)
        try:
            while True:
                [result] = (await self.sampler.agenerate(sample)).unwrap()
                if result.finish_reason != "abort" or self._closed:
                    return result
                with self._gate:
                    self.continued += 1
                sample = attrs.evolve(sample, continue_from=result)
        finally:
            with self._gate:
                self._ids.discard(sample.id)

    def _oldest(self, results: Sequence[Result]) -> int:
        # Tokens made before any versioned update count as the starting version. An
        # adapter's sample is as old as its adapter: pushes change it, not the base weights.
        versions = [self.bound.first if v is None else v for r in results
                    for v in ([r.adapter_version] if getattr(r, "adapter", None) is not None
                              else [x.version for x in r.weight_versions])]
        return min(versions, default=self.version)

    def _fail(self, exc: BaseException) -> None:
        with self._gate:
            self._error = self._error or exc
            self._gate.notify_all()

    async def _stop_all(self) -> None:
        tasks = list(self._running.values())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
