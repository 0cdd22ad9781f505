"""`ServedRollout`: the `Sampler` over a backend in other processes (a `rollout serve` at a
URL, or replicas it starts), with `Rollout`'s methods and their meaning: the same request
front (`rollout.front`: generate, agenerate, stream, abort), update weights, adapters,
release, resume, health. It runs its calls on a loop thread of its own."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Iterable, Mapping

from rollout.api import load_backend
from rollout.contract import convert
from rollout.contract.errors import InvalidRequestError
from rollout.contract.sampler import Sampler
from rollout.contract.schemas import Capabilities, Completion, Request
from rollout.front import Flight, RequestFront, aborted_completion, raw_id
from rollout.kit.aio import LoopThread, uncancel
from rollout.kit.models import resolve
from rollout.kit.prompts import PromptEncoder
from rollout.service.connect import connect, resolve_mode
from rollout.service.service import CALL, Service
from rollout.weights.lora import plain_config
from rollout.weights.send import push_weights, require_transport
from rollout.weights.update import BUCKET_WAIT_S, check_adapter, check_update_options

CALL_TIMEOUT_S = 3600.0
ABORT_WAIT_S = 30.0  # an aborted call not ended by then is cut (its connection dropped)
log = logging.getLogger("rollout.served")


class _Call(Flight):
    """One call for one request of this sampler."""

    __slots__ = ("token", "cut")

    def __init__(self, request: Request):
        super().__init__(request)
        self.token = uuid.uuid4().hex  # the call's own id (CALL), unlike the request's
        self.cut = False  # cancelled by an abort that the server did not answer


class ServedRollout(RequestFront):
    flight_type = _Call
    call_timeout = CALL_TIMEOUT_S

    def __init__(self, service: Service, loop: LoopThread, capabilities: Capabilities,
                 model: str | None = None):
        super().__init__(loop.loop)
        self.service = service
        self.name = service.name
        self.model = model  # the model's folder (or a known model's name), where given
        self._encoder: PromptEncoder | None = None
        self.capabilities = capabilities  # what the backend behind the server supports
        self._thread = loop
        self.weight_version: int | None = None
        self.adapters: dict[str, int | None] = {}  # the LoRA adapters this sampler loaded

    @classmethod
    def connect(cls, url: str, api_key: str | None = None,
                model: str | None = None) -> ServedRollout:
        """A running `rollout serve` (with one backend or a pool of replicas behind it);
        `model`, the folder of the model it serves, gives this sampler its `encoder`."""
        return cls.open(server=url, api_key=api_key, model=model)

    @classmethod
    def start(cls, backend: str, model: str, replicas: int = 1,
              options: Mapping | None = None, restarts: int = 3,
              keep_weights: bool = True, ray: Mapping | None = None) -> ServedRollout:
        """Replica processes, each serving `backend`, pooled here: on this machine, or with
        `ray` (RayPlacement's fields, e.g. {"gpus": 1, "strategy": "SPREAD"}) on a Ray
        cluster. A dead one is started again up to `restarts` times; `keep_weights` keeps
        the last update's weights in this process to bring a restarted one to the pool's
        version at once."""
        return cls.open(backend=backend, model=model, options=options, replicas=replicas,
                        mode="standalone" if ray is not None else "colocated",
                        placement="ray" if ray is not None else "local", ray=ray,
                        restarts=restarts, keep_weights=keep_weights)

    @classmethod
    def open(cls, **how) -> ServedRollout:
        """Over what `rollout.service.connect.connect(**how)` opens."""
        loop = LoopThread("rollout-served")
        try:
            service = loop.run(connect(**how), CALL_TIMEOUT_S, "starting the service")
            try:
                capabilities = loop.run(service.capabilities(), 60, "asking its capabilities")
            except BaseException:
                loop.run(service.close(), 120, "closing")
                raise
        except BaseException:
            loop.stop()
            raise
        return cls(service, loop, capabilities, how.get("model"))

    @property
    def encoder(self) -> PromptEncoder | None:
        """The model's prompt encoder, read from its folder here on first use (None where
        this sampler was not told the folder)."""
        if self._encoder is None and self.model is not None:  # (a known name: its folder)
            self._encoder = PromptEncoder.from_folder(resolve(self.model))
        return self._encoder

    def _wait(self, coro, what: str, timeout: float = CALL_TIMEOUT_S):
        """Run `coro` on this sampler's loop, from a caller's thread, and wait for it."""
        return self._thread.run(coro, timeout, what)

    # --- requests -------------------------------------------------------------------

    def _validate(self, request: Request | Mapping, index: int) -> Request | Completion:
        """The request, or (if it is not one) a Completion that carries why; the server
        checks the rest."""
        try:
            return request if isinstance(request, Request) else convert.structure(
                dict(request), Request)
        except InvalidRequestError as exc:
            return Completion(raw_id(request, index), error=exc)

    async def _run(self, call: _Call, timeout: float | None, sink=None) -> Completion:
        """One registered request, on this sampler's loop; with `sink`, streamed into it."""
        request = call.request
        call.task = asyncio.current_task()
        if call.aborted:  # before it started: nothing was sent
            self._forget(call)
            return aborted_completion(request)
        timer = None if timeout is None else self._loop.call_later(timeout, self._stop, [call])
        named = CALL.set(call.token)  # sent with the request: see `_abort_until_done`
        try:
            return await self._send(request, sink)
        except asyncio.CancelledError:
            if not call.cut:  # the caller's: it goes on
                raise
            uncancel()  # an abort the server did not answer: nothing came back
            return aborted_completion(request)
        finally:
            CALL.reset(named)
            if timer is not None:
                timer.cancel()
            self._forget(call)

    async def _send(self, request: Request, sink) -> Completion:
        if sink is None:
            return await self.service.generate(request)
        stream = self.service.stream(request)
        try:
            async for chunk in stream:
                sink(chunk)
        finally:
            await stream.aclose()
        return stream.completion

    def _stop(self, calls: list[_Call]) -> None:
        """Ask their servers to stop them (also for a timeout)."""
        for call in calls:
            call.aborted = True
        asyncio.ensure_future(self._abort_until_done(calls))

    async def _abort_until_done(self, calls: list[_Call]) -> None:
        """Ask the servers to abort until the calls end. The abort names the calls too: one
        that reaches a server before its request (or while a pool still holds it) stops the
        request when it comes, even if this process gets no CPU to send the abort again (a
        busy engine on the same cores can starve it for seconds). One that has not ended
        after ABORT_WAIT_S is cut."""
        loop = asyncio.get_running_loop()
        deadline, pause = loop.time() + ABORT_WAIT_S, 0.05
        while running := [c for c in calls if not c.finished]:
            if loop.time() > deadline:
                for call in running:
                    call.cut = True
                    if call.task is not None:
                        call.task.cancel()
                return
            started = [c for c in running if c.task is not None]
            try:
                if started:
                    await asyncio.wait_for(self.service.abort(
                        sorted({c.request.id for c in started}), [c.token for c in started]),
                        ABORT_WAIT_S)
            except Exception as exc:  # noqa: BLE001 - sent again, then cut
                log.warning("aborting %d requests: %r", len(running), exc)
            await asyncio.sleep(pause)
            pause = min(2 * pause, 1.0)

    # --- weights and lifecycle ------------------------------------------------------

    def update_weights(self, named_tensors: Iterable, bucket_bytes: int | None = None,
                       version: int | None = None, pause: str = "wait",
                       timeout: float = BUCKET_WAIT_S, transport: str = "auto",
                       address: str | None = None) -> None:
        """As `Rollout.update_weights`, on every replica in parallel; returns when all have
        the new version, or raises naming the ones that failed (they take no requests).
        A replica that waits `timeout` s for the next bucket fails the update.

        `transport`: "auto" (shm where every replica runs on this process's node, by Ray
        node id under Ray; gloo otherwise), "shm" (shared memory), "gloo" (a
        collective group for the update; the replicas reach this process at `address`,
        by default the address this host reaches the server from), "nccl" (the same
        with CUDA tensors, GPUs on both sides; unsupported where there is none), or
        "cuda_ipc" (a replica on this process's own GPU: the bytes never leave it)."""
        check_update_options(version, pause, timeout)
        require_transport(transport)
        if pause == "keep_kv":  # refused here, before any replica begins the update
            self.capabilities.require("keep_kv")

        async def push():
            update = await self.service.begin_update(version, pause, timeout)
            return await push_weights(update, named_tensors, bucket_bytes, transport,
                                      address or self._own_address(), timeout)

        self._wait(push(), "the weight update")
        self.weight_version = version

    def load_adapter(self, name: str, named_tensors: Iterable, config: Mapping,
                     version: int | None = None, bucket_bytes: int | None = None,
                     pause: str = "wait", timeout: float = BUCKET_WAIT_S,
                     transport: str = "auto", address: str | None = None) -> None:
        """As `Rollout.load_adapter`, on every replica in parallel, through the same
        transports as `update_weights`. Requests then name it (`Request.adapter`, or
        `model` on the OpenAI routes)."""
        check_update_options(version, pause, timeout)
        adapter = check_adapter({"name": name, "config": plain_config(config)})
        require_transport(transport)

        async def push():
            update = await self.service.begin_update(version, pause, timeout, adapter)
            return await push_weights(update, named_tensors, bucket_bytes, transport,
                                      address or self._own_address(), timeout)

        self._wait(push(), f"loading adapter {name!r}")
        self.adapters[name] = version

    def unload_adapter(self, name: str) -> None:
        self._wait(self.service.unload_adapter(name), f"unloading adapter {name!r}")
        self.adapters.pop(name, None)

    def session(self, session_id: str, pop: bool = False) -> dict:
        """An agent session that the server recorded, with exact tokens: its branches'
        token ids, mask, logprobs, weight versions and calls (docs/agents.md); `pop`: and
        no longer kept there."""
        return self._wait(self.service.session(session_id, pop), f"session {session_id!r}")

    def _own_address(self) -> str:
        """This host's address on the way to the first replica's server."""
        from urllib.parse import urlsplit

        from rollout.weights.transports.collective import address_towards

        urls = [r.service.url for r in getattr(self.service, "replicas", ())]
        return address_towards(urlsplit(urls[0]).hostname if urls else "127.0.0.1")

    def release(self, tags: Iterable[str] | None = None) -> None:
        self._wait(self.service.release(None if tags is None else list(tags)), "release")

    def resume(self, tags: Iterable[str] | None = None) -> None:
        self._wait(self.service.resume(None if tags is None else list(tags)), "resume")

    def health(self) -> dict:
        return self._wait(self.service.health(), "health", 30)

    def close(self) -> None:
        try:
            self._wait(self.service.close(), "closing", 120)
        finally:
            self._thread.stop()

    def __enter__(self) -> ServedRollout:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_sampler(backend: str | None = None, model: str | None = None,
                 options: Mapping | None = None, replicas: int | None = None,
                 placement: str = "local", server: str | None = None,
                 api_key: str | None = None, mode: str | None = None, restarts: int = 3,
                 keep_weights: bool = True, ray: Mapping | None = None) -> Sampler:
    """The `Sampler` for a job or a trainer, by the same settings as `connect`: the backend
    itself (a `Rollout`) in hybrid mode, else a `ServedRollout` over the replicas or the
    server. Nothing is bounded: the caller limits what it sends."""
    how = dict(backend=backend, model=model, options=options, replicas=replicas,
               placement=placement, server=server, api_key=api_key, mode=mode,
               restarts=restarts, keep_weights=keep_weights, ray=ray)
    if resolve_mode(mode, replicas, placement, server, ray) == "hybrid":
        return load_backend(backend, model=model, **dict(options or {}))
    return ServedRollout.open(**how)
