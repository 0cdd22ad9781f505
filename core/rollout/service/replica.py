"""One replica of a pool, as the pool sees it: its service, its process (to restart), and
what the pool knows of it (requests in flight, health, weight version, adapters)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Protocol

from rollout.service.client import RemoteService

MISSING = object()  # a replica's version of an adapter it does not have
MAX_RESTARTS = 3  # by default, a replica whose process dies is started again this often
MAX_CATCH_UPS = 3  # tries to bring a restarted replica to the pool's weights


class ReplicaProcess(Protocol):
    def alive(self) -> bool: ...

    def stop(self) -> None: ...


class Replica:
    def __init__(self, service: RemoteService, process: ReplicaProcess | None = None,
                 restart: Callable[[], Awaitable[tuple[RemoteService, ReplicaProcess]]]
                 | None = None, restarts: int = MAX_RESTARTS):
        self.service = service
        self.process = process
        self.restart = restart  # starts a new process for it (None: it is not restarted)
        self.restarts = 0
        self.restarts_left = restarts
        self.recovering: asyncio.Task | None = None  # its restart or catch-up, under way
        self.catch_ups_left = MAX_CATCH_UPS
        self.in_flight = 0
        self.healthy = True
        self.dirty = False  # its health check says its weights are half-updated
        self.down_reason = ""
        self.failed_checks = 0
        self.weight_version: int | None = None  # as its health last said, or its last update
        self.adapters: dict[str, int | None] = {}  # LoRA adapter -> version the pool loaded
        self.calls: set = set()  # its requests' futures and streams; cancelled if it dies
