"""LoRA adapters on the HF backend, each row of a forward pass with its own (or none), as
vLLM's punica kernels batch them: forward hooks on the adapted Linear modules add
`scale * (x @ A.T) @ B.T` to the rows of each adapter. The base weights are never touched,
so adapters load, replace and unload in place, and rows of different adapters share a
batch.

An adapter is read and checked by `rollout.weights.lora.read_adapter`.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import contextmanager

import attrs
import torch

from rollout.weights.buckets import Bucket, unpack
from rollout.weights.lora import Adapter, no_such_adapter, read_adapter


class Adapters:
    """The loaded adapters by name, and the rows of the forward pass running now."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.linears = {name: m for name, m in model.named_modules()
                        if isinstance(m, torch.nn.Linear)}
        self.loaded: dict[str, Adapter] = {}
        self._hooks: dict[str, object] = {}
        # The rows of each adapter in the forward pass running now (None: every row), set
        # by `active` on the engine thread; None without an adapter.
        self._groups: dict[str, torch.Tensor | None] | None = None
        self._weight = next(model.parameters())  # the model's device and dtype

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
            raise no_such_adapter(name, self.loaded)
        del self.loaded[name]
        used = {m for a in self.loaded.values() for m in a.weights}
        for module in set(self._hooks) - used:
            self._hooks.pop(module).remove()

    @contextmanager
    def active(self, rows: list[str | None]):
        """Each row of the forward passes inside takes the adapter named at its place."""
        groups: dict[str, list[int]] = {}
        for i, name in enumerate(rows):
            if name is not None:
                groups.setdefault(name, []).append(i)
        # Made once a pass, not once per hooked layer; a batch of one adapter (an RL
        # policy's) gathers and scatters no row.
        self._groups = {name: None if len(index) == len(rows)
                        else torch.tensor(index, device=self._weight.device)
                        for name, index in groups.items()} or None
        try:
            yield
        finally:
            self._groups = None

    def _hook(self, module: str):
        def add_deltas(linear, args, output):
            groups = self._groups
            if groups is None:
                return output
            x = args[0]
            for name, index in groups.items():
                adapter = self.loaded[name]
                weights = adapter.weights.get(module)
                if weights is None:
                    continue
                a, b = weights
                if index is None:  # in place, into the rows as one matrix
                    output.view(-1, output.shape[-1]).addmm_(
                        x.reshape(-1, x.shape[-1]) @ a.T, b.T, alpha=adapter.scale)
                else:
                    delta = (x.index_select(0, index) @ a.T) @ b.T
                    output.index_add_(0, index, delta, alpha=adapter.scale)
            return output
        return add_deltas

    def _read(self, config: dict, tensors: Iterable) -> Adapter:
        adapter = read_adapter(config, tensors, {name: (m.out_features, m.in_features)
                                                 for name, m in self.linears.items()})
        # Copies (the caller's tensors may be a trainer's parameters), all in one new buffer
        # that the core's bucket packs with one memcpy each: hundreds of tensors cost less
        # than one torch copy each.
        weight = self._weight
        named = [(f"{module}:{which}", t.to(weight.device, weight.dtype))
                 for module, pair in adapter.weights.items() for which, t in zip("AB", pair)]
        copies = dict(unpack(Bucket.of(named)))
        return attrs.evolve(adapter, weights={m: (copies[f"{m}:A"], copies[f"{m}:B"])
                                              for m in adapter.weights})
