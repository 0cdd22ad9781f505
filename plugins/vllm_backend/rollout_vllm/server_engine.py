"""`ServerEngine`: vLLM's OpenAI-compatible server started as a child process on loopback
(`rollout.kit.child_server`), spoken to over HTTP, and the reading of its answers and
streamed events. Its weight updates go through shared memory or, with
`weight_transport="gloo"`, through vLLM's weight-transfer routes (`rollout_vllm.transport`)."""

from __future__ import annotations

import asyncio
import base64
import json
import re
import sys
from collections.abc import AsyncIterator

import attrs

from rollout import Chunk, GenerationError, RolloutError, TokenLogprob
from rollout.kit.aio import LoopThread, Lines
from rollout.kit.child_server import ChildServer
from rollout.kit.images import EncodedImages, PromptImage
from rollout.kit.process import HOST, ServerProcess, cli_flags

from rollout_vllm.common import END_TIMEOUT_S, finish_reason, request_error, unfinished
from rollout_vllm.transport import GlooSender, ShmPipeline

SERVED_NAME = "rollout"


class ServerEngine:
    """vLLM's OpenAI server in a child process. Every call fails within about a second of
    the server dying, with the end of its log."""

    def __init__(self, engine_args: dict, startup_timeout: float, request_timeout: float,
                 stream_interval: int):
        self.engine_args = engine_args
        self.startup_timeout = startup_timeout
        self.request_timeout = request_timeout
        self.stream_interval = stream_interval  # tokens per streamed event
        self.server = ChildServer("vllm")
        self.url = self.server.url
        self.encoded = EncodedImages()  # each image's data: URL, for every later turn

    @property
    def process(self) -> ServerProcess | None:
        return self.server.process

    def argv(self) -> list[str]:
        # Structured settings (e.g. structured_outputs_config) go as JSON, as vLLM's CLI reads them.
        args = {k: json.dumps(v) if isinstance(v, (dict, list)) else v
                for k, v in self.engine_args.items()}
        argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                "--model", args.pop("model"), "--host", HOST, "--port", str(self.server.port),
                "--served-model-name", SERVED_NAME, "--enable-prompt-tokens-details"]
        # vLLM's boolean flags take `--no-` for false: a false that differs from vLLM's
        # default (enable_chunked_prefill, rollout_vllm.cpu) must reach it.
        off = [f"--no-{key.replace('_', '-')}" for key, value in args.items() if value is False]
        return argv + cli_flags(args) + off

    async def start(self) -> None:
        # Dev mode adds the routes for weight RPCs, sleep and prefix-cache resets. Watched:
        # a call waiting on a server that died fails at once, with the end of its log.
        # Runtime LoRA updates: the routes that load adapters after the start.
        env = {"VLLM_SERVER_DEV_MODE": "1",
               "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1" if self.engine_args.get("enable_lora")
               else "0"}
        await self.server.start(self.argv(), env, self.startup_timeout, watch=True)

    async def _call(self, path: str, body: dict | None = None, timeout: float | None = None):
        """POST and return the JSON answer."""
        import aiohttp

        self.server.check()
        try:
            async with self.server.session.post(
                self.url + path, json=body or {},
                timeout=aiohttp.ClientTimeout(total=timeout or self.request_timeout),
            ) as response:
                return await _json(response, path)
        except RolloutError:
            raise
        except (aiohttp.ClientError, OSError, RuntimeError) as exc:  # RuntimeError: closed
            raise await self.server.failure(exc, f"vLLM server call {path}") from None

    def model_config(self):
        return None  # in the server's process

    def yield_cores(self) -> None:
        pass  # nothing of vLLM's runs in this process

    def mm_cache_counts(self) -> tuple[int, int] | None:
        """(hits, lookups) of the server's multimodal processor cache, from its /metrics
        (Prometheus counters: cumulative, kept across sleep); None where it has none or
        does not answer. Blocking: a request on loopback, bounded."""
        import urllib.request

        if self.engine_args.get("mm_processor_cache_gb", 1) <= 0:
            return None  # no cache: its counters stay at 0 while every image is processed
        try:
            with urllib.request.urlopen(self.url + "/metrics", timeout=5) as response:
                text = response.read().decode()
        except OSError:
            return None
        counts = [re.findall(rf"^vllm:mm_cache_{name}_total\{{[^}}]*\}} (\S+)$", text,
                             re.MULTILINE) for name in ("hits", "queries")]
        if not counts[1]:
            return None  # the server's stats logging turned off
        hits, lookups = (sum(int(float(v)) for v in found) for found in counts)
        return hits, lookups

    async def generate(self, rid: str, prompt: dict, params: dict,
                       lora=None) -> AsyncIterator[Chunk]:
        """Streamed as the server makes tokens: token ids alone to /v1/completions, token
        ids with images to /inference/v1/generate (/v1/completions takes no images with
        ids). Cancelled, the request is aborted by its id once the server has sent its first
        token (before, the server may not hold it yet: closing the connection aborts it),
        and what the server made and held back (`stream_interval`) is read, then the
        cancellation goes on."""
        import aiohttp

        self.server.check()
        if params.get("prompt_logprobs") is not None and "multi_modal_data" not in prompt:
            # vLLM's server scores prompts only in a whole (not streamed) answer.
            async for chunk in self._scored(rid, prompt, params, lora):
                yield chunk
            return
        if "multi_modal_data" in prompt:
            path, parse = "/inference/v1/generate", _generate_chunks
            body = await _generate_body(rid, prompt, params, self.encoded, _model(lora))
            served_id = f"generate-tokens-{rid}"
        else:
            path, parse, served_id = "/v1/completions", _sse_chunks, f"cmpl-{rid}-0"
            body = {"model": _model(lora), "prompt": prompt["prompt_token_ids"],
                    "cache_salt": prompt["cache_salt"], "request_id": rid,
                    "return_token_ids": True,
                    "return_tokens_as_token_ids": True,
                    "stream": True, "stream_interval": self.stream_interval,
                    # The last event's usage says how many prompt tokens were cached.
                    "stream_options": {"include_usage": True},
                    **{k: v for k, v in params.items() if v is not None}}
        k = params.get("logprobs")
        try:
            async with self.server.session.post(
                self.url + path, json=body,
                timeout=aiohttp.ClientTimeout(total=self.request_timeout),
            ) as response:
                if response.status != 200:
                    await _json(response, path)
                ending: list[Chunk] = []  # samples' last chunks, held for the cached count
                lines = Lines(response.content)  # read on after a cancellation
                started = False
                try:
                    async for event in _events(lines):
                        started = True
                        for chunk in parse(event, k):
                            if chunk.finish_reason is None:
                                yield chunk
                            else:
                                ending.append(chunk)
                        cached = _cached_tokens(event)
                        if cached is not None:
                            for chunk in ending:
                                yield attrs.evolve(chunk, cached_tokens=cached)
                            ending = []
                except asyncio.CancelledError:
                    if started:
                        for chunk in unfinished(ending + await self._end(served_id, lines,
                                                                         parse, k)):
                            yield chunk
                    raise
                for chunk in ending:  # (no usage came)
                    yield chunk
        except RolloutError:
            raise
        except (aiohttp.ClientError, OSError, RuntimeError) as exc:  # RuntimeError: closed
            raise await self.server.failure(exc, f"vLLM server call {path}") from None

    async def _end(self, served_id: str, lines: Lines, parse, k: int | None) -> list[Chunk]:
        """Abort a request (the server's own id for it) and read the rest of its stream:
        the chunks of what vLLM made and held back, which its abort sends; none if they do
        not come within END_TIMEOUT_S (what was handed over stands)."""
        try:
            async with asyncio.timeout(END_TIMEOUT_S):
                await self._call("/abort_requests", {"request_ids": [served_id]})
                return [chunk async for event in _events(lines) for chunk in parse(event, k)]
        except (TimeoutError, RolloutError):
            return []

    async def _scored(self, rid: str, prompt: dict, params: dict, lora
                      ) -> AsyncIterator[Chunk]:
        """A request with prompt_logprobs, in one answer from /v1/completions: the prompt's
        scores first, then every sample whole."""
        import aiohttp

        path = "/v1/completions"
        body = {"model": _model(lora), "prompt": prompt["prompt_token_ids"],
                "cache_salt": prompt["cache_salt"], "request_id": rid,
                "return_token_ids": True, "return_tokens_as_token_ids": True,
                **{k: v for k, v in params.items() if v is not None}}
        try:
            async with self.server.session.post(
                self.url + path, json=body,
                timeout=aiohttp.ClientTimeout(total=self.request_timeout),
            ) as response:
                answer = await _json(response, path)
        except RolloutError:
            raise
        except (aiohttp.ClientError, OSError, RuntimeError) as exc:  # RuntimeError: closed
            raise await self.server.failure(exc, f"vLLM server call {path}") from None
        choices = answer.get("choices") or []
        if not choices:
            raise GenerationError(f"vLLM server answered no choice on {path}: {answer}")
        yield Chunk(0, **_prompt_scores(prompt["prompt_token_ids"],
                                        choices[0].get("prompt_logprobs"),
                                        params["prompt_logprobs"]))
        cached = _cached_tokens(answer)
        for chunk in _sse_chunks(answer, params.get("logprobs")):
            yield attrs.evolve(chunk, cached_tokens=cached)

    def weight_path(self, transport: str, loop: LoopThread, timeout: float,
                    group_timeout: float) -> GlooSender | ShmPipeline:
        return GlooSender(self, loop, timeout, group_timeout) if transport == "gloo" else \
            ShmPipeline(self, loop, timeout)

    async def load_weights(self, message: dict, timeout: float) -> None:
        # Only the JSON message goes over HTTP; the bytes are in shared memory. vLLM bounds
        # the call on its side too.
        await self._call("/collective_rpc", {"method": "rollout_receive_shm",
                                             "args": [message], "timeout": timeout},
                         timeout=timeout + 30)

    async def load_adapter(self, lora, config: dict, tensors: dict, timeout: float) -> None:
        """The tensors to the worker (JSON: safetensors bytes in base64), then the server's
        own route loads the adapter under `lora`'s name, which requests then give as their
        model."""
        from safetensors.torch import save

        await self._call("/collective_rpc", {
            "method": "rollout_keep_adapter", "timeout": timeout,
            "args": [lora.lora_int_id, config, base64.b64encode(save(tensors)).decode()]},
            timeout=timeout + 30)
        try:
            await self._call("/v1/load_lora_adapter", {"lora_name": lora.lora_name,
                                                       "lora_path": lora.lora_path}, timeout)
        except BaseException:
            await self._drop_adapter(lora, timeout)
            raise

    async def unload_adapter(self, lora, timeout: float) -> None:
        await self._call("/v1/unload_lora_adapter", {"lora_name": lora.lora_name}, timeout)
        await self._drop_adapter(lora, timeout)

    async def _drop_adapter(self, lora, timeout: float) -> None:
        await self._call("/collective_rpc", {"method": "rollout_unload_adapter",
                                             "args": [lora.lora_int_id], "timeout": timeout},
                         timeout=timeout + 30)

    # vLLM's weight-transfer routes (`weight_transport="gloo"`, rollout_vllm.transport).

    async def init_weight_transfer(self, init_info: dict, timeout: float) -> None:
        await self._call("/init_weight_transfer_engine", {"init_info": init_info}, timeout)

    async def start_weight_update(self, timeout: float) -> None:
        await self._call("/start_weight_update", timeout=timeout)

    async def update_weights_chunk(self, update_info: dict, timeout: float) -> None:
        await self._call("/update_weights", {"update_info": update_info}, timeout)

    async def finish_weight_update(self, version: str | None, timeout: float) -> None:
        await self._call("/finish_weight_update", {"weight_version": version}, timeout)

    async def shutdown_weight_transfer(self, timeout: float) -> None:
        await self._call("/shutdown_weight_transfer_engine", timeout=timeout)

    async def pause(self) -> None:
        await self._call("/pause?mode=keep&clear_cache=false", timeout=60)

    async def go_on(self) -> None:
        await self._call("/resume", timeout=60)

    async def name_weights(self, name: str) -> None:
        await self._call("/update_weight_version", {"new_version": name}, timeout=60)

    async def release(self, level: int) -> None:
        await self._call(f"/sleep?level={level}", timeout=300)

    async def resume(self, tags: list[str]) -> None:
        await self._call("/wake_up?" + "&".join(f"tags={t}" for t in tags), timeout=300)

    async def close(self) -> None:
        await self.server.close_session()
        await asyncio.to_thread(self.server.stop)


