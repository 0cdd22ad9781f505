"""The two ways the backend reaches vLLM, behind one small async interface:

- `AsyncEngine`: vLLM's AsyncLLM, created in this process (its engine core runs in a
  child process that vLLM manages);
- `ServerEngine`: vLLM's OpenAI-compatible server started as a child process on loopback,
  spoken to over HTTP.

Both return samples as `Sample`s, and both move weights as safetensors bytes through
`rollout_vllm.worker.WeightUpdateExtension`.
"""

from __future__ import annotations

import asyncio
import base64
import sys
from typing import NamedTuple

from rollout import EngineDeadError, GenerationError, InvalidRequestError, RolloutError
from rollout.process import HOST, ServerProcess, cli_flags, free_port

EXTENSION = "rollout_vllm.worker.WeightUpdateExtension"
SERVED_NAME = "rollout"


class Sample(NamedTuple):
    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]]] | None


def request_error(message: str, parameter: str | None = None) -> RolloutError:
    """vLLM's own request validation, as a per-request error naming our field."""
    if parameter == "input_tokens" or "context length" in message or "out of vocabulary" in message:
        return InvalidRequestError("prompt_token_ids", message)
    if parameter:
        return InvalidRequestError(f"sampling.{parameter}", message)
    return GenerationError(message)


