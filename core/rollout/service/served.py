"""`ServedRollout`: the `Sampler` over a backend in other processes (a `rollout serve` at a
URL, or replicas it starts), with `Rollout`'s methods and their meaning: generate,
agenerate, stream (each with a timeout), abort, update weights, release, resume, health.
It runs its calls on a loop thread of its own."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping, Sequence

from rollout.api import aborted_results, raw_id
from rollout.contract import convert
from rollout.contract.errors import InvalidRequestError
from rollout.contract.schemas import Completion, Request
from rollout.kit.aio import LoopThread, Relay, on_loop, uncancel
from rollout.service.service import Service
from rollout.weights.send import push_weights, require_transport
from rollout.weights.update import BUCKET_WAIT_S, check_update_options

CALL_TIMEOUT_S = 3600.0
ABORT_WAIT_S = 30.0  # an aborted call not ended by then is cut (its connection dropped)
log = logging.getLogger("rollout.served")


class ServedRollout:
    encoder = None  # the model's tokenizer lives in the serving processes

    def __init__(self, service: Service, loop: LoopThread):
        self.service = service
        self.name = service.name
        self._loop = loop
        self.weight_version: int | None = None
        self._calls: dict[str, set[_Call]] = {}  # request id -> its calls (on the loop only)

    @classmethod
    def connect(cls, url: str, api_key: str | None = None) -> ServedRollout:
        """A running `rollout serve` (with one backend or a pool of replicas behind it)."""
        return cls.open(server=url, api_key=api_key)

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
        from rollout.service.connect import connect

        loop = LoopThread("rollout-served")
        try:
            service = loop.run(connect(**how), CALL_TIMEOUT_S, "starting the service")
        except BaseException:
            loop.stop()
            raise
        return cls(service, loop)

    def _run(self, coro, what: str, timeout: float = CALL_TIMEOUT_S):
        return self._loop.run(coro, timeout, what)

    # --- requests -------------------------------------------------------------------

    def generate(self, requests: Sequence[Request | Mapping],
                 timeout: float | None = None) -> list[Completion]:
        checked = [_checked(r, i) for i, r in enumerate(requests)]

        async def run_all():
            return await asyncio.gather(*(
                self._call(r, timeout) if isinstance(r, Request) else _done(r)
                for r in checked))

        return self._run(run_all(), "generate")

    async def agenerate(self, request: Request | Mapping,
                        timeout: float | None = None) -> Completion:
        """One request, awaited on any event loop (no thread per call). Cancelling the
        call drops its connection, which stops the request on its server."""
        checked = _checked(request, 0)
        if isinstance(checked, Completion):
            return checked
        call = self._call(checked, timeout)
        if on_loop(self._loop.loop):
            return await call
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(call,
                                                                          self._loop.loop))

    def stream(self, request: Request | Mapping, timeout: float | None = None
               ) -> ServedStream:
        """The request's chunks as its server makes them (`async for`); `.completion`
        afterwards. Leaving early stops the request on its server."""
        return ServedStream(self, _checked(request, 0), timeout)

    async def _call(self, request: Request, timeout: float | None, sink=None) -> Completion:
        """One request on this sampler's loop, registered for `abort` while it runs."""
        call = _Call(request.id, asyncio.current_task())
        self._calls.setdefault(request.id, set()).add(call)
        timer = None if timeout is None else asyncio.get_running_loop().call_later(
            timeout, self._stop, [call])
        try:
            if sink is None:
                return await self.service.generate(request)
            stream = self.service.stream(request)
            try:
                async for chunk in stream:
                    sink(chunk)
            finally:
                await stream.aclose()
            return stream.completion
        except asyncio.CancelledError:
            if not call.cut:
                raise
            uncancel()
            return Completion(request.id, aborted_results(request))
        finally:
            if timer is not None:
                timer.cancel()
            same = self._calls.get(request.id)
            if same is not None:
                same.discard(call)
                if not same:
                    del self._calls[request.id]

    def abort(self, request_ids: Iterable[str] | None = None) -> None:
        """Stop this sampler's requests (all of them when None) where they run; each
        returns what it made, with finish reason "abort". Unknown ids are ignored."""
        ids = None if request_ids is None else list(request_ids)

        def stop():
            chosen = self._calls if ids is None else ids
            self._stop([c for i in chosen for c in self._calls.get(i, ())])

        self._loop.loop.call_soon_threadsafe(stop)

    def _stop(self, calls: list[_Call]) -> None:
        if calls:
            asyncio.ensure_future(self._abort_until_done(calls))

    async def _abort_until_done(self, calls: list[_Call]) -> None:
        """Ask the servers to abort until the calls end: an abort that reaches a server
        before the request does (or while a pool still holds it) finds nothing there, so it
        is sent again. One that has not ended after ABORT_WAIT_S is cut."""
        loop = asyncio.get_running_loop()
        deadline, pause = loop.time() + ABORT_WAIT_S, 0.05
        while running := [c for c in calls if not c.task.done()]:
            if loop.time() > deadline:
                for call in running:
                    call.cut = True
                    call.task.cancel()
                return
            try:
                await asyncio.wait_for(self.service.abort(sorted({c.id for c in running})),
                                       ABORT_WAIT_S)
            except Exception as exc:  # noqa: BLE001 - sent again, then cut
                log.warning("aborting %d requests: %r", len(running), exc)
            await asyncio.wait([c.task for c in running], timeout=pause)
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

        async def push():
            update = await self.service.begin_update(version, pause, timeout)
            return await push_weights(update, named_tensors, bucket_bytes, transport,
                                      address or self._own_address(), timeout)

        self._run(push(), "the weight update")
        self.weight_version = version

    def _own_address(self) -> str:
        """This host's address on the way to the first replica's server."""
        from urllib.parse import urlsplit

        from rollout.weights.transports.collective import address_towards

        urls = [r.service.url for r in getattr(self.service, "replicas", ())]
        return address_towards(urlsplit(urls[0]).hostname if urls else "127.0.0.1")

    def release(self, tags: Iterable[str] | None = None) -> None:
        self._run(self.service.release(None if tags is None else list(tags)), "release")

    def resume(self, tags: Iterable[str] | None = None) -> None:
        self._run(self.service.resume(None if tags is None else list(tags)), "resume")

    def health(self) -> dict:
        return self._run(self.service.health(), "health", 30)

    def close(self) -> None:
        try:
            self._run(self.service.close(), "closing", 120)
        finally:
            self._loop.stop()

    def __enter__(self) -> ServedRollout:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Call:
    """One running request of this sampler."""

    __slots__ = ("id", "task", "cut")

    def __init__(self, request_id: str, task: asyncio.Task):
        self.id, self.task = request_id, task
        self.cut = False  # cancelled by an abort that the server did not answer


class ServedStream(Relay):
    def __init__(self, owner: ServedRollout, request: Request | Completion,
                 timeout: float | None):
        async def produce(sink):
            if isinstance(request, Completion):  # not a valid request: its error
                raise request.error
            return await owner._call(request, timeout, sink)

        super().__init__(owner._loop.loop, produce)

    @property
    def completion(self) -> Completion | None:
        return self.result


def _request(request: Request | Mapping) -> Request:
    return request if isinstance(request, Request) else convert.structure(dict(request),
                                                                          Request)


def _checked(request: Request | Mapping, index: int) -> Request | Completion:
    """The request, or (if it is not one) a Completion that carries why."""
    try:
        return _request(request)
    except InvalidRequestError as exc:
        return Completion(raw_id(request, index), error=exc)


async def _done(value):
    return value
