"""How checked groups of (name, tensor) reach SGLang during a weight update:

- "tensor": SGLang's `update_weights_from_tensor` (a pickled payload, tensor data in shared
  memory, so the server must be on this host);
- "gloo": a collective group the backend opens once with the server (this process rank 0,
  the server rank 1), then per group one `/update_weights_from_distributed` call that
  announces names, dtypes and shapes, while the tensors go by broadcast.
"""

from __future__ import annotations

import asyncio
import contextlib

from rollout import GenerationError
from rollout.kit.process import HOST, free_port
from rollout.weights.transports import collective

from rollout_sglang import protocol
from rollout_sglang.engine import Engine, GroupEngine

TRANSPORTS = ("tensor", "gloo")
JOIN_TIMEOUT_S = 60.0  # both sides of a new group on one host join within seconds
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


def make_sender(transport: str, engine: Engine, timeout: float, group_timeout: float):
    """"gloo" only with a server engine (the backend's options say so)."""
    return GlooSender(engine, timeout, group_timeout) if transport == "gloo" else \
        TensorSender(engine, timeout)


class TensorSender:
    def __init__(self, engine: Engine, timeout: float):
        self.engine, self.timeout = engine, timeout

    def send(self, group: list) -> None:
        self.engine.run(self.engine.update_tensors(group), self.timeout, "SGLang weight update")

    def close(self) -> None:
        pass


class GlooSender:
    """One update group per backend, opened at the first update under a name never used
    before. A group whose transfer failed is dropped at once (so the server's pending
    receive fails now, not at its 30-minute timeout) and a new one opened next time."""

    def __init__(self, engine: GroupEngine, timeout: float, group_timeout: float):
        self.engine, self.timeout, self.group_timeout = engine, timeout, group_timeout
        self.group: collective.Group | None = None

    def send(self, group: list) -> None:
        if self.group is None:
            self.group = self._open()
        tensors = [t for _, t in group]
        body = protocol.update_distributed_body(group, self.group.name)
        _check_sizes(body, tensors)  # a size SGLang does not expect kills its scheduler
        # The call answers once SGLang has received and loaded every tensor; meanwhile the
        # broadcasts go out. If they fail, leaving the group makes SGLang's receive fail now
        # (its own timeout is 30 minutes).
        reply = asyncio.run_coroutine_threadsafe(
            self.engine.update_distributed(body), self.engine.loop)
        try:
            collective.broadcast_announced(self.group, tensors, reply, self.group_timeout)
            self.engine.run(_awaiting(reply), self.timeout,
                            "SGLang update_weights_from_distributed")
        except BaseException:
            self.drop()
            with contextlib.suppress(Exception):  # SGLang's answer, bounded
                self.engine.run(_awaiting(reply), 30, "SGLang update_weights_from_distributed")
            raise

    def _open(self) -> collective.Group:
        """Both sides join at once: the server's call answers only when we have joined."""
        name, port = collective.unique_group_name(), free_port()
        try:
            return collective.open_with(
                lambda: self.engine.run(self.engine.init_group(
                    protocol.init_group_body(HOST, port, name, "gloo"), JOIN_TIMEOUT_S),
                    JOIN_TIMEOUT_S + 10, "SGLang init_weights_update_group"),
                HOST, port, 2, name, JOIN_TIMEOUT_S, self.group_timeout)
        except TimeoutError as exc:
            raise GenerationError(f"joining SGLang's update group failed: {exc}") from None

    def drop(self) -> None:
        """Leave the group and have the server forget it. Our side closes on a thread of
        its own: with a broadcast still pending, torch waits for it to time out."""
        group, self.group = self.group, None
        if group is None:
            return
        name = group.name
        collective.close_soon(group)
        del group
        try:
            self.engine.run(self.engine.destroy_group(name), 15,
                            "SGLang destroy_weights_update_group")
        except Exception:  # noqa: BLE001 - a dead server or one still failing its receive
            pass

    def close(self) -> None:
        self.drop()


async def _awaiting(future):
    return await asyncio.wrap_future(future)


def _check_sizes(body: dict, tensors: list) -> None:
    for name, dtype, shape, t in zip(body["names"], body["dtypes"], body["shapes"], tensors):
        count = 1
        for x in shape:
            count *= x
        if dtype not in DTYPE_BYTES or not t.is_contiguous() or \
                count * DTYPE_BYTES[dtype] != t.numel() * t.element_size():
            raise GenerationError(f"{name!r}: the bytes to send ({t.dtype}, {tuple(t.shape)}) "
                                  f"are not the {dtype} {shape} announced")
