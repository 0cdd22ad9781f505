"""The trainer's side of the transports into a vLLM in another process (async or server
mode): shared memory (`ShmPipeline`), and gloo (`GlooSender`, server mode).

shm: each group of whole layers is packed into one of two files under /dev/shm and named to
the worker in a JSON message (`WeightUpdateExtension.rollout_receive_shm`), which loads
straight from the file. Packing group k+1 goes on while the worker reloads group k, so an
update takes about the longer of the two, not their sum. A file is written again only
after the worker answered for the group it last held (it keeps no view then). Both files,
and their mappings, are kept from one update to the next: writing into fresh /dev/shm pages
cost as much as the worker's whole reload (page faults). After a failed update they are
removed and the next update makes new ones, because a call that timed out may still be
reading one.

gloo: vLLM's weight-transfer routes driving our `rollout_gloo` engine
(`rollout_vllm.transfer_engine`) in the server.

One gloo group per backend (this process rank 0, the server's worker rank 1), opened at the
first update under a name never used before, concurrently with /init_weight_transfer_engine.
Per update: /start_weight_update; per checked group of tensors one /update_weights call
announcing names, dtypes and shapes, while the tensors go by broadcast; then
/finish_weight_update (the backend names the version after it). A failed update ends
vLLM's session anyway (so the next one can start; the core keeps the weights dirty until a
full update succeeds); a failed broadcast also drops the group, so the server's pending
receive fails now.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable
from typing import TYPE_CHECKING

from rollout import GenerationError
from rollout.kit.process import HOST, free_port
from rollout.weights.transports import collective
from rollout.weights.transports.shm import ShmSender

if TYPE_CHECKING:  # the engines import this module
    from rollout.kit.aio import LoopThread

    from rollout_vllm.engine import GroupEngine, ShmEngine

TRANSPORTS = ("shm", "gloo")
ENGINE_NAME = "rollout_gloo"  # rollout_vllm.transfer_engine.NAME, without importing vLLM
JOIN_TIMEOUT_S = 60.0  # both sides of a new group on one host join within seconds
CONTROL_TIMEOUT_S = 60.0  # start, finish, shutdown: no bytes move in them


def update_info(group: dict) -> dict:
    """The JSON vLLM's /update_weights carries for one group: names, dtypes, shapes."""
    return {"names": list(group),
            "dtype_names": [str(t.dtype).removeprefix("torch.") for t in group.values()],
            "shapes": [list(t.shape) for t in group.values()]}


class ShmPipeline:
    def __init__(self, engine: ShmEngine, loop: LoopThread, timeout: float):
        self.engine, self.loop = engine, loop  # the engine and the engine loop it runs on
        self.timeout = timeout
        self.senders: list[ShmSender] = []  # two, made at the first update

    def update(self, groups: Iterable[dict]) -> None:
        self.senders = self.senders or [ShmSender(), ShmSender()]
        loading = None  # the call loading the group before, running on the engine loop
        try:
            for i, group in enumerate(groups):  # the trainer's iterator: it may raise
                # This file's last group is i - 2, answered before group i - 1 was sent.
                message = self.senders[i % 2].put_tensors(list(group.items()))
                if loading is not None:
                    self._wait(loading)
                loading = asyncio.run_coroutine_threadsafe(
                    self.engine.load_weights(message, self.timeout), self.loop.loop)
            if loading is not None:
                self._wait(loading)
        except BaseException:
            if loading is not None and not loading.done():
                with contextlib.suppress(Exception):  # its own answer, bounded
                    self._wait(loading)
            self.close()  # new files next time: the worker may still read these
            raise

    def _wait(self, future) -> None:
        self.loop.run(_awaiting(future), self.timeout + 60, "vLLM weight update")

    def close(self) -> None:
        senders, self.senders = self.senders, []
        for sender in senders:
            sender.close()


