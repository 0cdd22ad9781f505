"""Event loops on threads of their own, driven from the trainer's synchronous code, and the
engine loop: the one loop of this process on which the core runs every request and every
backend's `generate`. Every wait on them has a timeout."""

from __future__ import annotations

import asyncio
import collections
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from rollout.contract.errors import RolloutTimeoutError

T = TypeVar("T")


class LoopThread:
    def __init__(self, name: str = "rollout-loop"):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None, what: str) -> T:
        """Run `coro` on the loop and wait for it; cancel it and raise after `timeout` s."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout)
        except TimeoutError:
            future.cancel()
            raise RolloutTimeoutError(f"{what} did not finish within {timeout:.0f} s") from None

    def stop(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(30)
        if not self.loop.is_running():
            self.loop.close()


_engine_loop: LoopThread | None = None
_engine_loop_lock = threading.Lock()


def engine_loop() -> LoopThread:
    """The process's engine loop, started on first use. Backends start their engines'
    asyncio parts on it; the core runs requests on it; the server serves on it."""
    global _engine_loop
    with _engine_loop_lock:
        if _engine_loop is None or _engine_loop.loop.is_closed():
            _engine_loop = LoopThread("rollout-engine-loop")
        return _engine_loop


def on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether the caller runs on `loop`'s thread."""
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


def uncancel() -> None:
    """An abort's cancellation is handled: later waits of this task must not see it
    (Python 3.11+; before, a caught cancellation leaves nothing behind)."""
    task = asyncio.current_task()
    if hasattr(task, "uncancel"):
        task.uncancel()


class Relay:
    """What a coroutine on `loop` hands to its sink, read with `async for` on the caller's
    loop (the same loop or another; no thread is taken); `.result` then holds what the
    coroutine returned, and its exception is raised from the iteration. Leaving the
    iteration early (or `aclose()`) cancels the coroutine."""

    _END = object()

    def __init__(self, loop: asyncio.AbstractEventLoop,
                 produce: Callable[[Callable[[Any], None]], Awaitable]):
        self.result = None
        self._items = self._iterate(loop, produce)

    def __aiter__(self) -> AsyncIterator:
        return self._items

    async def aclose(self) -> None:
        await self._items.aclose()

    async def _iterate(self, loop, produce) -> AsyncIterator:
        queue: asyncio.Queue = asyncio.Queue()
        here = asyncio.get_running_loop()
        if here is loop:
            sink = queue.put_nowait
        else:
            def sink(item):
                try:
                    here.call_soon_threadsafe(queue.put_nowait, item)
                except RuntimeError:  # the caller's loop is closed: nobody is listening
                    pass

        async def run():
            try:
                return await produce(sink)
            finally:
                sink(self._END)  # whatever happened

        if here is loop:
            task = done = here.create_task(run())
        else:
            task = asyncio.run_coroutine_threadsafe(run(), loop)
            done = asyncio.wrap_future(task)
        try:
            while (item := await queue.get()) is not self._END:
                yield item
            self.result = await done
        finally:
            if not done.done():  # the caller left early
                task.cancel()


# Servers (uvicorn) close a connection after 5 s idle; a call sent on one they have just
# closed fails with ServerDisconnectedError. Reused connections are let go sooner.
KEEPALIVE_S = 2.0


class Lines:
    """The non-empty lines of a streamed response body (aiohttp's `response.content`) as
    they arrive, however long (n samples with top logprobs outgrow aiohttp's line limit).
    Each line gives the loop a turn: reading from a buffer that is not empty does not wait,
    so a stream whose lines have piled up (the process waited seconds for a CPU, or parses
    slower than the server sends) would hold the loop to its end, and every other request
    on the loop with it. A read that is cancelled loses no line: the caller may read on
    (what a stopped sample's server sends last)."""

    def __init__(self, content):
        self.content = content
        self.complete: collections.deque[bytes] = collections.deque()
        self.rest = bytearray()

    def __aiter__(self) -> Lines:
        return self

    async def __anext__(self) -> bytes:
        await asyncio.sleep(0)
        while not self.complete:
            data = await self.content.readany()
            if not data:
                if not self.rest.strip():
                    raise StopAsyncIteration
                self.rest, last = bytearray(), bytes(self.rest)
                return last
            *complete, rest = (self.rest + data).split(b"\n")
            self.rest = bytearray(rest)
            self.complete.extend(bytes(line) for line in complete if line.strip())
        return self.complete.popleft()


def client_session(reuse_connections: bool = True, **kwargs):
    """An aiohttp session. Without reuse every call opens its own connection, with no cap
    on how many are open (a batch of requests to an engine is one connection each): on
    loopback that costs a fraction of a millisecond, and no call meets a connection the
    server has just closed, however late this process got a CPU to send it (a busy engine
    can starve it for seconds, and a keep-alive margin with it)."""
    import aiohttp

    connector = (aiohttp.TCPConnector(keepalive_timeout=KEEPALIVE_S) if reuse_connections
                 else aiohttp.TCPConnector(force_close=True, limit=0))
    return aiohttp.ClientSession(connector=connector, **kwargs)
