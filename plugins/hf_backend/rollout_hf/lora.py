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

from rollout.weights.lora import Adapter, no_such_adapter, one_block, read_adapter


class Adapters:
    """The loaded adapters by name, and the rows of the forward pass running now."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.linears = {name: m for name, m in model.named_modules()
                        if isinstance(m, torch.nn.Linear)}
        self._shapes = {name: (m.out_features, m.in_features)  # what read_adapter checks
                        for name, m in self.linears.items()}
        self.loaded: dict[str, Adapter] = {}
        self._buffers: dict[str, torch.Tensor] = {}  # each adapter's tensors, as one
        self._hooks: dict[str, object] = {}
        # What the forward pass running now adds, set by `active` on the engine thread.
        self._pass: _Pass | None = None
        # Each module's A and B of the adapters of a mixed batch, side by side, for the
        # adapters named by `_stacked_for` (a run's batches mostly name the same ones).
        self._stacked: dict[str, tuple[torch.Tensor, torch.Tensor] | None] = {}
        self._stacked_for: tuple[str, ...] = ()
        self._weight = next(model.parameters())  # the model's device and dtype

    def load(self, name: str, config: dict, tensors: Iterable) -> None:
        """Load (or replace) adapter `name`; checks everything before changing anything."""
        adapter = self._copied(name, read_adapter(config, tensors, self._shapes))
        self.loaded[name] = adapter
        self._stacked_for = ()
        for module in adapter.weights:
            if module not in self._hooks:
                self._hooks[module] = self.linears[module].register_forward_hook(
                    self._hook(module))

    def unload(self, name: str) -> None:
        if name not in self.loaded:
            raise no_such_adapter(name, self.loaded)
        del self.loaded[name], self._buffers[name]
        self._stacked_for = ()
        used = {m for a in self.loaded.values() for m in a.weights}
        for module in set(self._hooks) - used:
            self._hooks.pop(module).remove()

    @contextmanager
    def active(self, rows: list[str | None]):
        """Each row of the forward passes inside takes the adapter named at its place."""
        self._pass = self._plan(rows)
        try:
            yield
        finally:
            self._pass = None

    def _plan(self, rows: list[str | None]) -> _Pass | None:
        """Made once a pass, not once per hooked layer."""
        names = tuple(dict.fromkeys(name for name in rows if name is not None))
        if not names:
            return None
        if len(names) == 1 and None not in rows:  # an RL policy's batch
            return _Pass(self.loaded[names[0]])
        # Rows of several adapters (or of the base) run as one product with all their A
        # and B side by side, each row masked to its adapter's columns and scaled: two
        # matmuls a layer whatever the mix, where one per adapter cost a gather, two
        # matmuls and a scatter each.
        weight = self._weight
        mask = torch.zeros(len(rows), sum(self.loaded[n].rank for n in names),
                           dtype=weight.dtype, device=weight.device)
        start = 0
        for name in names:
            adapter = self.loaded[name]
            index = torch.tensor([i for i, row in enumerate(rows) if row == name])
            mask[index.to(weight.device), start:start + adapter.rank] = adapter.scale
            start += adapter.rank
        return _Pass(None, names, mask)

    def _side_by_side(self, names: tuple[str, ...], module: str):
        """(A [sum of ranks, in], B [out, sum of ranks]) of the adapters `names` for
        `module`, zeros for one that does not adapt it; None if none does."""
        if self._stacked_for != names:
            self._stacked, self._stacked_for = {}, names
        if module not in self._stacked:
            given = [(self.loaded[n], self.loaded[n].weights.get(module)) for n in names]
            if all(pair is None for _, pair in given):
                self._stacked[module] = None
            else:
                (out_features, in_features), zeros = self._shapes[module], self._weight.new_zeros
                pairs = [pair or (zeros(adapter.rank, in_features),
                                  zeros(out_features, adapter.rank)) for adapter, pair in given]
                self._stacked[module] = (torch.cat([a for a, _ in pairs]),
                                         torch.cat([b for _, b in pairs], dim=1))
        return self._stacked[module]

    def _hook(self, module: str):
        def add_deltas(linear, args, output):
            step = self._pass
            if step is None:
                return output
            x = args[0]
            rows_out = output.view(-1, output.shape[-1])
            if step.single is not None:  # in place, into the rows as one matrix
                weights = step.single.weights.get(module)
                if weights is not None:
                    a, b = weights
                    rows_out.addmm_(x.reshape(-1, x.shape[-1]) @ a.T, b.T,
                                    alpha=step.single.scale)
                return output
            stacked = self._side_by_side(step.names, module)
            if stacked is not None:
                a, b = stacked
                low = x @ a.T  # [rows, ..., sum of ranks]
                low.mul_(step.mask.view(low.shape[0], *(1,) * (low.dim() - 2), -1))
                rows_out.addmm_(low.view(-1, low.shape[-1]), b.T)
            return output
        return add_deltas

    def _copied(self, name: str, adapter: Adapter) -> Adapter:
        """The adapter with its own copy of the tensors (the caller's may be a trainer's
        parameters, which its optimizer changes in place), in one buffer written by one
        `cat`. An adapter replaced by one of the same layout (an RL policy's, each step) is
        written over in place, as a weight update writes the parameters: no request runs
        during a load, and a new buffer would cost a page fault per 4 KiB."""
        weight, replaced = self._weight, self.loaded.get(name)
        if (replaced is not None and replaced.rank == adapter.rank  # so the same shapes
                and list(replaced.weights) == list(adapter.weights)):
            # One copy of the whole block where the caller keeps its tensors in one
            # (`pack_adapter`): on CPU it runs on every core, where a copy per tensor runs
            # on one. Else one call for all the tensors (a conversion and flattening per
            # tensor from Python cost about 3 us each of SmolLM2's 420).
            given = [t for pair in adapter.weights.values() for t in pair]
            block = one_block(given)
            if block is not None:
                self._buffers[name].copy_(block)
            else:
                torch._foreach_copy_([t for pair in replaced.weights.values() for t in pair],
                                     given)
            return attrs.evolve(adapter, weights=replaced.weights)
        given = [t.to(weight.device, weight.dtype).reshape(-1)
                 for pair in adapter.weights.values() for t in pair]
        buffer = torch.cat(given)
        parts = iter(buffer.split([t.numel() for t in given]))
        self._buffers[name] = buffer
        return attrs.evolve(adapter, weights={
            module: tuple(next(parts).view(t.shape) for t in pair)
            for module, pair in adapter.weights.items()})


@attrs.frozen
class _Pass:
    """What the adapter hooks of one forward pass add: `single`'s delta to every row, or
    each row's own adapter's among `names`, by `mask` ([rows, sum of their ranks]: a
    row's adapter's scale at that adapter's columns, zeros elsewhere)."""

    single: Adapter | None
    names: tuple[str, ...] = ()
    mask: torch.Tensor | None = None
