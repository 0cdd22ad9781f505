"""`ServedRollout`: what a trainer holds for a backend in other processes (a `rollout serve`
at a URL, or replicas it starts), with `Rollout`'s methods: generate, agenerate, stream,
update weights, release, resume. It runs its calls on a loop thread of its own."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from rollout.contract import convert
from rollout.contract.schemas import Completion, Request
from rollout.kit.aio import LoopThread, Relay
from rollout.service.service import Service
from rollout.weights.send import push_weights, require_transport
from rollout.weights.update import BUCKET_WAIT_S, check_update_options

CALL_TIMEOUT_S = 3600.0


class ServedRollout:
    def __init__(self, service: Service, loop: LoopThread):
        self.service = service
        self._loop = loop
        self.weight_version: int | None = None

    @classmethod
    def connect(cls, url: str, api_key: str | None = None) -> ServedRollout:
        """A running `rollout serve` (with one backend or a pool of replicas behind it)."""
        return cls._open(server=url, api_key=api_key)

    @classmethod
    def start(cls, backend: str, model: str, replicas: int = 1,
              options: Mapping | None = None, restarts: int = 3,
              keep_weights: bool = True, ray: Mapping | None = None) -> ServedRollout:
        """Replica processes, each serving `backend`, pooled here: on this machine, or with
        `ray` (RayPlacement's fields, e.g. {"gpus": 1, "strategy": "SPREAD"}) on a Ray
        cluster. A dead one is started again up to `restarts` times; `keep_weights` keeps
        the last update's weights in this process to bring a restarted one to the pool's
        version at once."""
        return cls._open(backend=backend, model=model, options=options, replicas=replicas,
                         mode="standalone" if ray is not None else "colocated",
                         placement="ray" if ray is not None else "local", ray=ray,
                         restarts=restarts, keep_weights=keep_weights)

    @classmethod
    def _open(cls, **how) -> ServedRollout:
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

    def generate(self, requests: Sequence[Request | Mapping]) -> list[Completion]:
        import asyncio

        checked = [_request(r) for r in requests]

        async def run_all():
            return await asyncio.gather(*(self.service.generate(r) for r in checked))

        return self._run(run_all(), "generate")

    async def agenerate(self, request: Request | Mapping) -> Completion:
        """One request, awaited on any event loop (no thread per call). Cancelling the
        call drops its connection, which stops the request on its server."""
        import asyncio

        call = self.service.generate(_request(request))
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(call, self._loop.loop))

    def stream(self, request: Request | Mapping) -> ServedStream:
        """The request's chunks as its server makes them (`async for`); `.completion`
        afterwards. Leaving early stops the request on its server."""
        return ServedStream(self.service, _request(request), self._loop.loop)

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


class ServedStream(Relay):
    def __init__(self, service: Service, request: Request, loop):
        async def produce(sink):
            stream = service.stream(request)
            try:
                async for chunk in stream:
                    sink(chunk)
            finally:
                await stream.aclose()
            return stream.completion

        super().__init__(loop, produce)

    @property
    def completion(self) -> Completion | None:
        return self.result


def _request(request: Request | Mapping) -> Request:
    return request if isinstance(request, Request) else convert.structure(dict(request),
                                                                          Request)
