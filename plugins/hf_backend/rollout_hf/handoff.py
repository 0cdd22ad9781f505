"""One request inside the engine (`Job`), and the hand-off of its tokens to the event loop.


The engine thread makes tokens; the request's `generate` iterator waits for them on the
loop. Once per step the engine hands everything it made to each loop in one
`call_soon_threadsafe` (`deliver`), which appends to each job's inbox and wakes its
waiter. The only thing the loop tells the engine is `cancelled`, a flag the engine reads
at its next step.
"""

from __future__ import annotations

import asyncio
from typing import NamedTuple

from rollout import Chunk, TokenLogprob


class Token(NamedTuple):
    """One new token of one sample, as the engine hands it over."""

    index: int
    token_id: int
    logprob: float | None
    top: list[tuple[int, float]] | None  # (token id, logprob), most likely first
    finish: str | None
    mask: tuple[int, ...] | None = None  # the ids it was drawn from, where asked
    routed: tuple | None = None  # on a sample's last token: its routed experts, where asked
    update: int = 0  # the engine's count of weight updates that made it (Engine.updates)


class PromptScores(NamedTuple):
    """A job's prompt scored (`sampling.prompt_logprobs`): None, then one logprob per later
    prompt token; for k > 0, the top k (token id, logprob) pairs per position (none at the
    first)."""

    logprobs: list[float | None]
    top: list[tuple[tuple[int, float], ...]] | None


class Job:
    def __init__(self, loop: asyncio.AbstractEventLoop, prompt_logprobs: int | None = None):
        self.loop = loop
        self.prompt_logprobs = prompt_logprobs  # score the prompt, with this many tops
        self.scored = False  # (engine thread only) one row has scored it
        self.rows: list = []  # its samples' Rows
        self.vision = None  # its images' VisionInputs (vision.py), for its rows' prefill
        # Set on the loop when the consumer is gone (an abort, a timeout, a dropped
        # client); the engine drops the rows at its next step, admitted or not.
        self.cancelled = False
        self._inbox: list = []  # Tokens, or the exception that failed the job (loop only)
        self._waiter: asyncio.Future | None = None

    # --- on the loop ------------------------------------------------------------------

    def feed(self, items: list) -> None:
        self._inbox.extend(items)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def take(self, timeout: float) -> list:
        """What arrived since the last call, waiting up to `timeout` s for something (an
        empty list after that). Raises the error that failed the request."""
        if not self._inbox:
            self._waiter = self.loop.create_future()
            timer = self.loop.call_later(timeout, _wake, self._waiter)
            try:
                await self._waiter
            finally:
                timer.cancel()
                self._waiter = None
        items, self._inbox = self._inbox, []
        for item in items:
            if isinstance(item, BaseException):
                raise item
        return items


def deliver(batch: list[tuple[Job, list]]) -> None:
    """Run on the loop: one step's output for every job of that loop."""
    for job, items in batch:
        job.feed(items)


def chunks(tokens: list, logprobs: int | None, masks: bool = False) -> list[Chunk]:
    """One Chunk per sample and weights of these tokens (several steps' when the loop fell
    behind); the prompt's scores, where they came, on a chunk of their own first."""
    groups: dict[tuple[int, int], list[Token]] = {}  # (sample, weight update) -> its tokens
    out = []
    for token in tokens:
        if isinstance(token, PromptScores):
            out.append(Chunk(0, prompt_logprobs=token.logprobs, prompt_top_logprobs=None
                             if token.top is None else tuple(
                                 tuple(TokenLogprob(i, v) for i, v in position)
                                 for position in token.top)))
        else:
            groups.setdefault((token.index, token.update), []).append(token)
    for (index, update), group in groups.items():
        out.append(Chunk(
            index, tuple(t.token_id for t in group),
            logprobs=None if logprobs is None else tuple(t.logprob for t in group),
            top_logprobs=tuple(tuple(TokenLogprob(i, v) for i, v in t.top) for t in group)
            if logprobs else None,
            sampling_mask=tuple(t.mask for t in group) if masks else None,
            routed_experts=group[-1].routed,
            finish_reason=group[-1].finish, weight_update=update))
    return out


def _wake(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)
