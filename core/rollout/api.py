"""`Rollout`: the one object a trainer talks to, whatever backend sits behind it.

It checks the backend against the hook specifications when it is registered, validates
requests one by one (a bad request fails alone), enforces the released/resumed state and
capabilities, and keeps lifecycle calls (release, resume, update_weights) from running
while a generate call is in flight.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import pluggy

from rollout.contract import convert, hookspecs
from rollout.contract.errors import (
    BackendContractError,
    BackendReleasedError,
    InvalidRequestError,
    RolloutError,
    RolloutTimeoutError,
)
from rollout.contract.schemas import TAGS, Capabilities, Completion, Request

# A supported capability needs these hooks implemented.
HOOKS_FOR = {"release": ("release", "resume"), "update_weights": ("update_weights",),
             "abort": ("abort",)}
LIFECYCLE_TIMEOUT_S = 600.0
ABORT_RESEND_S = 0.5  # a timed-out call's abort is sent again this often until it returns


class Rollout:
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
        self.capabilities = caps
        self._implemented = implemented
        self._backend = backend
        self._released: set[str] = set()
        self._closed = False
        self._gate = threading.Condition()
        self._generating = 0
        self._lifecycle = False

    # --- generation ---------------------------------------------------------------------

    def generate(
        self, requests: Sequence[Request | Mapping], timeout: float | None = None
    ) -> list[Completion]:
        """One Completion per request, in order. A request that is invalid, or that fails in
        the engine, carries its error; the rest of the batch completes. With `timeout`,
        requests still running then are aborted and return what they have."""
        completions: list[Completion | None] = [None] * len(requests)
        valid: list[tuple[int, Request]] = []
        seen: set[str] = set()
        for i, item in enumerate(requests):
            try:
                request = item if isinstance(item, Request) else convert.structure(item, Request)
                self._check_request(request, seen)
            except InvalidRequestError as exc:
                rid = item.id if isinstance(item, Request) else _raw_id(item, i)
                completions[i] = Completion(rid, error=exc)
                continue
            seen.add(request.id)
            valid.append((i, request))
        if valid:
            with self._generating_section():
                outputs = self._generate_hook([r for _, r in valid], timeout)
            for (i, request), output in zip(valid, outputs):
                completions[i] = self._completion(request, output)
        return completions  # type: ignore[return-value]

    async def agenerate(
        self, requests: Sequence[Request | Mapping], timeout: float | None = None
    ) -> list[Completion]:
        import asyncio

        return await asyncio.to_thread(self.generate, requests, timeout)

    def _check_request(self, request: Request, seen: set[str]) -> None:
        if request.id in seen:
            raise InvalidRequestError("id", f"{request.id!r} appears twice in the batch",
                                      "ids unique within a batch")
        needs = []
        if request.sampling.logprobs is not None:
            needs.append(("logprobs", "sampling.logprobs"))
        if request.sampling.seed is not None:
            needs.append(("seed", "sampling.seed"))
        if request.messages is not None:
            needs.append(("chat", "messages"))
            if any(m.images for m in request.messages):
                needs.append(("images", "messages"))
            if request.tools or any(m.tool_calls for m in request.messages):
                needs.append(("tools", "tools" if request.tools else "messages"))
        structured = request.sampling.structured_outputs
        if structured is not None:
            needs.append((f"structured_outputs.{structured.kind}",
                          f"sampling.structured_outputs.{structured.kind}"))
        for capability, field in needs:
            if not self.capabilities.supports(capability):
                raise InvalidRequestError(
                    field, f"backend {self.name!r} does not support {capability}: "
                    f"{self.capabilities.unsupported[capability]}")

    def _generate_hook(self, requests: list[Request], timeout: float | None) -> list:
        done = threading.Event()
        if timeout is not None:
            self.capabilities.require("abort")
            ids = [r.id for r in requests]

            def abort_when_late():
                # Sent again until the call returns: a starved process may reach the
                # backend's registration of these requests only after a first abort.
                if not done.wait(timeout):
                    while True:
                        self._pm.hook.abort(request_ids=ids)
                        if done.wait(ABORT_RESEND_S):
                            return

            threading.Thread(target=abort_when_late, name="rollout-timeout", daemon=True).start()
        try:
            outputs = self._pm.hook.generate(requests=requests)
        finally:
            done.set()
        if not isinstance(outputs, list) or len(outputs) != len(requests):
            raise BackendContractError(
                f"backend {self.name!r}: generate returned {type(outputs).__name__} "
                f"of {len(outputs) if isinstance(outputs, list) else '?'} entries "
                f"for {len(requests)} requests")
        return outputs

    def _completion(self, request: Request, output) -> Completion:
        if isinstance(output, RolloutError):
            return Completion(request.id, error=output)
        results = tuple(output)
        if [r.index for r in results] != list(range(request.sampling.n)) or any(
            r.request_id != request.id for r in results
        ):
            raise BackendContractError(
                f"backend {self.name!r}: request {request.id!r} asked for "
                f"{request.sampling.n} samples, got indices {[r.index for r in results]}")
        return Completion(request.id, results)

    # --- lifecycle ----------------------------------------------------------------------

    def release(self, tags: Iterable[str] | None = None) -> None:
        """Free the weights and/or KV cache (all by default)."""
        tags = _tags(tags)
        self.capabilities.require("release")
        with self._lifecycle_section():
            todo = tuple(t for t in tags if t not in self._released)
            if todo:
                self._pm.hook.release(tags=todo)
                self._released.update(todo)

    def resume(self, tags: Iterable[str] | None = None) -> None:
        """Bring back released memory, weights before KV cache (all by default)."""
        tags = _tags(tags)
        self.capabilities.require("release")
        with self._lifecycle_section():
            self._resume(tags)

    def _resume(self, tags: tuple[str, ...]) -> None:
        todo = tuple(t for t in TAGS if t in tags and t in self._released)
        if todo:
            self._pm.hook.resume(tags=todo)
            self._released.difference_update(todo)

    @property
    def released(self) -> frozenset[str]:
        return frozenset(self._released)

    def update_weights(self, named_tensors: Iterable, bucket_bytes: int | None = None) -> None:
        """Load new weights, given as (name, tensor) pairs, packed into buckets."""
        from rollout.kit.buckets import DEFAULT_BUCKET_BYTES, iter_buckets

        self.capabilities.require("update_weights")
        with self._lifecycle_section():
            if "weights" in self._released:
                raise BackendReleasedError(
                    f"backend {self.name!r}: weights are released; resume(['weights']) first")
            buckets = iter_buckets(named_tensors, bucket_bytes or DEFAULT_BUCKET_BYTES)
            self._pm.hook.update_weights(buckets=buckets)

    def abort(self, request_ids: Iterable[str] | None = None) -> None:
        """Stop running requests (all when None); they return partial output."""
        self.capabilities.require("abort")
        ids = None if request_ids is None else list(request_ids)
        self._pm.hook.abort(request_ids=ids)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if "close" in self._implemented:
                self._pm.hook.close()

    def __enter__(self) -> Rollout:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- state ---------------------------------------------------------------------------

    def _generating_section(self):
        return _Section(self, lifecycle=False)

    def _lifecycle_section(self):
        return _Section(self, lifecycle=True)


class _Section:
    """Generate calls run together; a lifecycle call runs alone. Waits are bounded."""

    def __init__(self, owner: Rollout, lifecycle: bool):
        self.owner, self.lifecycle = owner, lifecycle

    def __enter__(self):
        o = self.owner
        with o._gate:
            busy = (lambda: o._lifecycle or o._generating) if self.lifecycle else (
                lambda: o._lifecycle)
            if not o._gate.wait_for(lambda: not busy(), timeout=LIFECYCLE_TIMEOUT_S):
                raise RolloutTimeoutError(
                    f"backend {o.name!r}: waited {LIFECYCLE_TIMEOUT_S:.0f} s for "
                    f"{'running generate calls' if self.lifecycle else 'a weight update or release'}")
            if o._closed:
                raise BackendReleasedError(f"backend {o.name!r} is closed")
            if self.lifecycle:
                o._lifecycle = True
            else:
                if o._released:
                    if not o.capabilities.auto_resume:
                        raise BackendReleasedError(
                            f"backend {o.name!r}: {', '.join(sorted(o._released))} released; "
                            "call resume() before generate()")
                    o._lifecycle = True
                    try:
                        o._resume(TAGS)
                    finally:
                        o._lifecycle = False
                o._generating += 1
        return self

    def __exit__(self, *exc):
        o = self.owner
        with o._gate:
            if self.lifecycle:
                o._lifecycle = False
            else:
                o._generating -= 1
            o._gate.notify_all()


def _tags(tags: Iterable[str] | None) -> tuple[str, ...]:
    if tags is None:
        return TAGS
    tags = tuple([tags] if isinstance(tags, str) else tags)
    bad = [t for t in tags if t not in TAGS]
    if bad or not tags:
        raise InvalidRequestError("tags", f"got {list(tags)!r}", ", ".join(TAGS))
    return tags


def _raw_id(item: Any, index: int) -> str:
    rid = item.get("id") if isinstance(item, Mapping) else None
    return rid if isinstance(rid, str) and rid else f"#{index}"


def load_backend(name: str, model: str, **options: Any) -> Rollout:
    """Load the backend registered as `name` in `rollout.backends` on `model`."""
    from rollout.contract.plugins import load_factory

    factory = load_factory(name)
    try:
        inspect.signature(factory).bind(model=model, **options)
    except TypeError as exc:
        params = [p for p in inspect.signature(factory).parameters if p != "model"]
        raise InvalidRequestError("backend_options", f"backend {name!r}: {exc}",
                                  ", ".join(params) or "none") from None
    return Rollout(factory(model=model, **options), name=name)
