"""`Sampler`: what a trainer, a job, the agent runner or an integration samples from.

Two implementations, one meaning: `rollout.Rollout` (a backend in this process) and
`rollout.ServedRollout` (a backend in other processes: a `rollout serve` at a URL, or
replicas it starts). Code that takes a `Sampler` never asks which one it holds.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from rollout.contract.schemas import Capabilities, Chunk, Completion, Request


class ChunkStream(Protocol):
    """`async for` gives a request's chunks; then `completion` holds the whole of it.
    `aclose()` stops the request if it still runs."""

    completion: Completion | None

    def __aiter__(self) -> AsyncIterator[Chunk]: ...

    async def aclose(self) -> None: ...


@runtime_checkable
class Sampler(Protocol):
    name: str
    capabilities: Capabilities  # what the backend behind it supports
    # The version of the weights that serve new requests (the last update's `version`).
    weight_version: int | None
    # The model's prompt encoder (tokenizer, chat template, context length) where this
    # process has one; None for a sampler in other processes (give the agent runner the
    # model's tokenizer then).
    encoder: Any
    # The LoRA adapters loaded through this sampler, by name, with their versions.
    adapters: dict[str, int | None]

    def generate(self, requests: Sequence[Request | Mapping],
                 timeout: float | None = None) -> list[Completion]:
        """One Completion per request, in order; a bad request carries its own error and
        the others complete. With `timeout`, requests still running then are aborted and
        return what they made (finish reason "abort")."""

    async def agenerate(self, request: Request | Mapping,
                        timeout: float | None = None) -> Completion:
        """One request, awaited on any event loop. Cancelling the call stops it."""

    def stream(self, request: Request | Mapping, timeout: float | None = None
               ) -> ChunkStream:
        """The request's chunks as they are made; leaving early stops the request."""

    def abort(self, request_ids: Iterable[str] | None = None) -> None:
        """Stop running requests (all of this sampler's when None), from any thread; each
        returns what it made, with finish reason "abort". Unknown ids are ignored."""

    def update_weights(self, named_tensors: Iterable, bucket_bytes: int | None = None,
                       version: int | None = None, pause: str = "wait") -> None:
        """Load new weights, (name, tensor) pairs, packed into buckets; `version` labels
        the tokens made from then on (`Result.weight_versions`). `pause`: "wait" lets
        running requests finish first, "abort" stops them (continue one later with
        `Request.continue_from`), "keep" holds them while the weights load and then lets
        them go on under the new ones (`capabilities.keep`), "keep_kv" leaves them in the
        engine, their KV cache as the old weights made it (where the backend offers
        `keep_kv`). A failed update leaves the weights dirty: nothing runs until a full
        update succeeds."""

    def load_adapter(self, name: str, named_tensors: Iterable, config: Mapping,
                     version: int | None = None, bucket_bytes: int | None = None,
                     pause: str = "wait") -> None:
        """Load LoRA adapter `name` (or replace the one loaded under it) from PEFT's
        tensors and its `LoraConfig` as a dict; requests that name it (`Request.adapter`)
        then sample with it, and their results say `version`. `pause` as for
        `update_weights`, "keep" and "keep_kv" excepted. A load that fails changes nothing
        (`capabilities.adapters` says whether the backend has adapters)."""

    def unload_adapter(self, name: str) -> None:
        """Unload adapter `name`; requests that name it are then refused."""

    def health(self) -> dict:
        """What runs now; raises when nothing can serve."""

    def release(self, tags: Iterable[str] | None = None) -> None:
        """Free the weights and/or KV cache (all by default)."""

    def resume(self, tags: Iterable[str] | None = None) -> None:
        """Bring back released memory."""

    def close(self) -> None:
        """Stop running requests and the engines this sampler started."""

    def __enter__(self) -> Sampler: ...

    def __exit__(self, *exc) -> None: ...
