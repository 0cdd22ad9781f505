"""An event loop on its own thread, for backends whose engines are asyncio-based, driven
from the trainer's synchronous code. Every wait on it has a timeout."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
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


# Servers (uvicorn) close a connection after 5 s idle; a call sent on one they have just
# closed fails with ServerDisconnectedError. Reused connections are let go sooner.
KEEPALIVE_S = 2.0


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
