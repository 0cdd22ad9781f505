"""A gloo weight-transfer engine for vLLM's own protocol (`--weight-transfer-config
'{"backend": "rollout_gloo"}'`), registered from `rollout_vllm.worker`. vLLM's nccl and ipc
engines need CUDA; this one joins a gloo group with the trainer (the trainer rank 0, this
worker rank 1, built by `rollout.weights.transports.collective` as the trainer builds its side).

Per update vLLM calls `start_weight_update` (its layer-by-layer reload: each layer is
rebuilt once all its tensors came, so a fused q/k/v may span chunks), `update_weights` once
per chunk (names, dtypes and shapes as JSON; the bytes by broadcast, one per tensor), then
`finish_weight_update` (layers that got nothing keep their old tensors).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from rollout_vllm.common import refresh_tied_output

NAME = "rollout_gloo"
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "float64": torch.float64}
# Every group name this process joined: a name seen twice is refused at once, where joining
# it would leave both sides waiting on store keys already taken.
_JOINED: set[str] = set()


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    host: str
    port: int
    group_name: str
    world_size: int = 2
    rank: int = 1
    timeout_s: float = 60.0  # joining, and each chunk's broadcasts


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def __post_init__(self):
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(f"{len(self.names)} names, {len(self.dtype_names)} dtypes and "
                             f"{len(self.shapes)} shapes")
        unknown = sorted(set(self.dtype_names) - set(DTYPES))
        if unknown:
            raise ValueError(f"dtypes {unknown}: only {', '.join(DTYPES)}")


class GlooTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo

    def __init__(self, config, vllm_config, device, model):
        super().__init__(config, vllm_config, device, model)
        self.group = None
        self.received: list[str] = []  # names loaded in this update

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        from rollout.weights.transports import collective

        if init_info.group_name in _JOINED:
            raise ValueError(f"weight transfer group {init_info.group_name!r} was used before "
                             "on this server; each group needs a new name")
        _JOINED.add(init_info.group_name)
        self.shutdown()  # a trainer that reconnects replaces its old group
        self.group = collective.open_group(init_info.host, init_info.port, init_info.rank,
                                           init_info.world_size, init_info.group_name,
                                           "gloo", init_info.timeout_s)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        self.received = []
        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        refresh_tied_output(self.model, self.received)

    def update_weights(self, update_info: dict) -> None:
        # The base class then synchronizes an accelerator, which fails where there is none.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        from rollout.weights.transports import collective

        if self.group is None:
            raise RuntimeError("no weight transfer group: init_weight_transfer_engine first")
        # Fresh tensors every chunk: the reload keeps them until their layer is complete.
        tensors = [torch.empty(shape, dtype=DTYPES[dtype])
                   for dtype, shape in zip(update_info.dtype_names, update_info.shapes)]
        group = self.group
        works = collective.start_broadcast(group, tensors)
        deadline = time.monotonic() + group.timeout_s

        def arrived():
            # Each tensor goes to vLLM as soon as it is here: a layer is rebuilt (its CPU
            # weights prepacked) while gloo's threads receive the next ones.
            for i, named in enumerate(zip(update_info.names, tensors)):
                collective.wait_all(group, works[i:i + 1], max(deadline - time.monotonic(), 0))
                works[i] = None  # done: drop it
                self.received.append(named[0])
                yield named

        try:
            self.model.load_weights(arrived())
        except BaseException:
            works.clear()
            # Unusable after a failure: the trainer opens a new one. Left on a thread of its
            # own: with receives still pending (vLLM refused a tensor before the last came),
            # leaving waits for the trainer, which leaves once this call has failed.
            self.group = None
            collective.close_soon(group)
            raise

    def shutdown(self) -> None:
        from rollout.weights.transports import collective

        group, self.group = self.group, None
        if group is not None:
            collective.close(group)
