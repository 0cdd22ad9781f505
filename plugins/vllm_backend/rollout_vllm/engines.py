"""The two ways the backend reaches vLLM, behind one small async interface:

- `InProcessEngine`: vLLM's LLMEngine with its engine core in this process, stepped by a
  thread of ours, as `vllm.LLM` does, so that concurrent calls share continuous batching;
- `ServerEngine`: vLLM's OpenAI-compatible server started as a child process on loopback,
  spoken to over HTTP.

Both take a request's abort signal (a future) with the request and then return what it
has made so far, as `Sample`s; both load weights through
`rollout_vllm.worker.WeightUpdateExtension`: in process as tensors, over HTTP as
safetensors bytes (never pickle).
"""

from __future__ import annotations

import asyncio
import base64
import json
import queue
import sys
import threading
from typing import NamedTuple

from rollout import EngineDeadError, GenerationError, InvalidRequestError, RolloutError
from rollout.kit.aio import client_session
from rollout.kit.process import HOST, ServerProcess, cli_flags, free_port

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


class InProcessEngine:
    """LLMEngine is not thread-safe, so one thread owns it: between engine steps it runs the
    commands queued by the event loop (add, abort, RPCs), and it hands each finished
    request's output back to the loop."""

    def __init__(self, engine_args: dict):
        self.engine_args = engine_args
        self.engine = None
        self.commands: queue.SimpleQueue = queue.SimpleQueue()  # (fn(engine), future or None)
        self.waiting: dict[str, asyncio.Future] = {}  # vLLM request id -> its caller
        self.adds: list[tuple] = []  # requests not yet handed to the engine's thread
        self.dead: str | None = None
        self.thread: threading.Thread | None = None

    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        ready = self.loop.create_future()
        self.thread = threading.Thread(target=self._serve, args=(ready,),
                                       name="rollout-vllm-engine", daemon=True)
        self.thread.start()
        await ready

    def _create(self):
        from vllm.engine.arg_utils import EngineArgs
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.llm_engine import LLMEngine
        from vllm.v1.executor import Executor

        # vLLM's defaults for offline batches (e.g. twice the running sequences of its
        # server's), as `vllm.LLM` gets: rollouts are batch work.
        config = EngineArgs(**self.engine_args).create_engine_config(UsageContext.LLM_CLASS)
        return LLMEngine(vllm_config=config, executor_class=Executor.get_class(config),
                         log_stats=False, multiprocess_mode=False)

    # --- on the engine's thread -----------------------------------------------------------

    def _serve(self, ready: asyncio.Future) -> None:
        try:
            self.engine = self._create()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller of start()
            self._settle(ready, exception=exc)
            return
        self._settle(ready)
        try:
            while self._run_commands(block=not self.engine.has_unfinished_requests()):
                if self.engine.has_unfinished_requests():
                    for output in self.engine.step():
                        if output.finished:
                            self._finish(output.request_id, output)
        except BaseException as exc:  # noqa: BLE001 - every waiting call learns of it
            self.dead = f"vLLM engine failed: {exc!r}"
            for rid in list(self.waiting):
                self._finish(rid, exception=EngineDeadError(self.dead))
            while not self.commands.empty():
                _, future = self.commands.get_nowait()
                self._settle(future, exception=EngineDeadError(self.dead))

    def _run_commands(self, block: bool) -> bool:
        """Run every queued command (waiting for one if `block`); False once told to stop."""
        try:
            fn, future = self.commands.get(block=block)
        except queue.Empty:
            return True
        while True:
            if fn is None:
                self._settle(future)
                return False
            try:
                self._settle(future, fn(self.engine))
            except Exception as exc:  # noqa: BLE001 - handed to the caller
                self._settle(future, exception=exc)
            try:
                fn, future = self.commands.get_nowait()
            except queue.Empty:
                return True

    def _add_all(self, adds: list[tuple]) -> None:
        for rid, prompt, sampling in adds:
            if rid in self.waiting:  # else aborted before it got here
                try:
                    self.engine.add_request(rid, {"prompt_token_ids": prompt}, sampling)
                except Exception as exc:  # noqa: BLE001 - handed to that request's caller
                    self._finish(rid, exception=exc)

    def _settle(self, future: asyncio.Future | None, result=None, exception=None) -> None:
        def settle():
            if not future.done():
                if exception is not None:
                    future.set_exception(exception)
                else:
                    future.set_result(result)

        if future is not None:
            self.loop.call_soon_threadsafe(settle)

    def _finish(self, rid: str, output=None, exception=None) -> None:
        self._settle(self.waiting.pop(rid, None), output, exception)

    # --- on the event loop ----------------------------------------------------------------

    def _submit(self, fn) -> asyncio.Future:
        """Queue `fn(engine)` for the engine's thread; the future gets its result."""
        if self.dead:
            raise EngineDeadError(self.dead)
        future = self.loop.create_future()
        self.commands.put((fn, future))
        return future

    def _send_adds(self) -> None:
        adds, self.adds = self.adds, []
        self.commands.put((lambda engine: self._add_all(adds), None))

    async def generate(self, rid: str, prompt: list[int], params: dict,
                       aborted: asyncio.Future) -> list[Sample]:
        from vllm import SamplingParams
        from vllm.exceptions import VLLMClientError
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

        if self.dead:
            raise EngineDeadError(self.dead)
        structured = params.get("structured_outputs")
        try:
            sampling = SamplingParams(**{
                **params, "output_kind": RequestOutputKind.FINAL_ONLY,
                "structured_outputs": StructuredOutputsParams(**structured)
                if structured else None})
        except VLLMClientError as exc:
            raise request_error(str(exc), getattr(exc, "parameter", None)) from None
        except ValueError as exc:
            raise request_error(str(exc)) from None
        future = self.waiting[rid] = self.loop.create_future()
        self.adds.append((rid, prompt, sampling))
        if len(self.adds) == 1:
            # Sent once this loop iteration is over, with every request of the batch: the
            # engine then schedules them together instead of stepping on a trickle.
            self.loop.call_soon(self._send_adds)

        def abort(_):  # the engine's thread then ends the request with what it has made
            if not future.done():
                self.commands.put((lambda engine: self._abort(engine, rid), None))

        aborted.add_done_callback(abort)
        try:
            final = await future
        except VLLMClientError as exc:
            raise request_error(str(exc), getattr(exc, "parameter", None)) from None
        except ValueError as exc:
            raise request_error(str(exc)) from None
        finally:
            aborted.remove_done_callback(abort)
            self.waiting.pop(rid, None)
        return samples_of(final, params)

    def _abort(self, engine, rid: str) -> None:
        partial = _partial_output(engine, rid)
        try:
            engine.abort_request([rid])
        finally:  # its caller hears back whatever happens
            self._finish(rid, partial)

    async def update_weights(self, tensors: dict) -> None:
        def load(engine):  # in process: the tensors themselves, no copy through bytes
            engine.collective_rpc("rollout_load_tensors", args=(list(tensors.items()),))
            engine.reset_prefix_cache()

        await self._submit(load)

    async def release(self, level: int) -> None:
        await self._submit(lambda engine: engine.sleep(level=level))

    async def resume(self, tags: list[str]) -> None:
        await self._submit(lambda engine: engine.wake_up(tags=tags))

    async def close(self) -> None:
        if self.thread is not None and self.thread.is_alive() and not self.dead:
            self.commands.put((None, None))
            await asyncio.to_thread(self.thread.join, 60)
        if self.engine is not None:
            self.engine.engine_core.shutdown()
            self.engine = None


