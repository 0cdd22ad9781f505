"""The interface every SGLang engine of this backend offers: what `SGLangBackend` and the
weight senders call, and nothing else. The engines (rollout_sglang.engines):

- `InProcessEngine`: `sglang.Engine` in this process, its tokenizer manager on the engine
  loop;
- `ServerEngine`: `sglang.launch_server` as a child process, over its native HTTP API. It
  is also a `GroupEngine`: the gloo transport, which only server mode takes, opens a
  collective group with it.

Their asyncio methods run on the engine loop (`rollout.kit.aio.engine_loop()`); the backend
waits for them from its thread with `run`. Every body is built in `rollout_sglang.protocol`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from typing import Protocol, TypeVar

T = TypeVar("T")


class Engine(Protocol):
    loop: asyncio.AbstractEventLoop  # the engine loop its coroutines run on

    def start(self) -> None:
        """Create or launch SGLang and return once it takes requests; raise if it cannot.
        `close()` is called after a failed start too."""

    def check(self) -> None:
        """Raise EngineDeadError if the engine has died."""

    def run(self, coro: Awaitable[T], timeout: float, what: str) -> T:
        """Wait, from another thread, for `coro` on the engine loop: RolloutTimeoutError
        after `timeout` (naming `what`), EngineDeadError within about a second of a death."""

    async def max_input_tokens(self) -> int:
        """The longest prompt SGLang takes."""

    def image_data(self, images) -> list:
        """A prompt's images (rollout.kit.images.PromptImage) as SGLang's `image_data`."""

    def image_stats(self) -> dict[str, int] | None:
        """SGLang's image cache counters where this process can read them; else None."""

    def stream(self, body: dict) -> AsyncIterator[dict]:
        """One sample's outputs as SGLang makes them; closing or cancelling the iterator
        aborts the sample in SGLang."""

    async def generate(self, body: dict) -> dict:
        """One answer, for a body without streaming."""

    async def begin_update(self) -> None:
        """Open SGLang's weight-update session."""

    async def update_tensors(self, group: list) -> None:
        """Load one group of (name, tensor) pairs (the "tensor" transport)."""

    async def end_update(self) -> None:
        """Close SGLang's weight-update session."""

    async def pause(self) -> None:
        """Hold SGLang's scheduler between two steps, its running requests kept in it with
        their KV cache; new requests wait."""

    async def go_on(self) -> None:
        """Let the scheduler run again after `pause`."""

    async def name_weights(self, updates: int) -> None:
        """Name the weights loaded now by the number of updates made: SGLang marks where
        each running request's tokens change name (protocol.weight_spans)."""

    async def abort_all(self) -> None:
        """Abort every request SGLang holds."""

    async def load_adapter(self, name: str, rank: int, scale: float, modules: list[str],
                           tensors: dict) -> None:
        """Load LoRA adapter `name` from its tensors."""

    async def unload_adapter(self, name: str) -> None: ...

    async def update_from_disk(self, path: str) -> None:
        """Load the weights of a checkpoint folder."""

    async def flush_cache(self) -> bool:
        """Drop the prefix cache; False while requests still run."""

    async def release(self, tags: list[str]) -> None: ...

    async def resume(self, tags: list[str]) -> None: ...

    def close(self) -> None:
        """Stop SGLang and what it started; every wait bounded."""


class GroupEngine(Engine, Protocol):
    """An engine in another process that weights reach through a collective group."""

    async def init_group(self, body: dict, timeout: float) -> None:
        """Join the update group; answers once the trainer has joined too."""

    async def update_distributed(self, body: dict) -> None:
        """Receive one announced group of tensors by broadcast, and load it."""

    async def destroy_group(self, name: str) -> None: ...