async def _json(response, path: str):
    """The JSON of a 200 answer (or its text: vLLM's LoRA routes answer plain text); the
    server's refusal as our error otherwise."""
    text = await response.text()
    try:
        data = json.loads(text)
    except ValueError:
        data = text
    if response.status == 400:
        error = data.get("error", {}) if isinstance(data, dict) else {}
        raise request_error(str(error.get("message", data)), error.get("param"))
    if response.status != 200:
        raise GenerationError(f"vLLM server answered {response.status} on {path}: {data}")
    return data


def _prompt_scores(prompt: list[int], steps: list | None, k: int) -> dict:
    """vLLM's server's prompt_logprobs (None, then per position token id -> {logprob,
    rank, decoded_token}: the prompt's token and the top k) as the Chunk's fields."""
    if not steps or len(steps) != len(prompt):
        raise GenerationError(f"vLLM server scored {len(steps or ())} positions of a "
                              f"{len(prompt)}-token prompt")
    values: list[float | None] = [None]
    tops: list[tuple] = [()]
    for token, step in zip(prompt[1:], steps[1:]):
        values.append(_logprob(step[str(token)]["logprob"]))
        ranked = sorted(((int(t), _logprob(e["logprob"])) for t, e in step.items()
                         if e.get("rank") is not None and e["rank"] <= k),
                        key=lambda pair: -pair[1])[:k]
        tops.append(tuple(TokenLogprob(t, v) for t, v in ranked))
    return {"prompt_logprobs": values, "prompt_top_logprobs": tops if k else None}