class AsyncEngine:
    def __init__(self, engine_args: dict):
        self.engine_args = engine_args
        self.engine = None

    async def start(self) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        # Created on the loop that will drive it: its output handler binds to that loop.
        self.engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**self.engine_args))

    async def generate(self, rid: str, prompt: list[int], params: dict) -> list[Sample]:
        from vllm import SamplingParams
        from vllm.exceptions import VLLMClientError
        from vllm.sampling_params import RequestOutputKind
        from vllm.v1.engine.exceptions import EngineDeadError as VLLMEngineDead

        sampling = SamplingParams(**params, output_kind=RequestOutputKind.FINAL_ONLY)
        final = None
        try:
            async for output in self.engine.generate({"prompt_token_ids": prompt}, sampling, rid):
                final = output
        except VLLMClientError as exc:
            raise request_error(str(exc), getattr(exc, "parameter", None)) from None
        except VLLMEngineDead as exc:
            raise EngineDeadError(f"vLLM engine died: {exc}") from None
        k = params.get("logprobs")
        return [Sample(list(o.token_ids), o.text, o.finish_reason or "abort",
                       _chosen(o.token_ids, o.logprobs) if k is not None else None,
                       _top(o.logprobs, k) if k else None)
                for o in sorted(final.outputs, key=lambda o: o.index)]

    async def abort(self, rids: list[str]) -> None:
        await self.engine.abort(rids)

    async def update_weights(self, data: bytes) -> None:
        await self.engine.collective_rpc("rollout_update_weights", args=(data,))
        await self.engine.reset_prefix_cache()

    async def release(self, level: int) -> None:
        await self.engine.sleep(level=level)

    async def resume(self, tags: list[str]) -> None:
        await self.engine.wake_up(tags=tags)

    async def close(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None


def _chosen(token_ids, logprobs) -> list[float]:
    return [float(step[t].logprob) for t, step in zip(token_ids, logprobs)]


def _top(logprobs, k: int) -> list[list[tuple[int, float]]]:
    return [sorted(((int(t), float(lp.logprob)) for t, lp in step.items() if lp.rank <= k),
                   key=lambda pair: -pair[1])[:k] for step in logprobs]


class ServerEngine:
    """vLLM's OpenAI server in a child process. Every call fails within about a second of
    the server dying, with the end of its log."""

    def __init__(self, engine_args: dict, startup_timeout: float, request_timeout: float):
        self.engine_args = engine_args
        self.startup_timeout = startup_timeout
        self.request_timeout = request_timeout
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.process: ServerProcess | None = None
        self.session = None

    def argv(self) -> list[str]:
        args = dict(self.engine_args)
        argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                "--model", args.pop("model"), "--host", HOST, "--port", str(self.port),
                "--served-model-name", SERVED_NAME]
        return argv + cli_flags(args)

    async def start(self) -> None:
        import aiohttp

        # Dev mode adds the routes for abort, weight RPCs and prefix-cache resets.
        self.process = ServerProcess("vllm", self.argv(), env={"VLLM_SERVER_DEV_MODE": "1"})
        await asyncio.to_thread(self.process.wait_healthy, f"{self.url}/health",
                                self.startup_timeout)
        self.session = aiohttp.ClientSession()

    async def _call(self, path: str, body: dict | None = None, timeout: float | None = None):
        """POST and return the JSON answer, racing the request against the server's death."""
        import aiohttp

        async def post():
            async with self.session.post(
                self.url + path, json=body or {},
                timeout=aiohttp.ClientTimeout(total=timeout or self.request_timeout),
            ) as response:
                data = await response.json(content_type=None)
                return response.status, data

        async def death():
            while self.process.alive():
                await asyncio.sleep(0.5)

        request, watch = asyncio.ensure_future(post()), asyncio.ensure_future(death())
        try:
            done, _ = await asyncio.wait({request, watch}, return_when=asyncio.FIRST_COMPLETED)
            if request in done and request.exception() is None:
                status, data = request.result()
                if status == 400:
                    error = data.get("error", {}) if isinstance(data, dict) else {}
                    raise request_error(str(error.get("message", data)), error.get("param"))
                if status != 200:
                    raise GenerationError(f"vLLM server answered {status} on {path}: {data}")
                return data
            await asyncio.sleep(0.2)  # let a dying process finish exiting
            self.process.check()
            if request in done:
                raise GenerationError(f"vLLM server call {path} failed: {request.exception()!r}")
            raise EngineDeadError(f"vLLM server stopped while answering {path}")
        finally:
            for task in (request, watch):
                task.cancel()

    async def generate(self, rid: str, prompt: list[int], params: dict) -> list[Sample]:
        body = {"model": SERVED_NAME, "prompt": prompt, "request_id": rid,
                "return_token_ids": True, "return_tokens_as_token_ids": True,
                **{k: v for k, v in params.items() if v is not None}}
        data = await self._call("/v1/completions", body)
        k = params.get("logprobs")
        samples = []
        for choice in sorted(data["choices"], key=lambda c: c["index"]):
            logprobs = choice.get("logprobs") or {}
            samples.append(Sample(
                list(choice["token_ids"]), choice["text"], choice["finish_reason"] or "abort",
                [float(x) for x in logprobs["token_logprobs"]] if k is not None else None,
                [sorted(((_token_id(t), float(lp)) for t, lp in (step or {}).items()),
                        key=lambda pair: -pair[1])[:k] for step in logprobs["top_logprobs"]]
                if k else None))
        return samples

    async def abort(self, rids: list[str]) -> None:
        # The server names a completion's engine request cmpl-<request_id>-<prompt index>.
        await self._call("/abort_requests", {"request_ids": [f"cmpl-{r}-0" for r in rids]},
                         timeout=30)

    async def update_weights(self, data: bytes) -> None:
        await self._call("/collective_rpc", {"method": "rollout_update_weights",
                                             "args": [base64.b64encode(data).decode()]})
        await self._call("/reset_prefix_cache", timeout=60)

    async def release(self, level: int) -> None:
        await self._call(f"/sleep?level={level}", timeout=300)

    async def resume(self, tags: list[str]) -> None:
        await self._call("/wake_up?" + "&".join(f"tags={t}" for t in tags), timeout=300)

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
        if self.process is not None:
            await asyncio.to_thread(self.process.stop)


def _token_id(token: str) -> int:
    return int(token.rsplit(":", 1)[1])  # "token_id:488", from return_tokens_as_token_ids
