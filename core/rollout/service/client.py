"""`RemoteService`: a `rollout serve` process reached over HTTP through its native routes,
`/rollout/generate` and `/rollout/stream`, which carry rollout's own request, chunk and
result schemas (token ids, n samples, logprobs) without translation."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterable
from contextlib import contextmanager

from rollout.contract import convert
from rollout.kit.aio import Lines, client_session
from rollout.contract.errors import EngineDeadError, NoReplicaError, OverloadedError, \
    RolloutError, RolloutTimeoutError, WeightsDirtyError
from rollout.contract.schemas import Capabilities, Chunk, Completion, Request
from rollout.service.service import CALL
from rollout.weights.fanout import RemoteUpdate

CALL_HEADER = "X-Rollout-Call"  # the sampler's id of the call a request belongs to (CALL)


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

    def _post(self, path: str, body: dict, headers: dict | None = None):
        import aiohttp

        return self._client().post(
            f"{self.url}{path}", json=body, headers=headers,
            timeout=aiohttp.ClientTimeout(total=self.request_timeout, sock_connect=10))

    def _send(self, path: str, body: dict):
        """A request's call, with the id of the sampler's call where it has one."""
        call = CALL.get()
        return self._post(path, body, None if call is None else {CALL_HEADER: call})

    @contextmanager
    def _reaching(self):
        """A call's transport failures as the pool reads them: a timeout, or the replica
        down (its requests may then go elsewhere)."""
        import aiohttp

        try:
            yield
        except asyncio.TimeoutError:
            raise RolloutTimeoutError(
                f"{self.url} did not answer within {self.request_timeout:.0f} s") from None
        except (aiohttp.ClientError, ValueError) as exc:
            raise ReplicaDown(f"{self.url}: {exc!r}") from None

    async def generate(self, request: Request) -> Completion:
        """Raises ReplicaDown when the replica cannot answer; the request's own error comes
        back in its Completion."""
        with self._reaching():
            async with self._send("/rollout/generate",
                                  {"requests": [convert.unstructure(request)]}) as response:
                data = await response.json(content_type=None)
                status = response.status
        if status == 200:
            return convert.structure(data["completions"][0], Completion)
        raise _refusal(self.url, status, data)

    def stream(self, request: Request) -> RemoteStream:
        """The request's chunks as the replica makes them. Raises ReplicaDown when the
        replica cannot answer (or stops answering); the request's own error is raised
        from the iteration, as from a local stream."""
        return RemoteStream(self, request)

    async def health(self) -> dict:
        import aiohttp

        try:
            async with self._client().get(f"{self.url}/health",
                                          timeout=aiohttp.ClientTimeout(total=5)) as response:
                data = await response.json(content_type=None)
                if response.status == 200:
                    return data
                dirty = _error_code(data) == WeightsDirtyError.kind
                raise (WeightsDirtyError if dirty else EngineDeadError)(
                    f"{self.url}/health answered {response.status}: {_error_message(data)}")
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            raise NoReplicaError(f"{self.url} is unreachable: {exc!r}") from None

    async def _control(self, path: str, body: dict) -> dict:
        """A lifecycle call: its failure raised as the replica's typed error."""
        with self._reaching():
            async with self._post(path, body) as response:
                data = await response.json(content_type=None)
                status = response.status
        if status == 200:
            return data
        raise _typed_refusal(self.url, status, data)

    async def capabilities(self) -> Capabilities:
        import aiohttp

        with self._reaching():
            async with self._client().get(f"{self.url}/rollout/capabilities",
                                          timeout=aiohttp.ClientTimeout(total=30)) as response:
                data = await response.json(content_type=None)
                status = response.status
        if status != 200:
            raise _typed_refusal(self.url, status, data)
        return convert.structure(data, Capabilities)

    async def abort(self, request_ids: list[str], calls: Iterable[str] = ()) -> None:
        await self._control("/rollout/abort", {"request_ids": request_ids,
                                               "calls": list(calls)})

    async def release(self, tags: list[str] | None) -> None:
        await self._control("/rollout/release", {"tags": tags})

    async def resume(self, tags: list[str] | None) -> None:
        await self._control("/rollout/resume", {"tags": tags})

    async def begin_update(self, version: int | None, pause: str, timeout: float,
                           adapter: dict | None = None) -> RemoteUpdate:
        return await RemoteUpdate.begin(self._control, version, pause, timeout, adapter)

    async def unload_adapter(self, name: str) -> None:
        # vLLM's route, which answers success in plain text.
        with self._reaching():
            async with self._post("/v1/unload_lora_adapter", {"lora_name": name}) as response:
                status, text = response.status, await response.text()
        if status != 200:
            try:
                data = json.loads(text)
            except ValueError:
                data = {"error": {"message": text}}
            raise _typed_refusal(self.url, status, data)

    async def session(self, session_id: str, pop: bool = False) -> dict:
        """An agent session that this server recorded (rollout.apps.serving.sessions);
        `pop`: and no longer kept there."""
        from urllib.parse import quote

        return await self._get(f"/rollout/sessions/{quote(session_id, safe='')}",
                               {"pop": "true"} if pop else None)

    async def model(self) -> str:
        """The name the server serves its model under (the first that /v1/models lists)."""
        data = await self._get("/v1/models")
        try:
            return data["data"][0]["id"]
        except (KeyError, IndexError, TypeError):
            raise RolloutError(f"{self.url}/v1/models lists no model: {str(data)[:200]}") \
                from None

    async def _get(self, path: str, params: dict | None = None) -> dict:
        import aiohttp

        with self._reaching():
            async with self._client().get(f"{self.url}{path}", params=params,
                                          timeout=aiohttp.ClientTimeout(total=60)) as response:
                data = await response.json(content_type=None)
                status = response.status
        if status != 200:
            raise _typed_refusal(self.url, status, data)
        return data

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