class GlooSender:
    def __init__(self, engine: GroupEngine, loop: LoopThread, timeout: float,
                 group_timeout: float):
        self.engine, self.loop = engine, loop  # vLLM's server, and the engine loop it runs on
        self.timeout, self.group_timeout = timeout, group_timeout
        self.group: collective.Group | None = None

    def _run(self, coro, timeout: float, what: str):
        return self.loop.run(coro, timeout, what)

    def update(self, groups: Iterable[dict]) -> None:
        if self.group is None:
            self.group = self._open()
        self._run(self.engine.start_weight_update(CONTROL_TIMEOUT_S), CONTROL_TIMEOUT_S + 10,
                  "vLLM start_weight_update")
        try:
            for group in groups:  # the trainer's iterator: it may raise between groups
                self._send(group)
        except BaseException:
            self._abandon()
            if self.group is None:  # left after a failed broadcast: the server leaves too
                self._shutdown_remote()
            raise
        # (The backend names the weights: VLLMBackend.update_weights.)
        self._run(self.engine.finish_weight_update(None, CONTROL_TIMEOUT_S),
                  CONTROL_TIMEOUT_S + 10, "vLLM finish_weight_update")

    def _send(self, group: dict) -> None:
        # vLLM answers once its worker has received and loaded every tensor; meanwhile the
        # broadcasts go out (contiguous, checked tensors: `backend.layer_groups`).
        reply = asyncio.run_coroutine_threadsafe(
            self.engine.update_weights_chunk(update_info(group), self.timeout), self.loop.loop)
        try:
            collective.broadcast_announced(self.group, list(group.values()), reply,
                                           self.group_timeout)
            self._run(_awaiting(reply), self.timeout + 30, "vLLM update_weights")
        except BaseException:
            self._leave()
            with contextlib.suppress(Exception):  # vLLM's answer, bounded
                self._run(_awaiting(reply), 30, "vLLM update_weights")
            raise

    def _abandon(self) -> None:
        """End vLLM's session after a failure: its layers that got nothing take their old
        tensors back (none is left without storage). Where vLLM already ended the session
        (its worker failed a chunk), a start and finish with nothing sent does the same."""
        for path in (("finish",), ("start", "finish")):
            try:
                for step in path:
                    call = self.engine.finish_weight_update(None, CONTROL_TIMEOUT_S) \
                        if step == "finish" else self.engine.start_weight_update(CONTROL_TIMEOUT_S)
                    self._run(call, CONTROL_TIMEOUT_S + 10, f"vLLM {step}_weight_update")
                return
            except Exception:  # noqa: BLE001 - best effort: the weights are dirty anyway
                continue

    def _open(self) -> collective.Group:
        """Both sides join at once: vLLM's init call answers only once we have joined. A
        refusal (e.g. a name used before) is raised at once, without waiting out the join."""
        name, port = collective.unique_group_name(), free_port()
        body = {"host": HOST, "port": port, "group_name": name, "world_size": 2, "rank": 1,
                "timeout_s": self.group_timeout}
        try:
            return collective.open_with(
                lambda: self._run(self.engine.init_weight_transfer(body, JOIN_TIMEOUT_S),
                                  JOIN_TIMEOUT_S + 10, "vLLM init_weight_transfer_engine"),
                HOST, port, 2, name, JOIN_TIMEOUT_S, self.group_timeout)
        except Exception as exc:
            raise GenerationError(f"opening weight transfer group {name!r} with vLLM "
                                  f"failed: {exc}") from None

    def _leave(self) -> None:
        group, self.group = self.group, None
        if group is not None:
            collective.close_soon(group)  # the server's pending receive fails then

    def _shutdown_remote(self) -> None:
        with contextlib.suppress(Exception):  # a dead server, or one still in a session
            self._run(self.engine.shutdown_weight_transfer(CONTROL_TIMEOUT_S),
                      CONTROL_TIMEOUT_S + 10, "vLLM shutdown_weight_transfer_engine")

    def drop(self) -> None:
        """Leave the group, and have the server leave it."""
        if self.group is not None:
            self._leave()
            self._shutdown_remote()

    def close(self) -> None:
        self.drop()


async def _awaiting(future):
    return await asyncio.wrap_future(future)