def _partial_output(engine, rid: str):
    """What an aborted request has made so far, as its final output: LLMEngine drops an
    aborted request without a word (only AsyncLLM's queues get one)."""
    from vllm.v1.engine import FinishReason

    processor = engine.output_processor
    output = None
    for internal in list(processor.external_req_ids.get(rid, ())):
        state = processor.request_states.get(internal)
        if state is not None:  # with n > 1 the last child's output carries every sample
            output = state.make_request_output([], None, FinishReason.ABORT, None) or output
    return output


def samples_of(final, params: dict) -> list[Sample]:
    k = params.get("logprobs")
    if final is None:  # aborted before vLLM made anything
        return [Sample([], "", "abort", [] if k is not None else None, [] if k else None)
                for _ in range(params["n"])]
    return [Sample(list(o.token_ids), o.text, o.finish_reason or "abort",
                   _chosen(o.token_ids, o.logprobs) if k is not None else None,
                   _top(o.logprobs, k) if k else None)
            for o in sorted(final.outputs, key=lambda o: o.index)]


def _chosen(token_ids, logprobs) -> list[float]:
    return [float(step[t].logprob) for t, step in zip(token_ids, logprobs)]


def _top(logprobs, k: int) -> list[list[tuple[int, float]]]:
    return [sorted(((int(t), float(lp.logprob)) for t, lp in step.items() if lp.rank <= k),
                   key=lambda pair: -pair[1])[:k] for step in logprobs]


