"""verl sampling through any `rollout` backend: `actor_rollout_ref.rollout.name=rollout`.

verl picks its rollout engine by name in two registries, and imports the modules named in
`VERL_USE_EXTERNAL_MODULES` at start-up; this one fills both when imported:

- `RolloutReplicaRegistry["rollout"]`: `Replica`, one replica of verl's server manager. It
  starts a `Server` Ray actor (verl's duck-typed server: token-in-token-out `generate`,
  sleep and wake-up, abort and resume, global steps) holding a `Rollout`, with `rollout
  serve`'s OpenAI API on the replica's address for verl's chat-completion users.
- `_ROLLOUT_REGISTRY[("rollout", "async")]`: `ServerAdapter`, the object verl keeps in each
  trainer rank; it wakes and sleeps its replica's server and pushes weights to it.

Which backend, and its arguments, come from verl's per-engine `engine_kwargs`:

    VERL_USE_EXTERNAL_MODULES=rollout.integrations.verl python -m verl.trainer.main_ppo \\
        actor_rollout_ref.rollout.name=rollout \\
        +actor_rollout_ref.rollout.engine_kwargs.rollout.backend=vllm

What verl's servers take and `rollout` does not (video and audio inputs, processor kwargs,
priorities, PD disaggregation, profiling) is refused with its name, never dropped.
"""

from __future__ import annotations

import asyncio
from typing import Any

from rollout.contract.errors import InvalidRequestError, UnsupportedError

NAME = "rollout"
# verl's sampling_params keys that are SamplingParams fields of the same name.
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                 "presence_penalty", "frequency_penalty", "ignore_eos", "seed", "stop",
                 "stop_token_ids", "min_tokens", "include_stop_str_in_output")
LENGTH_KEYS = ("max_tokens", "max_new_tokens")
HELD_AT_MOST_S = 3600.0  # a request held by abort_all_requests, waiting for the resume
ADAPTER = "verl"  # the LoRA adapter a trainer with peft_config pushes; requests then use it


def sampling(params: dict, prompt_len: int, config: Any) -> dict:
    """`rollout`'s sampling fields for one of verl's `sampling_params` dicts. The length
    default is verl's own: what is left of `response_length` and of the context."""
    fields, unknown = {}, []
    for key, value in params.items():
        if key in SAMPLING_KEYS:
            fields[key] = value
        elif key not in LENGTH_KEYS and key != "logprobs":
            unknown.append(key)
    if unknown:
        raise InvalidRequestError(
            f"sampling_params.{min(unknown)}", "not supported by rollout",
            ", ".join(sorted([*SAMPLING_KEYS, *LENGTH_KEYS, "logprobs"])))
    if fields.get("top_k") in (-1, 0):  # verl's "no top-k"
        fields.pop("top_k")
    length = next((params[k] for k in LENGTH_KEYS if k in params), None)
    if length is None:
        length = min(config.response_length,
                     config.prompt_length + config.response_length - prompt_len)
    if config.max_model_len:
        length = min(length, config.max_model_len - prompt_len)
    if length < 1:
        raise InvalidRequestError(
            "prompt_ids", f"{prompt_len} tokens leave no room to generate (response_length "
            f"{config.response_length}, max_model_len {config.max_model_len})")
    fields["max_tokens"] = int(length)
    if params.get("logprobs"):
        fields["logprobs"] = 0
    return fields


