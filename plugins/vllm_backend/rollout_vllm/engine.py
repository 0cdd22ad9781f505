"""The interface every vLLM engine of this backend offers: what `VLLMBackend` calls, and
nothing else. The engines, one module each:

- `in_process.InProcessEngine`: vLLM's LLMEngine in this process, stepped by a thread of ours;
- `async_engine.AsyncEngine`: vLLM's AsyncLLM, its engine core in a child process;
- `server_engine.ServerEngine`: vLLM's OpenAI server as a child process, over HTTP.

Their asyncio methods run on the engine loop (`rollout.kit.aio.engine_loop()`); the backend
waits for them from its thread. How weights reach an engine is the engine's to say, once,
when the backend starts (`weight_path`): as tensors in process, as shared-memory messages
to another process, or through vLLM's weight-transfer routes and a gloo group (server mode);
every path ends in `rollout_vllm.worker` or `rollout_vllm.transfer_engine` inside vLLM."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from typing import TYPE_CHECKING, NamedTuple, Protocol

if TYPE_CHECKING:
    from rollout import Chunk
    from rollout.kit.aio import LoopThread


class Spans(NamedTuple):
    """Sample `index`'s output tokens in runs by the weights that made them, (updates made,
    start, end), as vLLM reports them as it finishes a sample."""

    index: int
    runs: list[tuple[int, int, int]]


class WeightPath(Protocol):
    """One way into the engine for weight updates (tensors in process, shared memory, or a
    gloo group), kept from one update to the next."""

    def update(self, groups: Iterable[dict]) -> None:
        """Load every group (name -> tensor, whole decoder layers each) into the engine.
        From the trainer's thread; every wait bounded; raises at the first failure, after
        which the weights are dirty until a full update succeeds."""

    def close(self) -> None:
        """Let go of what the path holds between updates (files, a group)."""


class Engine(Protocol):
    async def start(self) -> None:
        """Create or launch vLLM and return once it takes requests; raise if it cannot.
        `close()` is called after a failed start too."""

    def model_config(self):
        """vLLM's ModelConfig where the model lives in this process; None where it does
        not (the server's)."""

    def yield_cores(self) -> None:
        """The engine's processes were niced (the backend's `nice`): where this process
        waits for them by spinning, it waits on a socket instead, or its spin, at normal
        priority, would take the cores they give up."""

    def generate(self, rid: str, prompt: dict, params: dict,
                 lora=None) -> AsyncIterator[Chunk | Spans]:
        """The chunks of request `rid` as vLLM makes them, each sample's `Spans` just
        before its last chunk where the engine has them. `prompt`: vLLM's prompt dict
        (`prompt_token_ids`, any images, and the `cache_salt` that keeps each weights'
        prefixes apart); `params`: vLLM's SamplingParams fields;
        `lora`: vLLM's LoRARequest of an adapter loaded by `load_adapter`, or None.
        Closing or cancelling the iterator stops the request in vLLM. A request vLLM refuses
        raises its typed error; a dead engine raises EngineDeadError."""

    def weight_path(self, transport: str, loop: LoopThread, timeout: float,
                    group_timeout: float) -> WeightPath:
        """The path weight updates take into this engine, made once by the backend.
        `transport`: the backend's `weight_transport` (already checked against the mode);
        `loop`: the engine loop; `timeout`: each load call's bound; `group_timeout`: a gloo
        group's bound on each broadcast."""

    async def pause(self) -> None:
        """Hold the scheduler between two steps: running requests keep their place and
        their KV cache, new ones wait (a weight update's, from the start of its load to
        `go_on`)."""

    async def go_on(self) -> None:
        """Let the scheduler step again after `pause`."""

    async def name_weights(self, name: str) -> None:
        """vLLM's weight version from the next step on: it labels the tokens each step
        makes, and gives a finished sample's runs by version (`Spans`)."""

    async def release(self, level: int) -> None:
        """vLLM's sleep at `level` (1: weights offloaded to host memory, KV cache dropped)."""

    async def resume(self, tags: list[str]) -> None:
        """vLLM's wake-up of what `tags` name ("weights", "kv_cache")."""

    def mm_cache_counts(self) -> tuple[int, int] | None:
        """(hits, lookups) of vLLM's multimodal processor cache, cumulative and kept across
        sleep; None without a cache. From any thread."""

    async def close(self) -> None:
        """Stop vLLM and every process it started; safe after a failed or partial start."""


class AdapterEngine(Engine, Protocol):
    """An engine whose worker is reached by `collective_rpc` (in process, its core in a
    child process, or through vLLM's server), which loads LoRA adapters from tensors
    (`rollout_vllm.lora`)."""

    async def load_adapter(self, lora, config: dict, tensors: dict, timeout: float) -> None:
        """Keep and load adapter `lora` (vLLM's LoRARequest; PEFT's tensors by name, which
        may be views the caller reuses after this call; its LoraConfig as a dict) in the
        worker; raise what vLLM refuses."""

    async def unload_adapter(self, lora, timeout: float) -> None:
        """Drop adapter `lora` from the worker."""


class ShmEngine(Engine, Protocol):
    """An engine in another process, which loads weights from shared memory
    (`rollout_vllm.transport.ShmPipeline`)."""

    async def load_weights(self, message: dict, timeout: float) -> None:
        """Load the group packed in the shared-memory file that `message` names
        (`rollout.weights.transports.shm`); answers once the worker holds no view of the
        file. `timeout` bounds the worker's call."""


class GroupEngine(Engine, Protocol):
    """vLLM's server, which weights reach through a collective group by its weight-transfer
    routes (`rollout_vllm.transport.GlooSender`)."""

    async def init_weight_transfer(self, init_info: dict, timeout: float) -> None:
        """Join the update group; answers once the trainer has joined too."""

    async def start_weight_update(self, timeout: float) -> None: ...

    async def update_weights_chunk(self, update_info: dict, timeout: float) -> None:
        """Receive one announced group of tensors by broadcast, and load it."""

    async def finish_weight_update(self, version: str | None, timeout: float) -> None: ...

    async def shutdown_weight_transfer(self, timeout: float) -> None: ...
