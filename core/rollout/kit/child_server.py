"""An engine's HTTP server run as a child process on loopback and spoken to from the engine
loop: launched so that it dies with this process, waited for until healthy (with a
timeout), optionally watched, a failed call turned into a typed error that carries the end
of its log once it has died, and stopped with its whole process group."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence

from rollout.contract.errors import EngineDeadError, GenerationError, RolloutError
from rollout.kit.aio import client_session
from rollout.kit.process import HOST, ServerProcess, free_port

EXIT_WAIT_S = 1.0  # a server that broke a connection by dying may take this long to exit
WATCH_S = 0.5


class ChildServer:
    """One server: `start()` and `close_session()` on the engine loop, the rest anywhere.
    `session` is an aiohttp session for calls to `url`, made at start."""

    def __init__(self, name: str):
        self.name = name
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.process: ServerProcess | None = None
        self.session = None
        self._watch: asyncio.Task | None = None

    async def start(self, argv: Sequence[str], env: Mapping[str, str] | None, timeout: float,
                    watch: bool = False) -> None:
        """Launch the server and return once its /health answers; raise EngineDeadError if it
        exits first, RolloutTimeoutError (the server stopped) after `timeout` s. `watch`:
        once the server has exited, close the session, so that every call still waiting on
        it (for headers or for a stream's next line) fails at once."""
        # Launched from the engine loop's thread, which lives as long as the process: the
        # server gets SIGTERM when it ends, never left running alone.
        self.process = ServerProcess(self.name, argv, env=env, die_with_parent=True)
        # Off the loop, which goes on serving other backends' requests meanwhile.
        await asyncio.to_thread(self.process.wait_healthy, f"{self.url}/health", timeout)
        # A connection per call: none is ever met just after the server closed it.
        self.session = client_session(reuse_connections=False)
        if watch:
            self._watch = asyncio.ensure_future(self._close_when_dead())

    async def _close_when_dead(self) -> None:
        while self.process.alive():
            await asyncio.sleep(WATCH_S)
        await self.session.close()

    def check(self) -> None:
        """Raise EngineDeadError, with the end of the server's log, if it has exited."""
        if self.process is not None:
            self.process.check()

    async def failure(self, exc: BaseException, what: str) -> RolloutError:
        """The error for a call (`what`) whose connection failed: EngineDeadError with the
        server's log if it died (a dying server takes a moment to exit), else
        GenerationError."""
        for _ in range(round(EXIT_WAIT_S / 0.1)):
            if not self.process.alive():
                break
            await asyncio.sleep(0.1)
        try:
            self.process.check()
        except EngineDeadError as dead:
            return dead
        return GenerationError(f"{what} failed: {exc!r}")

    async def close_session(self) -> None:
        """Stop watching and close the session (calls still open on it fail)."""
        if self._watch is not None:
            self._watch.cancel()
        if self.session is not None:
            await self.session.close()

    def stop(self) -> None:
        """Stop the server and every process in its group (blocking, bounded); nothing to
        do for a server never launched."""
        if self.process is not None:
            self.process.stop()
