"""LoRA adapters on the HF backend, each row of a forward pass with its own (or none), as
vLLM's punica kernels batch them: forward hooks on the adapted Linear modules add
`scale * (x @ A.T) @ B.T` to the rows of each adapter. The base weights are never touched,
so adapters load, replace and unload in place, and rows of different adapters share a
batch.

An adapter comes as PEFT's tensors (`get_peft_model_state_dict`, `adapter_model.safetensors`:
`base_model.model.<module>.lora_A.weight` and `.lora_B.weight`) and its `LoraConfig` as a
dict (`r`, `lora_alpha`, `use_rslora`). What a plain LoRA of Linear layers is not (DoRA,
biases, `modules_to_save`, embeddings) is refused by name.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from contextlib import contextmanager

import attrs
import torch

from rollout import InvalidRequestError

PEFT_NAME = re.compile(r"^(?:base_model\.model\.)?(.+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")
# LoraConfig settings that change what the adapter computes, and the values this supports.
PLAIN = {"use_dora": (False, None), "bias": ("none", None), "modules_to_save": (None, []),
         "lora_bias": (False, None)}


@attrs.frozen
class Adapter:
    scale: float
    weights: dict  # module name -> (A [r, in], B [out, r])


class Adapters:
    """The loaded adapters by name, and the rows of the forward pass running now."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.linears = {name: m for name, m in model.named_modules()
                        if isinstance(m, torch.nn.Linear)}
        self.loaded: dict[str, Adapter] = {}
        self._hooks: dict[str, object] = {}
        self._rows: list[str | None] | None = None  # set by `active` on the engine thread

    def load(self, name: str, config: dict, tensors: Iterable) -> None:
        """Load (or replace) adapter `name`; checks everything before changing anything."""
        adapter = self._read(config, tensors)
        self.loaded[name] = adapter
        for module in adapter.weights:
            if module not in self._hooks:
                self._hooks[module] = self.linears[module].register_forward_hook(
                    self._hook(module))

    def unload(self, name: str) -> None:
        if name not in self.loaded:
            raise InvalidRequestError("adapter", f"no adapter named {name!r}",
                                      ", ".join(self.loaded) or "none loaded")
        del self.loaded[name]
        used = {m for a in self.loaded.values() for m in a.weights}
        for module in set(self._hooks) - used:
            self._hooks.pop(module).remove()

    @contextmanager
    def active(self, rows: list[str | None]):
        """Each row of the forward passes inside takes the adapter named at its place."""
        self._rows = rows if any(rows) else None
        try:
            yield
        finally:
            self._rows = None

    def _hook(self, module: str):
        def add_deltas(linear, args, output):
            rows = self._rows
            if rows is None:
                return output
            x = args[0]
            for name in set(rows) - {None}:
                weights = self.loaded[name].weights.get(module)
                if weights is None:
                    continue
                a, b = weights
                index = torch.tensor([i for i, r in enumerate(rows) if r == name],
                                     device=x.device)
                delta = (x.index_select(0, index) @ a.T) @ b.T
                output.index_add_(0, index, delta, alpha=self.loaded[name].scale)
            return output
        return add_deltas

    def _read(self, config: dict, tensors: Iterable) -> Adapter:
        if not isinstance(config, dict):
            raise InvalidRequestError("config", f"got {type(config).__name__}",
                                      "a LoraConfig as a dict (r, lora_alpha, ...)")
        for key, allowed in PLAIN.items():
            if config.get(key) not in allowed:
                raise InvalidRequestError(f"config.{key}", f"got {config[key]!r}: not a "
                                          "plain LoRA of Linear layers", repr(allowed[0]))
        rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
        if not isinstance(rank, int) or rank < 1:
            raise InvalidRequestError("config.r", f"got {rank!r}", "an integer >= 1")
        scale = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
        parts: dict[str, dict[str, torch.Tensor]] = {}
        for tensor_name, tensor in tensors:
            match = PEFT_NAME.match(tensor_name)
            if match is None:
                raise InvalidRequestError("tensors", f"{tensor_name!r} is no LoRA weight",
                                          "PEFT names: base_model.model.<module>.lora_A"
                                          ".weight and .lora_B.weight")
            module, which = match.groups()
            if module not in self.linears:
                raise InvalidRequestError("tensors", f"{tensor_name!r}: the model has no "
                                          f"Linear module {module!r}", "the model's Linear "
                                          "modules")
            parts.setdefault(module, {})[which] = tensor
        weights = {}
        for module, pair in parts.items():
            linear = self.linears[module]
            expected = {"A": (rank, linear.in_features), "B": (linear.out_features, rank)}
            for which, shape in expected.items():
                got = pair.get(which)
                if got is None:
                    raise InvalidRequestError("tensors", f"{module!r} has no lora_{which}",
                                              "both lora_A and lora_B of each module")
                if tuple(got.shape) != shape:
                    raise InvalidRequestError(
                        "tensors", f"{module}.lora_{which} has shape {tuple(got.shape)}",
                        f"shape {shape} (r={rank})")
            weight = linear.weight
            weights[module] = tuple(pair[w].to(weight.device, weight.dtype, copy=True)
                                    for w in "AB")
        if not weights:
            raise InvalidRequestError("tensors", "no LoRA weight given",
                                      "lora_A and lora_B of each adapted module")
        return Adapter(scale, weights)
