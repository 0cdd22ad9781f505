"""`RemoteService`: a `rollout serve` process reached over HTTP through its native route
`/rollout/generate`, which carries rollout's own request and result schemas (token ids,
n samples, logprobs) without translation."""

from __future__ import annotations

import asyncio

from rollout.contract import convert
from rollout.kit.aio import client_session
from rollout.contract.errors import EngineDeadError, NoReplicaError, RolloutError, RolloutTimeoutError
from rollout.contract.schemas import Completion, Request


class ReplicaDown(Exception):
    """The replica could not be reached or stopped answering: its requests may be sent
    again elsewhere (they have no effect outside the replica)."""


class RemoteService:
    def __init__(self, url: str, api_key: str | None = None, request_timeout: float = 3600.0,
                 name: str | None = None):
        self.url = url.rstrip("/")
        self.name = name or self.url
        self.request_timeout = request_timeout
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._session = None

    def _client(self):
        if self._session is None:
            self._session = client_session(headers=self._headers)
        return self._session

    async def generate(self, request: Request) -> Completion:
        """Raises ReplicaDown when the replica cannot answer; the request's own error comes
        back in its Completion."""
        import aiohttp

        body = {"requests": [convert.unstructure(request)]}
        try:
            async with self._client().post(
                f"{self.url}/rollout/generate", json=body,
                timeout=aiohttp.ClientTimeout(total=self.request_timeout, sock_connect=10),
            ) as response:
                data = await response.json(content_type=None)
                status = response.status
        except asyncio.TimeoutError:
            raise RolloutTimeoutError(
                f"{self.url} did not answer within {self.request_timeout:.0f} s") from None
        except (aiohttp.ClientError, ValueError) as exc:
            raise ReplicaDown(f"{self.url}: {exc!r}") from None
        if status == 200:
            return convert.structure(data["completions"][0], Completion)
        message = _error_message(data)
        if status == 503:
            raise ReplicaDown(f"{self.url} answered 503: {message}")
        if status == 401:
            raise RolloutError(f"{self.url} refused the API key: {message}")
        if status == 504:
            raise RolloutTimeoutError(f"{self.url} timed out: {message}")
        raise RolloutError(f"{self.url} answered {status}: {message}")

    async def health(self) -> dict:
        import aiohttp

        try:
            async with self._client().get(f"{self.url}/health",
                                          timeout=aiohttp.ClientTimeout(total=5)) as response:
                data = await response.json(content_type=None)
                if response.status == 200:
                    return data
                raise EngineDeadError(f"{self.url}/health answered {response.status}: "
                                      f"{_error_message(data)}")
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            raise NoReplicaError(f"{self.url} is unreachable: {exc!r}") from None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def _error_message(data) -> str:
    if isinstance(data, dict) and isinstance(data.get("error"), dict):
        return str(data["error"].get("message"))
    return str(data)[:500]
