"""`Rollout`: the one object a trainer holds, whatever backend (plugin) sits behind it.

It checks the backend against the hook specifications when it is registered, validates and
encodes each request, and runs every request as its own coroutine on the engine loop:
thousands can run at once without a thread each. It owns what every backend would
otherwise redo: the request front (`rollout.front`: bookkeeping, timeouts, aborts, also one
that comes before the engine has seen the request, streaming), texts and stop-string cuts,
and the lifecycle (`rollout.lifecycle`: release, resume, update_weights and adapter loads
kept apart from running requests, with bounded waits).
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import attrs
import pluggy

from rollout import hookspecs
from rollout.contract import convert
from rollout.contract.errors import (
    BackendContractError,
    BackendReleasedError,
    EngineDeadError,
    GenerationError,
    InvalidRequestError,
    RolloutError,
)
from rollout.contract.schemas import TAGS, Capabilities, Chunk, Completion, Request, Timing
from rollout.front import Flight, RequestFront, aborted_completion, raw_id
from rollout.kit.aio import engine_loop, on_loop, uncancel
from rollout.kit.images import ImageStore, image_sources
from rollout.lifecycle import Lifecycle
from rollout.samples import Sample
from rollout.weights.lora import no_such_adapter
from rollout.weights.update import check_update

# A supported capability needs these hooks implemented.
HOOKS_FOR = {"release": ("release", "resume"), "update_weights": ("update_weights",)}
ADAPTER_HOOKS = ("load_adapter", "unload_adapter")


class _Flight(Flight):
    """One call for one request, in the engine."""

    __slots__ = ("admitted", "in_engine", "held", "keepable", "started", "first_token")

    def __init__(self, request: Request):
        super().__init__(request)
        self.admitted = False  # counted as running
        self.in_engine = False  # an engine call runs (loop only)
        self.held = False  # stopped by a keep update, to go on after it (loop only)
        # A grammar's state lives in the engine: a constrained request cannot go on from
        # its tokens, so a keep update waits for it instead.
        self.keepable = request.sampling.structured_outputs is None
        self.started = 0.0
        self.first_token: float | None = None


class Rollout(RequestFront):
    flight_type = _Flight

    def __init__(self, backend: Any, name: str = "custom"):
        self.name = name
        self._pm = pluggy.PluginManager(hookspecs.PROJECT)
        self._pm.add_hookspecs(hookspecs)
        try:
            self._pm.register(backend, name=name)
            self._pm.check_pending()
        except pluggy.PluginValidationError as exc:
            raise BackendContractError(f"backend {name!r} does not match the contract: {exc}") from None
        implemented = {h.name for h in self._pm.get_hookcallers(backend) or []}
        missing = [h for h in hookspecs.REQUIRED if h not in implemented]
        if missing:
            raise BackendContractError(f"backend {name!r} does not implement {', '.join(missing)}")
        caps = self._pm.hook.capabilities()
        if not isinstance(caps, Capabilities):
            raise BackendContractError(f"backend {name!r}: capabilities() returned {caps!r}")
        for capability, hooks in HOOKS_FOR.items():
            absent = [h for h in hooks if h not in implemented]
            if caps.supports(capability) and absent:
                raise BackendContractError(
                    f"backend {name!r} claims {capability!r} but does not implement "
                    f"{', '.join(absent)}; implement it or list it in Capabilities.unsupported"
                )
        if caps.supports("adapters") and not all(h in implemented for h in ADAPTER_HOOKS):
            # Adapters came after the contract's first backends: without the hooks, none.
            caps = attrs.evolve(caps, unsupported={**caps.unsupported, "adapters": (
                f"backend {name!r} implements no {' or '.join(ADAPTER_HOOKS)}")})
        self.capabilities = caps
        self.encoder = self._pm.hook.prompt_encoder()
        self._implemented = implemented
        self._backend = backend
        self._engine = engine_loop()
        super().__init__(self._engine.loop)
        self.lifecycle = Lifecycle(name, self._loop)
        # Images loaded here, so that later turns can name them by uuid alone.
        self.images = ImageStore()
        self.weight_version: int | None = None  # of the weights that serve requests now
        # The version after each update that succeeded, the first the weights loaded: a
        # backend that keeps requests in its engine through updates stamps each chunk
        # with the number of updates it had made (`Chunk.weight_update`).
        self._versions: list[int | None] = [None]
        self.adapters: dict[str, int | None] = {}  # the loaded LoRA adapters' versions

    # --- one request, on the engine loop ------------------------------------------------

    def _stop(self, flights: list[_Flight]) -> None:
        _cancel_all(flights)

    def _validate(self, item: Request | Mapping, index: int) -> Request | Completion:
        try:
            request = item if isinstance(item, Request) else convert.structure(item, Request)
            self._check_request(request)
        except InvalidRequestError as exc:
            rid = item.id if isinstance(item, Request) else raw_id(item, index)
            return Completion(rid, error=exc)
        return request

    def _check_request(self, request: Request) -> None:
        needs = []
        if request.sampling.logprobs is not None:
            needs.append(("logprobs", "sampling.logprobs"))
        if request.sampling.logprobs_mode is not None:
            needs.append((f"logprobs_mode.{request.sampling.logprobs_mode}",
                          "sampling.logprobs_mode"))
        if request.sampling.return_sampling_mask:
            needs.append(("sampling_mask", "sampling.return_sampling_mask"))
        if request.sampling.return_routed_experts:
            needs.append(("routed_experts", "sampling.return_routed_experts"))
        if request.sampling.trace_decode_token_ids is not None:
            needs.append(("trace_replay", "sampling.trace_decode_token_ids"))
        if request.sampling.seed is not None:
            needs.append(("seed", "sampling.seed"))
        if request.sampling.batch_invariant:
            needs.append(("batch_invariant", "sampling.batch_invariant"))
        if request.sampling.prompt_logprobs is not None:
            needs.append(("prompt_logprobs", "sampling.prompt_logprobs"))
            if image_sources(request):
                raise InvalidRequestError(
                    "sampling.prompt_logprobs", "scoring a prompt with images is not "
                    "supported (engines expand each image into a run of tokens)",
                    "prompt_logprobs with a text prompt")
        if request.images:
            needs.append(("images", "images"))
        if request.messages is not None:
            needs.append(("chat", "messages"))
            if any(m.images for m in request.messages):
                needs.append(("images", "messages"))
            if request.tools or any(m.tool_calls for m in request.messages):
                needs.append(("tools", "tools" if request.tools else "messages"))
        if request.adapter is not None:
            needs.append(("adapters", "adapter"))
        structured = request.sampling.structured_outputs
        if structured is not None:
            needs.append((f"structured_outputs.{structured.kind}",
                          f"sampling.structured_outputs.{structured.kind}"))
        for capability, field in needs:
            if not self.capabilities.supports(capability):
                raise InvalidRequestError(
                    field, f"backend {self.name!r} does not support {capability}: "
                    f"{self.capabilities.unsupported[capability]}")
        if request.adapter is not None and request.adapter not in self.adapters:
            raise no_such_adapter(request.adapter, self.adapters)

    async def _run(self, flight: _Flight, timeout: float | None,
                   sink: Callable[[Chunk], None] | None = None) -> Completion:
        flight.task = asyncio.current_task()
        request = flight.request
        timer = None if timeout is None else self._loop.call_later(
            timeout, _cancel_all, [flight], True)
        try:
            if flight.aborted:  # before it started
                return aborted_completion(request)
            await self._admit()
            flight.admitted = True
            try:
                return await self._collect(flight, sink)
            finally:
                if flight.admitted:
                    self.lifecycle.leave()
        except asyncio.CancelledError:
            if not flight.aborted:
                raise
            uncancel()
            return aborted_completion(request)
        finally:
            if timer is not None:
                timer.cancel()
            self._forget(flight)

    async def _collect(self, flight: _Flight, sink) -> Completion:
        try:
            request, prompt, samples, images = await self._prepare(flight.request,
                                                                    sink is not None)
        except InvalidRequestError as exc:
            return Completion(flight.request.id, error=exc)
        flight.started = time.monotonic()
        try:
            # Engine calls until every sample ends; a keep update ends one early (held),
            # and the unfinished samples go on from their tokens once it is done.
            while await self._segment(flight, request, prompt, images, samples, sink):
                if all(x.finish for x in samples):
                    break
                self.lifecycle.leave()
                flight.admitted = False
                try:
                    await self._admit()
                except RolloutError:  # the update failed, or the backend closed: partial
                    flight.aborted = True
                    break
                flight.admitted = True
        except asyncio.CancelledError:
            if not flight.aborted:
                raise
            uncancel()
        except EngineDeadError as exc:
            self.lifecycle.die(exc)
            raise
        except RolloutError as exc:
            return Completion(request.id, error=exc)
        except Exception as exc:  # noqa: BLE001 - a backend bug fails its request alone
            return Completion(request.id, error=GenerationError(
                f"backend {self.name!r} failed on request {request.id!r}: {exc!r}"))
        return self._assemble(flight, request, prompt, samples, sink)

    async def _prepare(self, request: Request, streaming: bool):
        """The request with its token budget set, its prompt's ids, a `Sample` per n and
        its images; InvalidRequestError when the model cannot take it."""
        s = request.sampling
        prompt = self.encoder.encode(request)
        if s.max_tokens is None:  # the room left in the context
            s = attrs.evolve(s, max_tokens=self.encoder.max_model_len - len(prompt))
            request = attrs.evolve(request, sampling=s)
        samples = [Sample(self.encoder.decode, s, streaming, i, len(prompt))
                   for i in range(s.n)]
        if request.continue_from is not None:
            samples[0].go_on_from(request.continue_from, prompt)
        # Decoding images takes a while: not on the loop.
        images = await asyncio.to_thread(self.images.load, request) \
            if image_sources(request) else ()
        return request, prompt, samples, images

    def _assemble(self, flight: _Flight, request: Request, prompt: list[int],
                  samples: list[Sample], sink) -> Completion:
        """The samples' results, or the backend's breach of the contract by name."""
        s = request.sampling
        if not flight.aborted and not all(x.finish for x in samples):
            return Completion(request.id, error=BackendContractError(
                f"backend {self.name!r}: the output of request {request.id!r} ended with "
                "unfinished samples"))
        if s.prompt_logprobs is not None and not flight.aborted and not all(
                x.scored(len(prompt)) for x in samples):
            return Completion(request.id, error=BackendContractError(
                f"backend {self.name!r}: request {request.id!r} asked prompt_logprobs and "
                f"did not get one entry (and top-k list) per prompt token"))
        results = []
        for sample in samples:
            results.append(sample.result(request, prompt, self.weight_version,
                                         self.adapters.get(request.adapter)))
            if sink is not None and sample.stream is not None and not sample.streamed_end:
                sink(Chunk(sample.index, finish_reason=results[-1].finish_reason,
                           text=sample.stream.finish()))
        return Completion(request.id, tuple(results), timing=Timing(
            flight.first_token, time.monotonic() - flight.started))

    async def _segment(self, flight: _Flight, request: Request, prompt: list[int], images,
                       samples: list[Sample], sink) -> bool:
        """Run the unfinished samples in the engine under the weights of now, until they end
        (False) or a keep update holds them (True). Every token of one segment comes from
        one version: updates wait for running requests, and this one runs."""
        if self.lifecycle.holding and flight.keepable:
            return True  # a keep update waits: let it go first
        version = self.weight_version
        for sample in samples:
            sample.check_room()
        todo = [x for x in samples if not x.finish]
        if all(not x.tokens and not x.finish for x in samples):  # one call for them all
            parts = [(request, prompt, samples)]
        else:  # each sample from its own tokens
            parts = [(x.rest_of(request), prompt + x.tokens, [x]) for x in todo]
        flight.in_engine = True
        try:
            await _together([self._part(flight, r, p, images, targets, sink, version)
                             for r, p, targets in parts])
        except asyncio.CancelledError:
            if not flight.held:
                raise
            uncancel()
            return True
        finally:
            flight.in_engine = flight.held = False
        return False

    async def _part(self, flight: _Flight, request: Request, prompt: list[int], images,
                    targets: list[Sample], sink, version: int | None) -> None:
        """One engine call: its chunks go to `targets` (its sample index -> ours)."""
        for sample in targets:
            sample.begin_segment()
        chunks = self._pm.hook.generate(request=request, prompt_token_ids=prompt,
                                        streaming=sink is not None, images=images)
        try:
            async for chunk in chunks:
                if chunk.prompt_logprobs is not None:  # the prompt's, for every sample
                    for sample in targets:
                        sample.take_prompt_scores(chunk)
                    if not chunk.token_ids and chunk.finish_reason is None:
                        continue  # (scores alone may come after a sample's end)
                if not 0 <= chunk.index < len(targets) or targets[chunk.index].finish:
                    raise BackendContractError(
                        f"backend {self.name!r}: chunk for sample {chunk.index} of a request "
                        f"with n={len(targets)} (or after that sample finished)")
                if flight.first_token is None and chunk.token_ids:
                    flight.first_token = time.monotonic() - flight.started
                made_by = version if chunk.weight_update is None \
                    else self._versions[chunk.weight_update]  # (beside a "keep_kv" update)
                seen = targets[chunk.index].add(chunk, made_by)
                if seen is not None and (seen.token_ids or seen.finish_reason or seen.text):
                    sink(seen)
                if all(x.finish for x in targets):
                    break  # (the core found a stop string that spans a continuation)
        finally:
            await chunks.aclose()

    async def _admit(self) -> None:
        """Wait (bounded) while a lifecycle call runs or waits, resuming a released backend
        that resumes on its own; then the request counts as running."""
        await self.lifecycle.admit(self.resume if self.capabilities.auto_resume else None)

    # --- lifecycle ----------------------------------------------------------------------

    def release(self, tags: Iterable[str] | None = None) -> None:
        """Free the weights and/or KV cache (all by default)."""
        tags = _tags(tags)
        self.capabilities.require("release")
        with self._lifecycle_section():
            todo = tuple(t for t in tags if t not in self.lifecycle.released)
            if todo:
                self._pm.hook.release(tags=todo)
                self.lifecycle.released.update(todo)

    def resume(self, tags: Iterable[str] | None = None) -> None:
        """Bring back released memory, weights before KV cache (all by default)."""
        tags = _tags(tags)
        self.capabilities.require("release")
        with self._lifecycle_section():
            todo = tuple(t for t in TAGS if t in tags and t in self.lifecycle.released)
            if todo:
                self._pm.hook.resume(tags=todo)
                self.lifecycle.released.difference_update(todo)

    @property
    def released(self) -> frozenset[str]:
        return frozenset(self.lifecycle.released)

    @property
    def updating(self) -> bool:
        """A lifecycle call (a weight update, release, resume) runs or waits to."""
        return self.lifecycle.busy

    @property
    def weights_dirty(self) -> bool:
        """A weight update failed midway: no request runs until a full one succeeds."""
        return self.lifecycle.dirty is not None

    def health(self) -> dict:
        """What runs now, and the backend's counters (`stats`) where it keeps some; raises the
        engine's death, its closing or its dirty weights."""
        self.lifecycle.check()
        health = {"backend": self.name, "running": self.lifecycle.running,
                  "released": sorted(self.lifecycle.released),
                  "weight_version": self.weight_version}
        stats = self._pm.hook.stats()  # outside the gate: a backend's own counters
        if stats is not None:
            health["stats"] = stats
        return health

    def update_weights(self, named_tensors: Iterable, bucket_bytes: int | None = None,
                       version: int | None = None, pause: str = "wait") -> None:
        """Load new weights, given as (name, tensor) pairs, packed into buckets (or as
        buckets already packed, which a server receives).

        `version` labels the tokens made from now on (`Result.weight_versions`). `pause`
        says what happens to running requests: "wait" lets them finish first, "abort" stops
        them (they return what they made so far, finish reason "abort", to be continued
        with `continue_from`), "keep" holds them while the weights load and then continues
        each from its tokens so far under the new weights, in the same call (the way
        `capabilities.keep` names; a constrained request is not held: the update waits for
        it). "keep_kv" (where `capabilities` offer it) leaves them in the engine: the
        weights change between two of their steps, and their later tokens are made by the
        new weights over the KV cache the old ones made, without the recompute (each token
        labelled with the weights that made it). New requests wait for the update. An
        update that fails midway leaves the weights dirty: no request runs until a full
        update succeeds (under "keep_kv", the requests it ran beside fail).
        """
        from rollout.weights.buckets import DEFAULT_BUCKET_BYTES

        check_update(version, pause)
        self.capabilities.require("update_weights")
        if pause == "keep_kv":
            self.capabilities.require("keep_kv")
        with self._lifecycle_section(pause):
            if "weights" in self.lifecycle.released:
                raise BackendReleasedError(
                    f"backend {self.name!r}: weights are released; resume(['weights']) first")
            buckets = _packed(named_tensors, bucket_bytes or DEFAULT_BUCKET_BYTES)
            # Before the update: with "keep_kv", tokens stamped with it may reach the loop
            # before the update returns.
            self._versions.append(version)
            try:
                self._pm.hook.update_weights(buckets=buckets)
            except BaseException as exc:
                self._versions.pop()  # (the backend stamps no token with a failed one)
                self.lifecycle.dirty = (f"a weight update failed midway ({exc!r}); it takes "
                                        "no request until a full update succeeds")
                raise
            self.lifecycle.dirty = None
            self.weight_version = version

    def load_adapter(self, name: str, named_tensors: Iterable, config: Mapping,
                     version: int | None = None, bucket_bytes: int | None = None,
                     pause: str = "wait") -> None:
        """Load LoRA adapter `name` (or replace the one loaded under it) from PEFT's
        tensors, as (name, tensor) pairs (`get_peft_model_state_dict`) or buckets already
        packed, and its `LoraConfig` as a dict (`r`, `lora_alpha`, ...). Requests that name
        it (`Request.adapter`) then sample with it, and their results say `version`.
        `pause`: "wait" lets running requests finish first, "abort" stops them (as
        `update_weights`); new ones wait. A load that fails changes nothing: the adapter
        loaded before under that name, if any, still serves."""
        from rollout.weights.buckets import DEFAULT_BUCKET_BYTES
        from rollout.weights.lora import plain_config

        _check_adapter_name(name)
        config = plain_config(config)
        check_update(version, pause)
        if pause in ("keep", "keep_kv"):  # a result has one adapter version
            raise InvalidRequestError("pause", "an adapter load holds no running request",
                                      "wait, abort")
        self.capabilities.require("adapters")
        with self._lifecycle_section(pause):
            buckets = _packed(named_tensors, bucket_bytes or DEFAULT_BUCKET_BYTES)
            self._pm.hook.load_adapter(name=name, config=config, buckets=buckets)
            self.adapters[name] = version

    def unload_adapter(self, name: str) -> None:
        """Unload adapter `name`; requests that name it are then refused."""
        self.capabilities.require("adapters")
        with self._lifecycle_section():
            if name not in self.adapters:
                raise no_such_adapter(name, self.adapters)
            self._pm.hook.unload_adapter(name=name)
            del self.adapters[name]

    def close(self) -> None:
        """Stop running requests and the engine."""
        if not self.lifecycle.close(self.abort):
            return
        if "close" in self._implemented:
            self._pm.hook.close()

    def __enter__(self) -> Rollout:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _lifecycle_section(self, pause: str = "wait"):
        if on_loop(self._loop):
            raise RuntimeError("lifecycle calls block; make them off the engine loop")
        return self.lifecycle.call(pause, self._stop_running)

    def _stop_running(self, pause: str) -> None:
        """What a lifecycle call's `pause` does to running requests: "abort" stops them,
        "keep" stops the engine calls of those that can go on after it."""
        if pause == "abort":
            self.abort()
        else:
            self._loop.call_soon_threadsafe(self._hold_all)

    def _hold_all(self) -> None:
        """On the loop: stop the engine calls of running requests that can go on later."""
        with self._gate:
            flights = [f for same in self._flights.values() for f in same]
        for flight in flights:
            if flight.in_engine and flight.keepable and not flight.held \
                    and flight.task is not None:
                flight.held = True
                flight.task.cancel()