async def _events(lines: Lines) -> AsyncIterator[dict]:
    """The JSON events of a server-sent stream."""
    async for line in lines:
        if line.startswith(b"data: {"):
            yield json.loads(line[6:])


def _cached_tokens(event: dict) -> int | None:
    """The prompt tokens vLLM's server found cached, from a stream's final usage event."""
    details = (event.get("usage") or {}).get("prompt_tokens_details") or {}
    return details.get("cached_tokens")


def _check_event(event: dict) -> None:
    """A streamed event's error, raised."""
    if "error" in event:
        error = event["error"] if isinstance(event["error"], dict) else {}
        if error.get("code") == 400:  # refused once streaming began (e.g. a grammar)
            raise request_error(str(error.get("message")), error.get("param"))
        raise GenerationError(f"vLLM server failed mid-stream: {event['error']}")


def _choices(event: dict):
    """(choice, index, token ids, finish reason) of a streamed event's choices that carry
    tokens or an end (either route's events)."""
    _check_event(event)
    for choice in event.get("choices", ()):
        i, tokens = choice["index"], choice.get("token_ids") or ()
        finish = finish_reason(choice.get("finish_reason"), i)
        if tokens or finish is not None:
            yield choice, i, tokens, finish


def _sse_chunks(event: dict, k: int | None) -> list[Chunk]:
    """The chunks of one streamed /v1/completions event."""
    chunks = []
    for choice, i, tokens, finish in _choices(event):
        lp = choice.get("logprobs") or {}
        logprobs = top = None
        if k is not None:
            logprobs = [_logprob(x) for x in lp.get("token_logprobs") or ()]
        if k:
            top = [tuple(TokenLogprob(t, v) for t, v in sorted(
                ((_token_id(t), _logprob(v)) for t, v in (step or {}).items()),
                key=lambda pair: -pair[1])[:k]) for step in lp.get("top_logprobs") or ()]
        chunks.append(Chunk(i, tokens, logprobs, top, finish))
    return chunks