class Server:
    """One replica's engine, as verl's agent loops and trainer call it (a Ray actor)."""

    def __init__(self, config: Any, model_config: Any, replica_rank: int):
        import rollout
        from rollout.apps.serving.app import ServerThread
        from rollout.service.service import LocalService

        self.config = config
        spec = dict((config.engine_kwargs or {}).get(NAME) or {})
        backend = spec.pop("backend", "hf")
        model = getattr(model_config, "local_path", None) or model_config.path
        self.rollout = rollout.load_backend(backend, model=model, **spec)
        self.replica_rank = replica_rank
        self.global_steps: int | None = None
        self.adapter: str | None = None  # once a trainer has pushed its LoRA adapter
        self._admitting = asyncio.Event()
        self._admitting.set()
        self._rejecting = False
        host = _node_ip()
        self._http = ServerThread(LocalService(self.rollout, model), host=host).__enter__()
        self.address = self._http.url.removeprefix("http://")

    def server_address(self) -> str:
        return self.address

    async def generate(self, prompt_ids: list[int], sampling_params: dict, request_id: str,
                       image_data: list | None = None, video_data: list | None = None,
                       audio_data: list | None = None,
                       mm_processor_kwargs: dict | None = None, priority: int = 0,
                       **kwargs: Any):
        from verl.workers.rollout.replica import TokenOutput

        refused = {"video_data": video_data, "audio_data": audio_data,
                   "mm_processor_kwargs": mm_processor_kwargs, **kwargs}
        refused = sorted(k for k, v in refused.items() if v)
        if priority:
            refused.append("priority")
        if refused:
            raise UnsupportedError(", ".join(refused), "rollout's verl server does not take it")
        extra = {"global_steps": self.global_steps}
        if not self._admitting.is_set():
            if self._rejecting:
                return TokenOutput(token_ids=[], stop_reason="aborted", extra_fields=extra)
            await asyncio.wait_for(self._admitting.wait(), HELD_AT_MOST_S)
        prompt_ids = list(prompt_ids)
        fields = sampling(dict(sampling_params), len(prompt_ids), self.config)
        completion = await self.rollout.agenerate(
            {"id": request_id, "prompt_token_ids": prompt_ids, "images": image_data or (),
             "sampling": fields, "adapter": self.adapter})
        result = completion.unwrap()[0]
        extra["num_cached_tokens"] = result.cached_tokens
        return TokenOutput(
            token_ids=list(result.token_ids),
            log_probs=list(result.logprobs) if "logprobs" in fields else None,
            stop_reason="aborted" if result.finish_reason == "abort" else "completed",
            extra_fields=extra)

    async def set_global_steps(self, global_steps: int) -> None:
        self.global_steps = global_steps

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await asyncio.to_thread(self.rollout.resume, tags)

    async def sleep(self) -> None:
        await asyncio.to_thread(self.rollout.release)

    async def release_kv_cache(self) -> None:
        await asyncio.to_thread(self.rollout.release, ["kv_cache"])

    async def resume_kv_cache(self) -> None:
        await asyncio.to_thread(self.rollout.resume, ["kv_cache"])

    async def clear_kv_cache(self) -> None:
        # Emptying the KV cache is what a release and resume of it does.
        await self.release_kv_cache()
        await self.resume_kv_cache()

    async def abort_all_requests(self, reject_request: bool = False) -> dict:
        """Stop every running request (each returns what it made, `aborted`) and hold new
        ones until `resume_generation` (or turn them away, with `reject_request`)."""
        self._rejecting = reject_request
        self._admitting.clear()
        self.rollout.abort()
        return {"aborted": True}

    async def abort_request(self, request_id: str) -> dict:
        self.rollout.abort([request_id])
        return {"aborted": True}

    async def resume_generation(self) -> None:
        self._rejecting = False
        self._admitting.set()

    async def update_weights(self, named_tensors: list, version: int | None = None) -> None:
        """Load one batch of (name, tensor) pairs; Ray's object store carries them."""
        await asyncio.to_thread(self.rollout.update_weights, named_tensors, version=version)

    async def load_adapter(self, named_tensors: list, config: dict,
                           version: int | None = None) -> None:
        """Load (or replace) the trainer's LoRA adapter, PEFT's tensors and config; every
        request samples with it from now on, as on verl's own servers."""
        await asyncio.to_thread(self.rollout.load_adapter, ADAPTER, named_tensors, config,
                                version=version)
        self.adapter = ADAPTER

    async def start_profile(self, **options: Any) -> None:
        raise UnsupportedError("profiling", "rollout's verl server has none")

    async def stop_profile(self) -> None:
        raise UnsupportedError("profiling", "rollout's verl server has none")

    def health(self) -> dict:
        return self.rollout.health()

    def close(self) -> None:
        self._http.__exit__(None, None, None)
        self.rollout.close()


def _node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"


def server_name(replica_rank: int, suffix: str = "") -> str:
    return f"rollout_server_{replica_rank}{suffix}"


def _replica_class():
    import ray
    from verl.workers.rollout.replica import RolloutMode, RolloutReplica

    class Replica(RolloutReplica):
        """One `Server` actor per replica. Standalone and colocated replicas ask Ray for
        the replica's GPUs (none on a CPU-only cluster); a hybrid one goes on the node of
        its first trainer worker, sharing its GPUs."""

        async def init_standalone(self):
            # verl's own builds a GPU resource pool for its worker group; the server actor
            # asks Ray for its GPUs itself.
            self.rollout_mode = RolloutMode.STANDALONE
            await self.launch_servers()

        async def launch_servers(self):
            gpus = self.world_size if _cluster_gpus() else 0
            options = {"name": server_name(self.replica_rank, self.name_suffix),
                       "max_concurrency": self.max_concurrency,
                       "num_cpus": 1, "num_gpus": gpus}
            if self.rollout_mode is RolloutMode.HYBRID and self.workers:
                from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

                node = await self.workers[0].__ray_call__.remote(
                    lambda _: ray.get_runtime_context().get_node_id())
                options.update(num_gpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(
                    node_id=node, soft=False))
            server = ray.remote(Server).options(**options).remote(
                self.config, self.model_config, self.replica_rank)
            self._server_address = await server.server_address.remote()
            self._server_handle = server
            self.servers = [server]

    return Replica