async def _together(calls: list) -> None:
    """Await the calls; one that fails or a cancellation stops the others, and their
    clean-up ends before this returns or raises."""
    if len(calls) == 1:
        await calls[0]
        return
    tasks = [asyncio.ensure_future(c) for c in calls]
    try:
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.wait(tasks)


def _cancel_all(flights: list[_Flight], abort: bool = False) -> None:
    for flight in flights:
        flight.aborted = flight.aborted or abort
        if flight.task is not None and not flight.task.done():
            flight.task.cancel()


def _check_adapter_name(name: Any) -> None:
    if not isinstance(name, str) or not name:
        raise InvalidRequestError("name", f"got {name!r}", "a non-empty string")


def _packed(weights: Iterable, bucket_bytes: int) -> Iterator:
    """Buckets as they come, or (name, tensor) pairs grouped into buckets, which pack only
    for a backend that reads their bytes. A first item that fails (nothing was sent yet)
    is raised from here, before the backend is called: the weights are not dirty."""
    from rollout.weights.buckets import Bucket, iter_groups

    items = iter(weights)
    first = next(items, None)
    if first is None:
        return iter(())
    if isinstance(first, Bucket):
        return itertools.chain([first], items)
    return map(Bucket.of, iter_groups(itertools.chain([first], items), bucket_bytes))


def _tags(tags: Iterable[str] | None) -> tuple[str, ...]:
    if tags is None:
        return TAGS
    tags = tuple([tags] if isinstance(tags, str) else tags)
    bad = [t for t in tags if t not in TAGS]
    if bad or not tags:
        raise InvalidRequestError("tags", f"got {list(tags)!r}", ", ".join(TAGS))
    return tags


def load_backend(name: str, model: str, **options: Any) -> Rollout:
    """A `Rollout` over the backend registered as `name` in `rollout.backends`, on `model`
    (a folder, or a known model's name: see rollout.kit.models)."""
    from rollout.contract.plugins import load_factory
    from rollout.kit.models import resolve

    factory = load_factory(name)
    try:
        inspect.signature(factory).bind(model=model, **options)
    except TypeError as exc:
        params = [p for p in inspect.signature(factory).parameters if p != "model"]
        raise InvalidRequestError("backend_options", f"backend {name!r}: {exc}",
                                  ", ".join(params) or "none") from None
    return Rollout(factory(model=resolve(model), **options), name=name)