def _model(lora) -> str:
    """The model a request names: the adapter's name as the server loaded it, or the base."""
    return SERVED_NAME if lora is None else lora.lora_name


async def _generate_body(rid: str, prompt: dict, params: dict, encoded: EncodedImages,
                         model: str) -> dict:
    """A streamed request to /inference/v1/generate: the collapsed ids (vLLM expands each
    placeholder), each image as a PNG data: URL (lossless: the pixels the core loaded; encoded
    off the loop, once per image) with our id as its uuid, the key of vLLM's processor
    cache."""
    images = [PromptImage(image, uuid) for image, uuid in zip(
        prompt["multi_modal_data"]["image"], prompt["multi_modal_uuids"]["image"], strict=True)]
    urls = await asyncio.to_thread(lambda: [encoded.url(image) for image in images])
    sampling = {key: v for key, v in params.items() if v is not None}
    # Text is not used (the core decodes tokens): made only to find stop strings.
    sampling["detokenize"] = bool(params.get("stop"))
    if params.get("logprobs"):
        # The route lists each position's first k entries, the sampled token first: one more
        # keeps the whole top k when the sampled token is not in it (cut in _generate_chunks).
        sampling["logprobs"] = params["logprobs"] + 1
    return {"model": model, "request_id": rid, "token_ids": prompt["prompt_token_ids"],
            "cache_salt": prompt["cache_salt"],
            "content_parts": [{"type": "image_url", "url": url, "uuid": uuid} for url, uuid
                              in zip(urls, prompt["multi_modal_uuids"]["image"], strict=True)],
            "sampling_params": sampling, "stream": True,
            "stream_options": {"include_usage": True}}  # usage: the cached tokens


def _generate_chunks(event: dict, k: int | None) -> list[Chunk]:
    """The chunks of one streamed /inference/v1/generate event (token ids as integers)."""
    chunks = []
    for choice, i, tokens, finish in _choices(event):
        steps = (choice.get("logprobs") or {}).get("content") or ()
        logprobs = [_logprob(step["logprob"]) for step in steps] if k is not None else None
        top = [tuple(TokenLogprob(t["token_id"], _logprob(t["logprob"])) for t in sorted(
            step["top_logprobs"], key=lambda t: -t["logprob"])[:k]) for step in steps] \
            if k else None
        chunks.append(Chunk(i, tokens, logprobs, top, finish))
    return chunks


# The OpenAI server clamps logprobs at this (JSON has no -inf): a token a grammar masks.
SERVER_LOGPROB_FLOOR = -9999.0


def _logprob(value) -> float:
    value = float(value)
    return float("-inf") if value <= SERVER_LOGPROB_FLOOR else value


def _token_id(token: str) -> int:
    return int(token.rsplit(":", 1)[1])  # "token_id:488", from return_tokens_as_token_ids
