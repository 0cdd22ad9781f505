"""The rollout contract: the hooks a backend implements.

A backend is an object whose methods carry `@rollout.hookimpl`; each instance is registered
in its own plugin manager, so one answer per hook is wanted (`firstresult`). Required hooks:
`capabilities`, `prompt_encoder` and `generate`; the lifecycle hooks may be left out when
`capabilities()` lists them as unsupported.

Threading rules. The core (`rollout.Rollout`) runs every `generate` on one event loop, the
engine loop (`rollout.kit.aio.engine_loop()`), one request per call, thousands at a time:
a backend must never block that loop (an engine that computes on the calling thread, like
transformers, computes on a thread of its own and hands tokens back to the loop). Lifecycle
hooks (`release`, `resume`, `update_weights`, `close`) are called from the trainer's thread,
never from the engine loop, and only while no request is running; they may block, and may
run coroutines on the engine loop and wait for them.

Error rules. A request's own problem (a value the engine refuses, a grammar that does not
compile) is raised from `generate` as a `RolloutError` (`InvalidRequestError` naming the
field where there is one): it fails that request alone. `EngineDeadError` means the engine
is gone: every later request fails with it too. Anything else raised is a backend bug and
fails that request with a `GenerationError`.

Aborts and timeouts are the core's: it stops a request by cancelling the consumer of its
`generate` iterator. The cancellation reaches the iterator wherever it waits (before or
after the engine has registered the request); its clean-up (a `finally`) must remove the
request from the engine, without waiting on it for long. What the iterator yielded before is
what the caller gets back, with finish reason `abort`. An iterator that holds tokens back
(`streaming` False) should yield them as the cancellation comes, before it raises it again
(a bounded wait for the engine, with no finish reason): an abort then returns every token
made, and a "keep" weight update continues from them instead of making them again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Iterable

    from rollout.contract.schemas import Capabilities, Chunk, Request
    from rollout.weights.buckets import Bucket
    from rollout.kit.images import PromptImage
    from rollout.kit.prompts import PromptEncoder

PROJECT = "rollout"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

REQUIRED = ("capabilities", "prompt_encoder", "generate")


@hookspec(firstresult=True)
def capabilities() -> Capabilities:
    """Say what this backend supports here (and why not, for what it lacks)."""


@hookspec(firstresult=True)
def prompt_encoder() -> PromptEncoder:
    """The model's prompt encoder (`rollout.kit.prompts.PromptEncoder`): the core encodes
    every prompt with it, and decodes every text, the same way for every backend."""


@hookspec(firstresult=True)
def generate(request: Request, prompt_token_ids: list[int], streaming: bool,
             images: tuple[PromptImage, ...]) -> AsyncIterator[Chunk]:
    """Generate the `request.sampling.n` samples of one valid request.

    Called on the engine loop; returns an async iterator (an `async def` with `yield`) that
    yields `Chunk`s as the engine makes tokens: a chunk's `token_ids` follow those of the
    sample's earlier chunks, with one logprob (and one top-logprobs entry when k > 0) per
    token when the request asks for them. Every sample ends with a chunk whose
    `finish_reason` is "stop" (EOS, a stop token or a stop string) or "length" (max_tokens
    or the context length); the iterator then ends. Samples may interleave. Chunks may hold
    several tokens, but a chunk should leave as soon as the engine has its tokens: the
    caller may be streaming them.

    :param request: validated, and within the backend's capabilities.
    :param prompt_token_ids: the prompt as the core encoded it; exactly what the engine sees.
    :param streaming: whether the caller reads chunks as they come (`Rollout.stream`, the
        server). When False, a backend may hand tokens over a few at a time if that is
        cheaper (and hands over the rest when it is stopped: see "Aborts" above).
    :param images: the prompt's images, loaded (RGB PIL images with a content hash id), one
        per image placeholder token of `prompt_token_ids`, in order; empty for a text
        prompt. Only a backend that supports `images` gets any, and only a backend that
        supports them needs to take this argument.
    """


@hookspec(firstresult=True)
def stats() -> dict[str, int]:
    """Optional: the backend's counters, cumulative since it started (the HF backend's
    `images_processed`, `image_cache_hits`); `Rollout.health()` shows them as `stats`.
    Called from any thread while requests run: it must be cheap and never block long."""


@hookspec(firstresult=True)
def release(tags: tuple[str, ...]) -> None:
    """Free memory: `weights`, `kv_cache` or both. Called only while no request runs."""


@hookspec(firstresult=True)
def resume(tags: tuple[str, ...]) -> None:
    """Bring released memory back; called with `weights` before `kv_cache`."""


@hookspec(firstresult=True)
def update_weights(buckets: Iterable[Bucket]) -> None:
    """Replace weights in place from buckets packed by `rollout.weights.buckets`. Called only
    while no request runs, but for a backend that offers `keep_kv`: then requests may run
    in its engine meanwhile, and it swaps the weights between two of their steps, stamps
    each chunk with the number of updates that had succeeded when its tokens were made
    (`Chunk.weight_update`), and fails the requests it runs if an update fails midway.

    :param buckets: an iterator; each bucket holds whole tensors, in the trainer's order.
    """


@hookspec(firstresult=True)
def load_adapter(name: str, config: dict, buckets: Iterable[Bucket]) -> None:
    """Load LoRA adapter `name`, or replace the one loaded under that name, from buckets of
    PEFT's tensors (`base_model.model.<module>.lora_A.weight`, `.lora_B.weight`) and its
    LoraConfig as a dict. Check everything before changing anything: a load that fails
    leaves the adapters as they were. Called only while no request runs. A backend that
    implements it implements `unload_adapter` too, and takes `Request.adapter` in
    `generate`."""


@hookspec(firstresult=True)
def unload_adapter(name: str) -> None:
    """Unload adapter `name` (loaded). Called only while no request runs."""


@hookspec(firstresult=True)
def close() -> None:
    """Stop the engine and free everything; the backend is not used again."""