def _cluster_gpus() -> float:
    import ray

    return ray.cluster_resources().get("GPU", 0) if ray.is_initialized() else 0


def _adapter_class():
    import os

    import ray
    from verl.workers.rollout.base import BaseRollout

    class ServerAdapter(BaseRollout):
        """In each trainer rank: the first rank of a replica owns its server and pushes the
        trainer's weights to it, one bucket of tensors per call."""

        def __init__(self, config, model_config, device_mesh, replica_rank: int = -1):
            super().__init__(config, model_config, device_mesh)
            rank = int(os.environ.get("RANK", 0))
            size = (self.config.tensor_model_parallel_size * self.config.data_parallel_size
                    * self.config.pipeline_model_parallel_size)
            self.replica_rank = rank // size if replica_rank == -1 else replica_rank
            self.owner = rank % size == 0
            self.bucket_bytes = self.config.checkpoint_engine.update_weights_bucket_megabytes << 20
            self._server = None

        @property
        def server(self):
            if self._server is None:
                self._server = ray.get_actor(server_name(self.replica_rank))
            return self._server

        async def resume(self, tags: list[str]):
            if self.owner:
                await self.server.wake_up.remote(list(tags))

        async def release(self):
            if self.owner:
                await self.server.sleep.remote()

        async def update_weights(self, weights, wire_format: str = "named_tensors",
                                 global_steps: int | None = None, peft_config=None,
                                 base_sync_done: bool = True):
            """Full (name, tensor) pairs in buckets of verl's bucket size; the last bucket
            stamps `global_steps` as the weight version. With `peft_config` (a LoRA run
            that does not merge), `base_sync_done` says which: the adapter's own tensors
            (True), loaded as the replica's adapter, or the base model's (False), whose
            names verl gives in peft's wrapping."""
            if wire_format != "named_tensors":
                raise UnsupportedError(f"wire_format {wire_format!r}",
                                       "rollout takes 'named_tensors' only")
            if peft_config is not None and base_sync_done:
                tensors = [(name, tensor.detach().to("cpu", copy=True))
                           for name, tensor in weights]
                if self.owner:
                    await self.server.load_adapter.remote(
                        tensors, _config_dict(peft_config), global_steps)
                return
            await _push_buckets(self, weights, global_steps,
                                peft_wrapped=peft_config is not None)

    return ServerAdapter


async def _push_buckets(adapter, weights, global_steps: int | None, peft_wrapped: bool
                        ) -> None:
    """The base model's (name, tensor) pairs to the adapter's server (from its owner rank
    only), in buckets of its bucket size; the last bucket stamps `global_steps`."""
    bucket, size = [], 0
    for name, tensor in weights:  # every rank reads it: it may gather across ranks
        if not adapter.owner:
            continue
        if peft_wrapped:  # verl gives the names in peft's wrapping
            name = name.replace(".base_layer", "")
        tensor = tensor.detach().to("cpu", copy=True)  # a full tensor, off the GPU
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > adapter.bucket_bytes:
            await adapter.server.update_weights.remote(bucket)
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if adapter.owner:
        await adapter.server.update_weights.remote(bucket, global_steps)


def _config_dict(peft_config) -> dict:
    """verl passes peft's LoraConfig itself."""
    return peft_config.to_dict() if hasattr(peft_config, "to_dict") else dict(peft_config)


def register() -> None:
    """Name `rollout` in verl's replica and adapter registries (idempotent)."""
    from verl.workers.rollout import base
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    RolloutReplicaRegistry.register(NAME, _replica_class)
    base._ROLLOUT_REGISTRY[(NAME, "async")] = f"{__name__}.ServerAdapter"


def __getattr__(name: str):
    # verl imports the adapter class by its dotted path; built on first use so that
    # importing this module without verl installed stays possible.
    if name == "ServerAdapter":
        globals()[name] = _adapter_class()
        return globals()[name]
    if name == "Replica":
        globals()[name] = _replica_class()
        return globals()[name]
    raise AttributeError(name)


try:
    import verl  # noqa: F401
except ImportError:
    pass
else:
    register()
