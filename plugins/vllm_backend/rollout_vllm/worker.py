"""Runs inside vLLM's worker (`worker_extension_cls`). Weight updates arrive as tensors
when the worker is in this process, and as safetensors bytes (base64 over HTTP), never as
pickle, when it is not."""

from __future__ import annotations

import base64


class WeightUpdateExtension:
    def rollout_update_weights(self, data: bytes | str) -> int:
        from safetensors.torch import load

        if isinstance(data, str):
            data = base64.b64decode(data)
        tensors = load(bytes(data))
        self.reload_weights(weights_iterator=list(tensors.items()))
        return len(tensors)

    def rollout_load_tensors(self, tensors: list) -> int:
        self.reload_weights(weights_iterator=tensors)
        return len(tensors)