class ServerEngine:
    """vLLM's OpenAI server in a child process. Every call fails within about a second of
    the server dying, with the end of its log."""

    def __init__(self, engine_args: dict, startup_timeout: float, request_timeout: float,
                 stream_interval: int):
        self.engine_args = engine_args
        self.startup_timeout = startup_timeout
        self.request_timeout = request_timeout
        self.stream_interval = stream_interval  # an abort loses at most this many less one
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.process: ServerProcess | None = None
        self.session = None

    def argv(self) -> list[str]:
        # Structured settings (e.g. structured_outputs_config) go as JSON, as vLLM's CLI reads them.
        args = {k: json.dumps(v) if isinstance(v, (dict, list)) else v
                for k, v in self.engine_args.items()}
        argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                "--model", args.pop("model"), "--host", HOST, "--port", str(self.port),
                "--served-model-name", SERVED_NAME]
        return argv + cli_flags(args)

    async def start(self) -> None:
        # Dev mode adds the routes for weight RPCs, sleep and prefix-cache resets.
        self.process = ServerProcess("vllm", self.argv(), env={"VLLM_SERVER_DEV_MODE": "1"},
                                     die_with_parent=True)
        await asyncio.to_thread(self.process.wait_healthy, f"{self.url}/health",
                                self.startup_timeout)
        self.session = client_session(reuse_connections=False)

    async def _guarded(self, work, path: str, stop: asyncio.Future | None = None):
        """Await `work`, racing it against the server's death and, if given, `stop` (then
        `work` is cancelled, which closes its connection, and None is returned)."""

        async def death():
            while self.process.alive():
                await asyncio.sleep(0.5)

        task, watch = asyncio.ensure_future(work), asyncio.ensure_future(death())
        try:
            await asyncio.wait({task, watch} | ({stop} if stop else set()),
                               return_when=asyncio.FIRST_COMPLETED)
            if task.done():
                if task.exception() is None or isinstance(task.exception(), RolloutError):
                    return task.result()
            elif not watch.done():
                return None  # stopped
            await asyncio.sleep(0.2)  # let a dying process finish exiting
            self.process.check()
            if task.done():
                raise GenerationError(f"vLLM server call {path} failed: {task.exception()!r}")
            raise EngineDeadError(f"vLLM server stopped while answering {path}")
        finally:
            for t in (task, watch):
                t.cancel()

    async def _call(self, path: str, body: dict | None = None, timeout: float | None = None):
        """POST and return the JSON answer."""
        import aiohttp

        async def post():
            async with self.session.post(
                self.url + path, json=body or {},
                timeout=aiohttp.ClientTimeout(total=timeout or self.request_timeout),
            ) as response:
                return await _json(response, path)

        return await self._guarded(post(), path)

    async def generate(self, rid: str, prompt: list[int], params: dict,
                       aborted: asyncio.Future) -> list[Sample]:
        """Streamed, so that an abort is ours to make: closing the stream makes the server
        abort the request, and what it has made so far is already here. (An abort sent
        by id can reach a busy server after the request has finished, or before it has
        started.)"""
        import aiohttp

        body = {"model": SERVED_NAME, "prompt": prompt, "request_id": rid,
                "return_token_ids": True, "return_tokens_as_token_ids": True,
                "stream": True, "stream_interval": self.stream_interval,
                **{k: v for k, v in params.items() if v is not None}}
        made = _Streamed(params["n"], params.get("logprobs"))

        async def stream():
            async with self.session.post(
                self.url + "/v1/completions", json=body,
                timeout=aiohttp.ClientTimeout(total=self.request_timeout),
            ) as response:
                if response.status != 200:
                    await _json(response, "/v1/completions")
                async for line in response.content:
                    if line.startswith(b"data: {"):
                        made.add(json.loads(line[6:]))

        await self._guarded(stream(), "/v1/completions", aborted)
        return made.samples()

    async def update_weights(self, tensors: dict) -> None:
        from rollout_vllm.weights import to_bytes

        data = base64.b64encode(to_bytes(tensors)).decode()
        await self._call("/collective_rpc", {"method": "rollout_update_weights", "args": [data]})
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


