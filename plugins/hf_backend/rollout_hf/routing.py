"""The experts a mixture-of-experts model routes each token to, read while the engine runs
it (`sampling.return_routed_experts`): a forward hook on each of its routers
(`rollout.kit.moe`) keeps the expert ids, in layer order, while a pass that asked for them
runs."""

from __future__ import annotations

from contextlib import contextmanager

import torch

from rollout.kit.sampler import Row


class RouterTap:
    def __init__(self, routers: list):
        self.routers = routers
        self._ids: list[torch.Tensor] | None = None
        for router in routers:
            router.register_forward_hook(self._keep)

    def _keep(self, module, args, output) -> None:
        if self._ids is not None:
            self._ids.append(output[2])

    @contextmanager
    def reading(self, rows: list[Row], new: list[int]):
        """Around one forward pass of `rows` (left-padded, all of the same width): after
        it, each row that asked gets the experts of its last `new[i]` positions."""
        if not any(row.routing is not None for row in rows):
            yield
            return
        self._ids = []
        try:
            yield
            ids = torch.stack(self._ids, dim=1)  # [rows * width, layers, k]
            ids = ids.view(len(rows), -1, *ids.shape[1:]).tolist()
        finally:
            self._ids = None
        for row, count, row_ids in zip(rows, new, ids):
            if row.routing is not None:
                row.routing += [tuple(map(tuple, position)) for position in row_ids[-count:]]
