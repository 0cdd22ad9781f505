"""`AgentRunner`: trajectories over any `Sampler` (a `Rollout`, or a `ServedRollout` over
replicas or a `rollout serve`), thousands at once, each an asyncio task with no thread of
its own.

Each turn sends the whole history as token ids (`prompt_token_ids`): the first prompt
rendered by the chat template, then at every turn the previous prompt, the tokens the model
sampled, and the tokens appended after them (tokens.py). The engine's echo of the prompt is
checked against that at every turn. Every request of a trajectory carries its id as the
session, so a replica pool keeps it on one replica and its prefix cache.

Images (in the first messages, or returned by tools) are sent with their uuids (content
hashes), and each only once: later turns name earlier images by uuid alone, so only a
turn's new images travel and are processed. Where the sampler no longer holds one (another
replica, evicted), the turn is sent again with every image's pixels.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import time
import uuid
from collections.abc import Callable, Iterable, Sequence

import attrs

from prometheus_client import Counter

from rollout.contract.sampler import Sampler
from rollout.service.backoff import patiently
from rollout.contract import convert
from rollout.contract.errors import InvalidRequestError, RolloutError, UnknownImageError
from rollout.contract.schemas import Message, Request, SamplingParams, ToolCall
from rollout.apps.agents.environment import Environment, Reply
from rollout.apps.agents.tokens import ChatTokens, first_difference
from rollout.apps.agents.tools import ToolResult, call_tool
from rollout.apps.agents.trajectory import ToolCallRecord, Trajectory, Turn
from rollout.apps.tool_parsers import ParsedMessage, load_tool_parser, new_call_id
from rollout.kit.images import PromptImage, load_image, message_image_sources
from rollout.kit.prompts import PromptEncoder

ON_TOOL_ERROR = ("message", "end")
# In the process's default registry: `rollout serve` shows them on /metrics, a trainer
# with its own Prometheus endpoint shows them there.
TRAJECTORIES = Counter("rollout:agent_trajectories", "Agent trajectories ended, by end "
                       "reason.", ["outcome"])
TOOL_CALLS = Counter("rollout:agent_tool_calls", "Agent tool calls, by outcome.", ["outcome"])


def _positive(name: str, optional: bool = False):
    def check(_, __, value):
        if optional and value is None:
            return
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise InvalidRequestError(name, f"got {value!r}", "a number > 0"
                                      + (", or null" if optional else ""))
    return check


@attrs.frozen
class AgentConfig:
    """Limits and choices of a run; every limit ends a trajectory with its own reason."""

    sampling: SamplingParams = attrs.field(factory=SamplingParams)  # each turn's (n is 1)
    max_turns: int = attrs.field(default=8, validator=_positive("max_turns"))
    # Budget for all of `response_ids`; each turn's max_tokens is clamped to what is left.
    max_tokens: int | None = attrs.field(default=None, validator=_positive("max_tokens", True))
    max_model_len: int | None = attrs.field(default=None,
                                            validator=_positive("max_model_len", True))
    tool_timeout: float = attrs.field(default=30.0, validator=_positive("tool_timeout"))
    timeout: float | None = attrs.field(default=None, validator=_positive("timeout", True))
    max_tool_chars: int | None = attrs.field(default=8192,
                                             validator=_positive("max_tool_chars", True))
    on_tool_error: str = "message"  # give the model the error, or end the trajectory
    tool_parser: str = "hermes"
    check_render: bool = True  # compare with the template's re-rendering at every turn
    sessions: bool = True  # a trajectory's turns carry its id as their session
    concurrency: int = attrs.field(default=1024, validator=_positive("concurrency"))

    def __attrs_post_init__(self):
        if self.on_tool_error not in ON_TOOL_ERROR:
            raise InvalidRequestError("on_tool_error", f"got {self.on_tool_error!r}",
                                      ", ".join(ON_TOOL_ERROR))
        if self.sampling.n != 1:
            raise InvalidRequestError("sampling.n", f"got {self.sampling.n}",
                                      "1 (run a row several times for several samples)")


class PrefixMismatchError(RolloutError):
    """The engine saw another prompt than the tokens the trajectory holds."""

    kind = "prefix_mismatch"

    def __init__(self, turn: int, expected: Sequence[int], got: Sequence[int]):
        at = first_difference(expected, got)
        super().__init__(f"turn {turn}: the engine's prompt differs from the trajectory's "
                         f"tokens at {at}: expected {list(expected[at:at + 8])}, got "
                         f"{list(got[at:at + 8])} ({len(expected)} vs {len(got)} tokens)")
        self.turn, self.position = turn, at


class _Stop(Exception):
    def __init__(self, reason: str, detail: str = ""):
        super().__init__(detail)
        self.reason, self.detail = reason, detail


@attrs.define
class _Running:
    deadline: float | None
    aborted: bool = False
    timed_out: bool = False
    step: asyncio.Future | None = None
    # Stops the running turn and lets it return what it made (the sampler's abort by id);
    # without it (tools, the environment) the step is cancelled.
    stop: Callable[[], None] | None = None

    def interrupt(self) -> None:
        if self.stop is not None:
            self.stop()
        elif self.step is not None:
            self.step.cancel()


class AgentRunner:
    """Runs an environment's trajectories on a `rollout.Sampler` (a `Rollout`, or a
    `ServedRollout` over a server or replicas), with the sampler's prompt encoder (its
    model's tokenizer and context length). `tokenizer` (an object or a model path) replaces
    it, with `config.max_model_len` where the path does not say it."""

    def __init__(self, sampler: Sampler, environment: Environment,
                 config: AgentConfig | None = None, tokenizer=None):
        self.sampler = sampler
        self.env = environment
        self.config = config = config or AgentConfig()
        encoder = PromptEncoder.from_folder(tokenizer) if isinstance(tokenizer, str) \
            else sampler.encoder
        if tokenizer is None and encoder is None:
            raise InvalidRequestError(
                "tokenizer", f"sampler {sampler.name!r} does not know its model's folder",
                "a tokenizer or a model path, or a ServedRollout given model=")
        self.tokenizer = encoder.tokenizer if tokenizer is None or isinstance(tokenizer, str) \
            else tokenizer
        self.max_model_len = config.max_model_len or getattr(encoder, "max_model_len", None)
        if self.max_model_len is None:
            raise InvalidRequestError("max_model_len", "unknown for a remote service",
                                      "the model's context length")
        self.tools = {t.name: t for t in getattr(environment, "tools", ())}
        self.chat = ChatTokens(self.tokenizer,
                               [t.spec.as_openai() for t in self.tools.values()] or None)
        self.parser = load_tool_parser(config.tool_parser)
        self._running: dict[str, _Running] = {}
        self._slots: asyncio.Semaphore | None = None
        self._changes: dict[str, SamplingParams] = {}  # _changed's, by the changes' JSON

    # --- running ------------------------------------------------------------------------

    async def run_many(self, rows: Iterable[dict], ids: Iterable[str] | None = None
                       ) -> list[Trajectory]:
        """One trajectory per row, in row order."""
        rows = list(rows)
        ids = list(ids) if ids is not None else [None] * len(rows)
        return list(await asyncio.gather(*(self.run(r, i) for r, i in zip(rows, ids))))

    async def run(self, row: dict, id: str | None = None, seed: int | None = None
                  ) -> Trajectory:
        """One trajectory (at most `config.concurrency` run at once; the others wait). It
        never raises for its own failures: they are its end reason. `seed`, if given,
        replaces the sampling seed (turn k samples with seed + k)."""
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.config.concurrency)
        async with self._slots:
            return await self._trajectory(row, id, seed)

    async def _trajectory(self, row: dict, id: str | None, seed: int | None) -> Trajectory:
        t = Trajectory(id=id or uuid.uuid4().hex)
        if t.id in self._running:
            raise InvalidRequestError("id", f"trajectory {t.id!r} is already running",
                                      "a unique id")
        loop = asyncio.get_running_loop()
        timeout = self.config.timeout
        running = self._running[t.id] = _Running(None if timeout is None else
                                                 loop.time() + timeout)
        try:
            await self._run(row, t, running, seed)
        except _Stop as stop:
            t.end(stop.reason, stop.detail)
            if stop.reason == "done" and self.config.check_render:
                t.final_render = self.chat.check_render(
                    t.messages, t.prompt_ids + t.response_ids, generation_prompt=False)[0]
        except RolloutError as exc:
            t.end("error", f"{exc.kind}: {exc}")
        except Exception as exc:  # noqa: BLE001 - an environment's bug ends its trajectory only
            t.end("error", f"{type(exc).__name__}: {exc}")
        finally:
            del self._running[t.id]
        TRAJECTORIES.labels(t.end_reason).inc()
        return t

    def abort(self, trajectory_id: str) -> bool:
        """Stop a running trajectory: its running turn stops in the engine, and it returns
        what it has, with end reason "aborted". False if it is not running."""
        running = self._running.get(trajectory_id)
        if running is None:
            return False
        running.aborted = True
        running.interrupt()
        return True

    async def _run(self, row: dict, t: Trajectory, running: _Running, seed: int | None
                   ) -> None:
        cfg = self.config
        messages = [_message(m) for m in await self._step(running, _maybe(self.env.start(row)))]
        t.messages = messages
        # On a worker thread: run_many's trajectories reach this in the same loop
        # iteration, and rendered here one after another, no first turn would go out (the
        # engine idles) until the last first prompt is rendered.
        context = await self._step(running, asyncio.to_thread(self.chat.prompt, messages))
        t.prompt_ids = list(context)
        new_images = await self._load_images(running, messages)
        sent: set[str] = set()  # the uuids the service holds (it answered a turn with them)
        if len(context) >= self.max_model_len:
            raise _Stop("context_length", f"the first prompt has {len(context)} tokens; "
                        f"the context holds {self.max_model_len}")
        for index in range(cfg.max_turns):
            sampling = self._sampling(row, index, messages, len(context), len(t.response_ids))
            if seed is not None:
                sampling = attrs.evolve(sampling, seed=seed + index)
            turn, sampled = await self._sample_turn(t, running, index, messages, context,
                                                    sampling, new_images, sent)
            new = await self._after_answer(row, t, running, turn, messages)
            new_images = await self._load_images(running, new)
            appended = self.chat.continuation(sampled, new)
            self._check_limits(t, len(context) + len(sampled) + len(appended),
                               appended=len(appended))
            t.add(appended, False)
            turn.appended_tokens = len(appended)
            messages += new
            context += sampled + appended
        raise _Stop("max_turns", f"{cfg.max_turns} turns")

    async def _sample_turn(self, t: Trajectory, running: _Running, index: int,
                           messages: list[Message], context: list[int],
                           sampling: SamplingParams, new_images: list[PromptImage],
                           sent: set[str]) -> tuple[Turn, list[int]]:
        """One turn in the engine, recorded: its Turn joins the trajectory first, and what
        it sampled (what it made so far, when it is stopped) joins the response."""
        cfg = self.config
        turn = Turn(index=index, prompt_tokens=len(context), sampled_tokens=0,
                    finish_reason="abort", text="")
        t.turns.append(turn)
        if cfg.check_render:
            turn.render, turn.render_differs_at = self.chat.check_render(messages, context)
        t.images += new_images
        turn.images_added = [image.id for image in new_images]
        request = Request(id=f"{t.id}:{index}", prompt_token_ids=tuple(context),
                          images=[None if i.id in sent else i.image for i in t.images],
                          image_uuids=[i.id for i in t.images], sampling=sampling,
                          session_id=t.id if cfg.sessions else None)
        partial: list = []  # the results so far, kept if the turn is cut short
        started = time.monotonic()
        try:
            completion = await self._step(running, self._sample_with_images(
                request, t.images, partial, running))
        except _Stop:
            for cut in partial:
                t.add(cut.token_ids, True, cut.logprobs, cut.weight_versions)
            turn.sampled_tokens = sum(len(cut.token_ids) for cut in partial)
            raise
        finally:
            turn.engine_s = time.monotonic() - started
        result = completion.unwrap()[0]
        sent.update(image.id for image in t.images)
        if list(result.prompt_token_ids) != context:
            raise PrefixMismatchError(index, context, result.prompt_token_ids)
        sampled = list(result.token_ids)
        t.add(sampled, True, result.logprobs, result.weight_versions)
        turn.sampled_tokens, turn.finish_reason, turn.text = \
            len(sampled), result.finish_reason, result.text
        turn.cached_tokens = result.cached_tokens
        self._check_limits(t, len(context) + len(sampled), cut=result.finish_reason)
        return turn, sampled

    async def _after_answer(self, row: dict, t: Trajectory, running: _Running, turn: Turn,
                            messages: list[Message]) -> list[Message]:
        """The model's answer joins the messages; what follows it: its tool calls' results,
        or the environment's reply (which may end the trajectory)."""
        # Without tools there is nothing to call: the text is the answer, whatever it holds.
        parsed = self.parser.parse(turn.text, None) if self.tools else \
            ParsedMessage(turn.text)
        messages.append(Message("assistant", parsed.content, tool_calls=parsed.tool_calls))
        if parsed.tool_calls or parsed.errors:
            return await self._call_tools(running, turn, parsed)
        reply = await self._step(running, _maybe(self.env.respond(row, messages)))
        if not isinstance(reply, Reply):
            raise TypeError(f"the environment's respond() returned {reply!r}, "
                            "not a Reply")
        t.reward = reply.reward if reply.reward is not None else t.reward
        if reply.done:
            raise _Stop("done")
        return [_message(m) for m in reply.messages]

    def _sampling(self, row, index, messages, context: int, used: int) -> SamplingParams:
        """This turn's sampling: the runner's, the environment's overrides, and max_tokens
        clamped to the trajectory's budget and the context left."""
        base = self.config.sampling
        changes = self.env.sampling(row, index, messages) if hasattr(self.env, "sampling") \
            else None
        if changes:
            base = self._changed(changes)
        limit = self.max_model_len - context
        if base.max_tokens is not None:
            limit = min(limit, base.max_tokens)
        if self.config.max_tokens is not None:
            limit = min(limit, self.config.max_tokens - used)
        if limit <= 0:
            raise _Stop(*self._out_of_room(used))
        return attrs.evolve(base, max_tokens=limit, n=1,
                            logprobs=base.logprobs if base.logprobs is not None else 0)

    def _changed(self, changes: dict) -> SamplingParams:
        """The runner's sampling with an environment's changes, structured once per
        distinct changes (an environment has a few; this was a fair part of a turn's work)."""
        try:
            key = json.dumps(changes, sort_keys=True)
        except (TypeError, ValueError):
            key = None
        changed = self._changes.get(key) if key is not None else None
        if changed is None:
            changed = convert.structure({**convert.unstructure(self.config.sampling),
                                         **changes}, SamplingParams)
            if key is not None and len(self._changes) < 256:
                self._changes[key] = changed
        return changed

    def _out_of_room(self, used: int) -> tuple[str, str]:
        if self.config.max_tokens is not None and used >= self.config.max_tokens:
            return "max_tokens", f"{used} of {self.config.max_tokens} response tokens used"
        return "context_length", f"the context of {self.max_model_len} tokens is full"

    def _check_limits(self, t: Trajectory, total: int, cut: str | None = None,
                      appended: int = 0) -> None:
        """End the trajectory where it has no room left: after a turn cut by the budget
        or the context, or before appending what would not fit."""
        budget = self.config.max_tokens
        used = len(t.response_ids) + appended
        full = cut == "length"  # the turn stopped at its clamp: nothing was left of it
        if budget is not None and (used > budget or full and used >= budget):
            raise _Stop("max_tokens", f"{used} response tokens; the budget is {budget}")
        if total > self.max_model_len or full and total >= self.max_model_len:
            raise _Stop("context_length", f"{total} tokens; the context holds "
                        f"{self.max_model_len}")

    async def _step(self, running: _Running, work):
        """Run one step of a trajectory (a turn in the engine, its tools, the environment)
        unless it is aborted or out of time, which stops the step where it is."""
        if running.aborted:
            _close(work)
            raise _Stop("aborted")
        loop = asyncio.get_running_loop()
        left = None if running.deadline is None else running.deadline - loop.time()
        if left is not None and left <= 0:
            _close(work)
            raise _Stop("timeout", f"over {self.config.timeout:g} s")
        step = running.step = asyncio.ensure_future(work)
        try:
            if not (await asyncio.wait({step}, timeout=left))[0]:
                running.timed_out = True
                running.interrupt()
            await asyncio.wait({step})
        finally:
            if not step.done():  # this task itself was cancelled
                step.cancel()
            running.step = running.stop = None
        if running.aborted:
            raise _Stop("aborted")
        if running.timed_out:
            raise _Stop("timeout", f"over {self.config.timeout:g} s")
        return step.result()

    async def _load_images(self, running: _Running, messages: list[Message]
                           ) -> list[PromptImage]:
        """The images of new messages (decoded on a worker thread; most turns have none)."""
        if not any(m.images for m in messages):
            return []
        return await self._step(running, asyncio.to_thread(_load_images, messages))

    async def _sample_with_images(self, request: Request, images: list[PromptImage],
                                  partial: list, running: _Running):
        """One turn; sent again with every image's pixels if the service lacks one that the
        turn named by its uuid alone."""
        try:
            completion = await self._sample(request, partial, running)
            if not isinstance(completion.error, UnknownImageError):
                return completion
        except UnknownImageError:
            pass
        request = attrs.evolve(request, images=[image.image for image in images])
        return await self._sample(request, partial, running)

    async def _sample(self, request: Request, partial: list, running: _Running):
        """One turn in the engine. A turn stopped by an abort returns what it made (finish
        reason abort), which `partial` keeps."""
        running.stop = lambda: self.sampler.abort([request.id])
        completion = await patiently(lambda: self.sampler.agenerate(request))
        if completion.ok:
            result = completion.results[0]
            partial.append(result)
        return completion

    async def _call_tools(self, running: _Running, turn: Turn, parsed) -> list[Message]:
        cfg = self.config
        started = time.monotonic()
        calls = [call_tool(self.tools, c, cfg.tool_timeout, cfg.max_tool_chars)
                 for c in parsed.tool_calls]
        results: list[ToolResult] = list(await self._step(running, _gather(calls)))
        for error in parsed.errors:  # a call the parser could not read
            call = ToolCall(id=new_call_id(), name="", arguments=error.text)
            message = f"error: the tool call could not be read: {error.reason}"
            results.append(ToolResult(call, "bad_arguments", message, message))
        turn.tools_s = time.monotonic() - started
        turn.tool_calls = [ToolCallRecord(r.call.name, r.call.arguments, r.outcome, r.detail,
                                          r.seconds, r.truncated) for r in results]
        for r in results:
            TOOL_CALLS.labels(r.outcome).inc()
        failed = [r for r in results if r.outcome != "ok"]
        if failed and cfg.on_tool_error == "end":
            raise _Stop("tool_error", f"{failed[0].outcome}: {failed[0].detail}")
        return [Message("tool", r.content, tool_call_id=r.call.id, name=r.call.name or None)
                for r in results]


async def _gather(calls) -> list:
    return list(await asyncio.gather(*calls))


async def _maybe(value):
    return await value if inspect.isawaitable(value) else value


def _close(work) -> None:
    if inspect.iscoroutine(work):
        work.close()


def _message(value) -> Message:
    return value if isinstance(value, Message) else convert.structure(value, Message)


def _load_images(messages: list[Message]) -> list[PromptImage]:
    """The images of new messages, loaded, with their uuids (content hashes unless the
    message names them)."""
    loaded = []
    for field, source, name in message_image_sources(messages):
        if source is None:
            raise InvalidRequestError(f"{field}.image", "null",
                                      "the image itself: the trajectory holds its pixels")
        loaded.append(load_image(source, field, name))
    return loaded
