"""Runs inside vLLM's worker (`worker_extension_cls`). Weight updates arrive as tensors
when the worker is in this process, and as a shared-memory bucket named by a JSON message
(never pickle) when it is not. Every call carries whole decoder layers (`backend.layer_groups`),
so each `reload_weights` completes the layers it touches.

Imported by each vLLM worker (as `worker_extension_cls`) before it builds its weight-transfer
engine: this is where our engines join vLLM's registry (loaded only when configured), and
where vLLM's LoRA ops get their CPU fixes (`rollout_vllm.lora`). LoRA adapters arrive as
tensors in process (`rollout_load_adapter_tensors`), else as safetensors bytes
(`rollout_load_adapter`; through vLLM's server, `rollout_keep_adapter`)."""

from __future__ import annotations

import base64

from rollout_vllm import lora
from rollout_vllm.common import refresh_tied_output


def _register_engines() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from rollout_vllm import transfer_engine

    if transfer_engine.NAME not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            transfer_engine.NAME, transfer_engine.__name__, "GlooTransferEngine")


_register_engines()
lora.fix_cpu_ops()


class WeightUpdateExtension:
    def rollout_receive_shm(self, message: dict) -> int:
        from rollout.weights.buckets import unpack
        from rollout.weights.transports.shm import map_shm

        # Loaded from views into the sender's file, not copied out first (a copy of the
        # whole model, as long as vLLM's reload itself). Safe because the sender reuses
        # its file only once we answer, and by then vLLM holds no view: each call is one
        # whole reload (vLLM's layer-wise reload ends in it, its buffered views dropped),
        # and carries whole layers (`backend.layer_groups`), so every layer it touches is
        # rebuilt and copied into the engine's own tensors before it returns.
        tensors = unpack(map_shm(message))
        names = [name for name, _ in tensors]
        try:
            self.reload_weights(weights_iterator=tensors)
        finally:
            del tensors  # the last views (the mapping goes with them)
        refresh_tied_output(self.model_runner.get_model(), names)
        return len(names)

    def rollout_load_tensors(self, tensors: list) -> int:
        self.reload_weights(weights_iterator=tensors)
        refresh_tied_output(self.model_runner.get_model(), [name for name, _ in tensors])
        return len(tensors)

    def rollout_load_adapter(self, lora_id: int, config: dict, data: bytes) -> None:
        lora.load(self, lora_id, config, lora.from_bytes(data))

    def rollout_load_adapter_tensors(self, lora_id: int, config: dict, tensors: dict) -> None:
        # In process: the tensors themselves, the engine's own copies.
        lora.load(self, lora_id, config, tensors)

    def rollout_keep_adapter(self, lora_id: int, config: dict, data: str) -> None:
        # Through vLLM's server (JSON): the bytes in base64; its own route loads it next.
        lora.keep(self, lora_id, config, lora.from_bytes(base64.b64decode(data)))

    def rollout_unload_adapter(self, lora_id: int) -> None:
        lora.unload(self, lora_id)