class RemoteStream:
    """One request streamed from a replica, as newline-delimited JSON: `{"chunk": ...}`
    lines, then one `{"completion": ...}` line."""

    def __init__(self, service: RemoteService, request: Request):
        self.service = service
        self.request = request
        self.completion: Completion | None = None
        self._response = None

    def __aiter__(self) -> AsyncIterator[Chunk]:
        return self._chunks()

    async def _chunks(self) -> AsyncIterator[Chunk]:
        url = self.service.url
        try:
            with self.service._reaching():
                self._response = response = await self.service._send(
                    "/rollout/stream", {"request": convert.unstructure(self.request)})
                refused = None if response.status == 200 else (
                    response.status, await response.json(content_type=None))
            if refused is not None:  # a 400 is the request's own error, raised as itself
                raise (_typed_refusal if refused[0] == 400 else _refusal)(url, *refused)
            with self.service._reaching():
                async for line in Lines(response.content):
                    item = json.loads(line)
                    if "chunk" in item:
                        yield convert.structure(item["chunk"], Chunk)
                    else:
                        self.completion = convert.structure(item["completion"], Completion)
        finally:
            await self.aclose()
        if self.completion is None:
            raise ReplicaDown(f"{url} ended the stream before the completion")
        if self.completion.error is not None:
            raise self.completion.error

    def cancel(self) -> None:
        """Drop the connection (the replica then stops the request): the iteration raises
        ReplicaDown. The pool does this to the streams of a replica it takes out."""
        if self._response is not None:
            self._response.close()

    async def aclose(self) -> None:
        self.cancel()


def _refusal(url: str, status: int, data) -> Exception:
    """What a replica's error answer means to the pool: 503 is a replica down."""
    message = _error_message(data)
    if status == 503:
        return ReplicaDown(f"{url} answered 503: {message}")
    if status == 401:
        return RolloutError(f"{url} refused the API key: {message}")
    if status == 429:
        return OverloadedError(f"{url}: {message}")
    if status == 504:
        return RolloutTimeoutError(f"{url} timed out: {message}")
    return RolloutError(f"{url} answered {status}: {message}")


def _typed_refusal(url: str, status: int, data) -> Exception:
    """The replica's own error, rebuilt with its type (an OpenAI error body whose code is
    the rollout error kind)."""
    from rollout.contract.errors import InvalidRequestError, error_class, from_dict

    error = data.get("error") if isinstance(data, dict) else None
    if not isinstance(error, dict) or status == 401:
        return _refusal(url, status, data)
    if status == 400:  # the message names the field and what it may be
        field = error.get("param") or "body"
        cls = error_class(error.get("code"))
        cls = cls if issubclass(cls, InvalidRequestError) else InvalidRequestError
        return cls(field, str(error.get("message")).removeprefix(f"{field}: "))
    return from_dict({"kind": error.get("code"), "message": f"{url}: {error.get('message')}"})


def _error_code(data) -> str | None:
    if isinstance(data, dict) and isinstance(data.get("error"), dict):
        return data["error"].get("code")
    return None


def _error_message(data) -> str:
    if isinstance(data, dict) and isinstance(data.get("error"), dict):
        return str(data["error"].get("message"))
    return str(data)[:500]
