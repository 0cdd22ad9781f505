"""Runs inside vLLM's worker process (`worker_extension_cls`): weight updates arrive as
safetensors bytes, never as pickle, whether over RPC or over HTTP (as base64)."""

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