async def _json(response, path: str):
    """The JSON of a 200 answer; the server's refusal as our error otherwise."""
    data = await response.json(content_type=None)
    if response.status == 400:
        error = data.get("error", {}) if isinstance(data, dict) else {}
        raise request_error(str(error.get("message", data)), error.get("param"))
    if response.status != 200:
        raise GenerationError(f"vLLM server answered {response.status} on {path}: {data}")
    return data


class _Streamed:
    """The samples of one streamed completion, as they arrive."""

    def __init__(self, n: int, logprobs: int | None):
        self.k = logprobs
        self.tokens: list[list[int]] = [[] for _ in range(n)]
        self.text = [""] * n
        self.finish: list[str | None] = [None] * n
        self.logprobs: list[list[float]] = [[] for _ in range(n)]
        self.top: list[list[list[tuple[int, float]]]] = [[] for _ in range(n)]

    def add(self, chunk: dict) -> None:
        if "error" in chunk:
            error = chunk["error"] if isinstance(chunk["error"], dict) else {}
            if error.get("code") == 400:  # refused once streaming began (e.g. a grammar)
                raise request_error(str(error.get("message")), error.get("param"))
            raise GenerationError(f"vLLM server failed mid-stream: {chunk['error']}")
        for choice in chunk.get("choices", ()):
            i = choice["index"]
            self.tokens[i] += choice.get("token_ids") or ()
            self.text[i] += choice.get("text") or ""
            self.finish[i] = choice.get("finish_reason") or self.finish[i]
            logprobs = choice.get("logprobs")
            if self.k is not None and logprobs:
                self.logprobs[i] += [_logprob(x) for x in logprobs["token_logprobs"]]
                if self.k:
                    self.top[i] += [sorted(((_token_id(t), _logprob(lp)) for t, lp in
                                            (step or {}).items()),
                                           key=lambda pair: -pair[1])[:self.k]
                                    for step in logprobs["top_logprobs"]]

    def samples(self) -> list[Sample]:
        """Every sample; one the stream did not finish (it was aborted) ends in "abort"."""
        return [Sample(tokens, text, finish or "abort",
                       logprobs if self.k is not None else None, top if self.k else None)
                for tokens, text, finish, logprobs, top in
                zip(self.tokens, self.text, self.finish, self.logprobs, self.top)]


# The OpenAI server clamps logprobs at this (JSON has no -inf): a token a grammar masks.
SERVER_LOGPROB_FLOOR = -9999.0


def _logprob(value) -> float:
    value = float(value)
    return float("-inf") if value <= SERVER_LOGPROB_FLOOR else value


def _token_id(token: str) -> int:
    return int(token.rsplit(":", 1)[1])  # "token_id:488", from return_tokens_as_token_ids
