"""The three ways the backend reaches vLLM, behind one small async interface:

- `InProcessEngine`: vLLM's LLMEngine with its engine core in this process, stepped by a
  thread of ours, as `vllm.LLM` does, so that concurrent requests share continuous batching;
- `AsyncEngine`: vLLM's AsyncLLM, its engine core in a child process (ZMQ) and its output
  processing in this one, as vLLM's own server runs it;
- `ServerEngine`: vLLM's OpenAI-compatible server started as a child process on loopback,
  spoken to over HTTP.

All run on the engine loop (`rollout.kit.aio.engine_loop()`). `generate` is an async
iterator of `rollout.Chunk`s as vLLM makes tokens; cancelling it stops the request in vLLM.
All load weights through `rollout_vllm.worker.WeightUpdateExtension`: in process as
tensors (`in_process`), to another process as a bucket in shared memory named by a JSON
message (`rollout.weights.transports.shm`; never pickle), one message per group of whole layers;
or, with `weight_transport="gloo"` in server mode, through vLLM's weight-transfer routes
(`rollout_vllm.transport`).
After every update the backend resets vLLM's prefix cache: KV computed under the old
weights must not be read under the new ones.
"""

from __future__ import annotations

import asyncio
import json
import queue
import re
import subprocess
import sys
import threading
from collections.abc import AsyncIterator
from contextlib import aclosing, contextmanager, suppress

import attrs

from rollout import (
    Chunk,
    EngineDeadError,
    GenerationError,
    InvalidRequestError,
    RolloutError,
    TokenLogprob,
)
from rollout.kit.aio import client_session, lines
from rollout.kit.images import EncodedImages, PromptImage
from rollout.kit.process import (
    HOST,
    ServerProcess,
    die_with_parent_hook,
    cli_flags,
    free_port,
)

EXTENSION = "rollout_vllm.worker.WeightUpdateExtension"
SERVED_NAME = "rollout"
FINISH_REASONS = ("stop", "length", "abort")


def request_error(message: str, parameter: str | None = None) -> RolloutError:
    """vLLM's own request validation, as a per-request error naming our field."""
    if parameter == "input_tokens" or "context length" in message or "out of vocabulary" in message:
        return InvalidRequestError("prompt_token_ids", message)
    if parameter:
        return InvalidRequestError(f"sampling.{parameter}", message)
    return GenerationError(message)


def _refusal(exc: Exception) -> Exception:
    """What vLLM raised on taking a request, as that request's error where it is one."""
    from vllm.exceptions import VLLMClientError

    if isinstance(exc, RolloutError):
        return exc
    if isinstance(exc, VLLMClientError):
        return request_error(str(exc), getattr(exc, "parameter", None))
    if isinstance(exc, ValueError):
        return request_error(str(exc))
    return exc


def _finish(reason: str | None, index: int) -> str | None:
    if reason is not None and reason not in FINISH_REASONS:
        raise GenerationError(f"vLLM ended sample {index} with {reason!r}")
    return reason


def sampling_params(params: dict, stream_interval: int):
    """vLLM's SamplingParams for our request, deltas only; its refusal as the request's
    error. `stream_interval` applies where `params` names none."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

    structured = params.get("structured_outputs")
    try:
        return SamplingParams(**{
            **params, "output_kind": RequestOutputKind.DELTA,
            "stream_interval": params.get("stream_interval", stream_interval),
            # vLLM's text is not used (the core decodes tokens): made only to find stops.
            "detokenize": bool(params.get("stop")),
            "structured_outputs": StructuredOutputsParams(**structured)
            if structured else None})
    except Exception as exc:  # noqa: BLE001 - as the request's error where it is one
        raise _refusal(exc) from None


class InProcessEngine:
    """LLMEngine is not thread-safe, so one thread owns it: between engine steps it runs the
    commands queued from the engine loop (add, abort, RPCs), and hands each step's outputs
    to the loop in one call, which sorts them into each request's `_Outputs`."""

    def __init__(self, engine_args: dict, stream_interval: int = 1):
        self.engine_args = engine_args
        self.stream_interval = stream_interval  # tokens per output, as in server mode
        self.engine = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.commands: queue.SimpleQueue = queue.SimpleQueue()  # fn(engine); None stops
        self.streams: dict[str, _Outputs] = {}  # vLLM request id -> its outputs (loop only)
        self.adds: list[tuple] = []  # requests not yet handed to the engine's thread
        self.calls: set[asyncio.Future] = set()  # RPCs waiting for the engine's thread
        self.dead: str | None = None
        self.thread: threading.Thread | None = None
        self.mm_counts: MMCacheCounts | None = None

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
            self.loop.call_soon_threadsafe(_settle, ready, None, exc)
            return
        self.mm_counts = MMCacheCounts.of(self.engine.renderer)
        self.loop.call_soon_threadsafe(_settle, ready, None, None)
        engine = self.engine
        try:
            while self._run_commands(block=not engine.has_unfinished_requests()):
                if engine.has_unfinished_requests():
                    outputs = engine.step()
                    if outputs:  # one hop to the loop per step, however many requests
                        self.loop.call_soon_threadsafe(self._deliver, outputs)
        except BaseException as exc:  # noqa: BLE001 - every waiting call learns of it
            self.dead = f"vLLM engine failed: {exc!r}"
            self.loop.call_soon_threadsafe(self._fail_all)

    def _run_commands(self, block: bool) -> bool:
        """Run every queued command (waiting for one if `block`); False once told to stop."""
        try:
            fn = self.commands.get(block=block)
        except queue.Empty:
            return True
        while fn is not None:
            fn(self.engine)
            try:
                fn = self.commands.get_nowait()
            except queue.Empty:
                return True
        return False

    def _add_all(self, engine, adds: list[tuple]) -> None:
        refused = []
        for rid, prompt, sampling in adds:
            try:
                # vLLM's renderer runs here, on this thread (for images: its processor).
                engine.add_request(rid, prompt, sampling)
            except Exception as exc:  # noqa: BLE001 - handed to that request's generator
                refused.append((rid, _refusal(exc)))
        if refused:
            self.loop.call_soon_threadsafe(self._deliver_errors, refused)

    # --- on the event loop ----------------------------------------------------------------

    def _deliver(self, outputs: list) -> None:
        for output in outputs:
            stream = self.streams.get(output.request_id)
            if stream is not None:  # else cancelled meanwhile
                stream.put(output)

    def _deliver_errors(self, refused: list[tuple]) -> None:
        for rid, exc in refused:
            stream = self.streams.get(rid)
            if stream is not None:
                stream.put(exc)

    def _fail_all(self) -> None:
        for stream in self.streams.values():
            stream.put(EngineDeadError(self.dead))
        for future in self.calls:
            _settle(future, None, EngineDeadError(self.dead))

    def _send_adds(self) -> None:
        adds = [a for a in self.adds if a[0] in self.streams]  # not cancelled meanwhile
        self.adds = []
        for rid, _, _ in adds:
            self.streams[rid].sent = True
        if adds:
            self.commands.put(lambda engine: self._add_all(engine, adds))

    def model_config(self):
        return self.engine.model_config

    async def generate(self, rid: str, prompt: dict, params: dict) -> AsyncIterator[Chunk]:
        """`prompt`: vLLM's prompt dict (`prompt_token_ids`, and any images)."""
        if self.dead:
            raise EngineDeadError(self.dead)
        sampling = sampling_params(params, self.stream_interval)
        stream = self.streams[rid] = _Outputs()
        self.adds.append((rid, prompt, sampling))
        if len(self.adds) == 1:
            # Sent once this loop iteration is over, with every request that came in it: the
            # engine then schedules them together instead of stepping on a trickle.
            self.loop.call_soon(self._send_adds)
        k = params.get("logprobs")
        finished = False
        try:
            while not finished:
                outputs = await stream.take(self.loop)
                finished = outputs[-1].finished
                for chunk in _chunks(outputs, k):
                    yield chunk
        finally:
            del self.streams[rid]
            if not finished and stream.sent and not self.dead:
                # The command queue is FIFO: this comes after the add, registered or not.
                self.commands.put(lambda engine: engine.abort_request([rid]))

    async def _call(self, fn):
        """Run `fn(engine)` on the engine's thread between steps; its result."""
        if self.dead:
            raise EngineDeadError(self.dead)
        future = self.loop.create_future()
        self.calls.add(future)

        def run(engine):
            try:
                result = fn(engine)
            except Exception as exc:  # noqa: BLE001 - handed to the caller
                self.loop.call_soon_threadsafe(_settle, future, None, exc)
            else:
                self.loop.call_soon_threadsafe(_settle, future, result, None)

        self.commands.put(run)
        try:
            return await future
        finally:
            self.calls.discard(future)

    in_process = True  # load_weights takes tensors

    async def load_weights(self, tensors: dict, timeout: float) -> None:
        # In process: the tensors themselves, no copy through bytes.
        await self._call(lambda engine: engine.collective_rpc(
            "rollout_load_tensors", timeout=timeout, args=(list(tensors.items()),)))

    async def reset_prefix_cache(self) -> None:
        # Running requests (none in an update, which runs alone) would be preempted.
        _check_reset(await self._call(lambda engine: engine.reset_prefix_cache(True)))

    async def release(self, level: int) -> None:
        with _counted_across_clear(self.mm_counts):
            await self._call(lambda engine: engine.sleep(level=level))

    def mm_cache_counts(self) -> tuple[int, int] | None:
        return self.mm_counts and self.mm_counts.read()

    async def resume(self, tags: list[str]) -> None:
        await self._call(lambda engine: engine.wake_up(tags=tags))

    async def close(self) -> None:
        if self.thread is not None and self.thread.is_alive() and not self.dead:
            self.commands.put(None)
            await asyncio.to_thread(self.thread.join, 60)
        if self.engine is not None:
            self.engine.engine_core.shutdown()
            self.engine = None


class _Outputs:
    """One request's outputs (or its error) as the engine's thread hands them over; its
    generator waits here. Outputs that pile up while it is busy are taken together."""

    __slots__ = ("items", "waiter", "sent")

    def __init__(self):
        self.items: list = []
        self.waiter: asyncio.Future | None = None
        self.sent = False  # handed to the engine's thread

    def put(self, item) -> None:
        self.items.append(item)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def take(self, loop: asyncio.AbstractEventLoop) -> list:
        while not self.items:
            self.waiter = loop.create_future()
            await self.waiter
        items, self.items = self.items, []
        for item in items:
            if isinstance(item, BaseException):
                raise item
        return items


def _chunks(outputs: list, k: int | None) -> list[Chunk]:
    """A chunk per sample from delta RequestOutputs (several merged when they piled up),
    with vLLM's count of the prompt tokens it found in its prefix cache."""
    cached = outputs[-1].num_cached_tokens
    if len(outputs) == 1:  # the usual case: one step's output
        return [Chunk(o.index, o.token_ids, _chosen(o.token_ids, o.logprobs) if k is not None
                      else None, _top(o.logprobs, k) if k else None,
                      _finish(o.finish_reason, o.index), cached_tokens=cached)
                for o in outputs[0].outputs]
    merged: dict[int, list] = {}
    for output in outputs:
        for o in output.outputs:
            m = merged.setdefault(o.index, [[], [], [], None])
            m[0] += o.token_ids
            if k is not None:
                m[1] += _chosen(o.token_ids, o.logprobs)
            if k:
                m[2] += _top(o.logprobs, k)
            m[3] = _finish(o.finish_reason, o.index) or m[3]
    return [Chunk(i, tokens, logprobs if k is not None else None, top if k else None, finish,
                  cached_tokens=cached)
            for i, (tokens, logprobs, top, finish) in merged.items()]


def _chosen(token_ids, logprobs) -> list[float]:
    return [float(step[t].logprob) for t, step in zip(token_ids, logprobs)]


def _top(logprobs, k: int) -> list[tuple[TokenLogprob, ...]]:
    # vLLM adds the chosen token to each position's top k, wherever it ranks.
    return [tuple(TokenLogprob(t, lp) for t, lp in sorted(
        ((int(t), float(x.logprob)) for t, x in step.items() if x.rank <= k),
        key=lambda pair: -pair[1])[:k]) for step in logprobs]


def _check_reset(success) -> None:
    """vLLM answers False where blocks are still held; KV made under the old weights could
    then be read under the new ones."""
    if success is False:
        raise GenerationError("vLLM did not reset its prefix cache after a weight update")


def _settle(future: asyncio.Future, result, exception) -> None:
    if not future.done():
        if exception is not None:
            future.set_exception(exception)
        else:
            future.set_result(result)


# vLLM's engine core outlives a process killed without close() (only its workers watch
# their parent). This watchdog gets SIGTERM when this process ends (die_with_parent) and
# passes it on to the core's processes (its arguments); it exits once one of them is gone.
WATCHDOG = """trap 'kill -TERM "$@" 2>/dev/null; exit' TERM
while kill -0 "$@" 2>/dev/null; do sleep 1 & wait $!; done"""


class MMCacheCounts:
    """(hits, lookups) of vLLM's multimodal processor cache in this process, cumulative since
    the engine started. Read with `make_stats()` without `delta`, which resets nothing (vLLM's
    stats logger owns the deltas). vLLM zeroes the counts when it clears the cache (on sleep),
    so the counts read last before a clear go into `base`; `release` reads around it."""

    def __init__(self, cache):
        self.cache = cache
        self.lock = threading.Lock()  # read from any thread
        self.base = self.last = (0, 0)

    @classmethod
    def of(cls, renderer) -> MMCacheCounts | None:
        cache = renderer.mm_processor_cache  # None: a text model, or the cache turned off
        return None if cache is None else cls(cache)

    def read(self) -> tuple[int, int]:
        with self.lock:
            info = self.cache.make_stats()
            if info.total < self.last[1]:  # cleared since the last read
                self.base = (self.base[0] + self.last[0], self.base[1] + self.last[1])
            self.last = (info.hits, info.total)
            return self.base[0] + info.hits, self.base[1] + info.total


@contextmanager
def _counted_across_clear(counts: MMCacheCounts | None):
    """Read just before and after a call that may clear the cache (no request runs then):
    the counts before it are kept, and the clear is seen before any new lookup."""
    if counts is not None:
        counts.read()
    try:
        yield
    finally:
        if counts is not None:
            counts.read()


class AsyncEngine:
    """vLLM's AsyncLLM, as its own OpenAI server runs it: the engine core (scheduler and
    model) in a child process, spoken to over ZMQ, and only request intake and output
    processing in this process, on the engine loop. The core then never waits for the GIL
    that this process's HTTP handling and the rollout core hold."""

    def __init__(self, engine_args: dict, stream_interval: int = 1):
        self.engine_args = engine_args
        self.stream_interval = stream_interval
        self.engine = None
        self.creating: asyncio.Future | None = None
        self.watchdog: subprocess.Popen | None = None
        self.mm_counts: MMCacheCounts | None = None

    async def start(self) -> None:
        # Built on a worker thread: it blocks while the core process loads (30-75 s on
        # CPU), and the engine loop keeps serving other backends meanwhile. AsyncLLM made
        # outside a running loop starts its tasks on first use, which is on the engine loop.
        self.creating = asyncio.ensure_future(asyncio.to_thread(self._create))
        await asyncio.shield(self.creating)
        self.mm_counts = MMCacheCounts.of(self.engine.renderer)  # images render here
        pids = [str(p.pid) for p in self._core_processes()]
        if pids:
            # Started from the engine loop's thread, which lives as long as the process (the
            # signal comes when the thread that started it ends); prctl is all it runs there.
            self.watchdog = subprocess.Popen(  # noqa: ASYNC220
                ["sh", "-c", WATCHDOG, "sh", *pids], stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                preexec_fn=die_with_parent_hook())  # noqa: PLW1509

    def _create(self) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM

        # vLLM's defaults for offline batches (those of `vllm.LLM`: on CPU 256 running
        # sequences and 4096 batched tokens, where its server takes 128 and 2048), as in
        # engine mode: rollouts are batch work. No stats and no request logs, as `vllm.LLM`.
        context = UsageContext.LLM_CLASS
        config = AsyncEngineArgs(**self.engine_args).create_engine_config(context)
        # Kept here, not returned: a returned engine stays referenced from the thread's
        # future and frame, and would outlive close().
        self.engine = AsyncLLM.from_vllm_config(config, usage_context=context,
                                                disable_log_stats=True)

    def _core_processes(self) -> list:
        """The engine core's processes (none where vLLM did not start them here)."""
        manager = getattr(self.engine.engine_core.resources, "engine_manager", None)
        return list(getattr(manager, "processes", ()))

    def _dead(self) -> EngineDeadError:
        """EngineDeadError saying how the core's process ended, where it has."""
        how = ", ".join(f"{p.name} (pid {p.pid}) exited with code {p.exitcode}"
                        for p in self._core_processes() if p.exitcode is not None)
        return EngineDeadError(f"vLLM's engine core died ({how or 'see its log'})")

    def _check(self) -> None:
        if self.engine.errored:
            raise self._dead()

    def model_config(self):
        return self.engine.model_config

    async def generate(self, rid: str, prompt: dict, params: dict) -> AsyncIterator[Chunk]:
        from vllm.inputs import tokens_input

        self._check()
        sampling = sampling_params(params, self.stream_interval)
        k = params.get("logprobs")
        # Tokens alone as a rendered token input: vLLM takes it on this thread. A prompt with
        # images goes through vLLM's renderer (its thread pool), which processes them.
        rendered = prompt if "multi_modal_data" in prompt else \
            tokens_input(prompt["prompt_token_ids"])
        outputs = self.engine.generate(rendered, sampling, rid)
        finished = False
        try:
            # Closing vLLM's generator (GeneratorExit) or cancelling it aborts the request.
            async with aclosing(outputs):
                async for output in outputs:
                    finished = output.finished
                    for chunk in _chunks([output], k):
                        yield chunk
        except Exception as exc:  # noqa: BLE001 - sorted: dead engine or this request's error
            raise self._error(exc) from None
        finally:
            if not finished and self.engine is not None and not self.engine.errored:
                # Also stops a request whose add was still being sent when it was cancelled
                # (vLLM's generator aborts only once the add returned); a no-op otherwise.
                await self.engine.abort(rid)

    def _error(self, exc: Exception) -> Exception:
        from vllm.v1.engine.exceptions import EngineDeadError as Dead
        from vllm.v1.engine.exceptions import EngineGenerateError

        # A core that has exited is a dead engine, also before vLLM has marked it errored
        # (a request's error can come first on a loaded machine).
        if isinstance(exc, Dead) or self.engine.errored or any(
                p.exitcode is not None for p in self._core_processes()):
            return self._dead()
        if isinstance(exc, EngineGenerateError) and isinstance(exc.__cause__, Exception):
            exc = exc.__cause__  # what vLLM raised on taking the request
        return _refusal(exc)

    async def _call(self, method: str, *args, **kwargs):
        """One of AsyncLLM's calls to the core; EngineDeadError if the core died."""
        self._check()
        try:
            return await getattr(self.engine, method)(*args, **kwargs)
        except Exception:
            if self.engine.errored:
                raise self._dead() from None
            raise

    in_process = False  # load_weights takes a shared-memory message

    async def load_weights(self, message: dict, timeout: float) -> None:
        # vLLM's own bound too: a worker stuck on a call fails it instead of holding it.
        await self._call("collective_rpc", "rollout_receive_shm", timeout=timeout,
                         args=(message,))

    async def reset_prefix_cache(self) -> None:
        _check_reset(await self._call("reset_prefix_cache", True))

    async def release(self, level: int) -> None:
        with _counted_across_clear(self.mm_counts):
            await self._call("sleep", level)

    def mm_cache_counts(self) -> tuple[int, int] | None:
        return self.mm_counts and self.mm_counts.read()

    async def resume(self, tags: list[str]) -> None:
        await self._call("wake_up", tags)

    async def close(self) -> None:
        if self.creating is not None and not self.creating.done():
            # Start timed out: wait for the engine it was making, to stop that too.
            with suppress(BaseException):
                await asyncio.wait_for(asyncio.shield(self.creating), 600)
        if self.engine is not None:
            # Stopped first, its output handler does not log the core's exit as a failure.
            if self.engine.output_handler is not None:
                self.engine.output_handler.cancel()
            # Joins the core's process (SIGTERM, then SIGKILL): off the loop, whose sockets
            # vLLM closes from there.
            await asyncio.to_thread(self.engine.shutdown, 30)
            self.engine = None
        if self.watchdog is not None:
            self.watchdog.terminate()  # the core is gone: its SIGTERM reaches no one
            await asyncio.to_thread(self.watchdog.wait, 10)
            self.watchdog = None


class ServerEngine:
    """vLLM's OpenAI server in a child process. Every call fails within about a second of
    the server dying, with the end of its log."""

    def __init__(self, engine_args: dict, startup_timeout: float, request_timeout: float,
                 stream_interval: int):
        self.engine_args = engine_args
        self.startup_timeout = startup_timeout
        self.request_timeout = request_timeout
        self.stream_interval = stream_interval  # tokens per streamed event
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.process: ServerProcess | None = None
        self.session = None
        self.watch: asyncio.Task | None = None
        self.encoded = EncodedImages()  # each image's data: URL, for every later turn

    def argv(self) -> list[str]:
        # Structured settings (e.g. structured_outputs_config) go as JSON, as vLLM's CLI reads them.
        args = {k: json.dumps(v) if isinstance(v, (dict, list)) else v
                for k, v in self.engine_args.items()}
        argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                "--model", args.pop("model"), "--host", HOST, "--port", str(self.port),
                "--served-model-name", SERVED_NAME, "--enable-prompt-tokens-details"]
        return argv + cli_flags(args)

    async def start(self) -> None:
        # Dev mode adds the routes for weight RPCs, sleep and prefix-cache resets. Started
        # from the engine loop's thread, which lives as long as the process: the server
        # gets SIGTERM when it ends.
        self.process = ServerProcess("vllm", self.argv(), env={"VLLM_SERVER_DEV_MODE": "1"},
                                     die_with_parent=True)
        await asyncio.to_thread(self.process.wait_healthy, f"{self.url}/health",
                                self.startup_timeout)
        self.session = client_session(reuse_connections=False)
        self.watch = asyncio.ensure_future(self._watch())

    async def _watch(self) -> None:
        """The guard: once the server has exited, close every connection, so that each call
        still waiting (for headers or for tokens) fails now and finds out why."""
        while self.process.alive():
            await asyncio.sleep(0.5)
        await self.session.close()

    async def _failure(self, exc: BaseException, path: str) -> RolloutError:
        """The error for a call whose connection failed: EngineDeadError with the server's
        log if it died (a dying process takes a moment to exit), else GenerationError."""
        for _ in range(10):
            if not self.process.alive():
                break
            await asyncio.sleep(0.1)
        try:
            self.process.check()
        except EngineDeadError as dead:
            return dead
        return GenerationError(f"vLLM server call {path} failed: {exc!r}")

    async def _call(self, path: str, body: dict | None = None, timeout: float | None = None):
        """POST and return the JSON answer."""
        import aiohttp

        self.process.check()
        try:
            async with self.session.post(
                self.url + path, json=body or {},
                timeout=aiohttp.ClientTimeout(total=timeout or self.request_timeout),
            ) as response:
                return await _json(response, path)
        except RolloutError:
            raise
        except (aiohttp.ClientError, OSError, RuntimeError) as exc:  # RuntimeError: closed
            raise await self._failure(exc, path) from None

    def model_config(self):
        return None  # in the server's process

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

    async def generate(self, rid: str, prompt: dict, params: dict) -> AsyncIterator[Chunk]:
        """Streamed as the server makes tokens: token ids alone to /v1/completions, token
        ids with images to /inference/v1/generate (/v1/completions takes no images with
        ids). Cancelling closes the connection, which makes the server abort the request
        (an abort sent by id could reach a busy server after the request has finished, or
        before it has started)."""
        import aiohttp

        self.process.check()
        if "multi_modal_data" in prompt:
            path, parse = "/inference/v1/generate", _generate_chunks
            body = await _generate_body(rid, prompt, params, self.encoded)
        else:
            path, parse = "/v1/completions", _sse_chunks
            body = {"model": SERVED_NAME, "prompt": prompt["prompt_token_ids"],
                    "request_id": rid, "return_token_ids": True,
                    "return_tokens_as_token_ids": True,
                    "stream": True, "stream_interval": self.stream_interval,
                    # The last event's usage says how many prompt tokens were cached.
                    "stream_options": {"include_usage": True},
                    **{k: v for k, v in params.items() if v is not None}}
        k = params.get("logprobs")
        try:
            async with self.session.post(
                self.url + path, json=body,
                timeout=aiohttp.ClientTimeout(total=self.request_timeout),
            ) as response:
                if response.status != 200:
                    await _json(response, path)
                ending: list[Chunk] = []  # samples' last chunks, held for the cached count
                async for line in lines(response.content):
                    if line.startswith(b"data: {"):
                        event = json.loads(line[6:])
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
                for chunk in ending:  # (no usage came)
                    yield chunk
        except RolloutError:
            raise
        except (aiohttp.ClientError, OSError, RuntimeError) as exc:  # RuntimeError: closed
            raise await self._failure(exc, path) from None

    in_process = False  # load_weights takes a shared-memory message

    async def load_weights(self, message: dict, timeout: float) -> None:
        # Only the JSON message goes over HTTP; the bytes are in shared memory. vLLM bounds
        # the call on its side too.
        await self._call("/collective_rpc", {"method": "rollout_receive_shm",
                                             "args": [message], "timeout": timeout},
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

    async def reset_prefix_cache(self) -> None:
        answer = await self._call("/reset_prefix_cache?reset_running_requests=true",
                                  timeout=60)
        _check_reset(answer.get("success") if isinstance(answer, dict) else answer)

    async def release(self, level: int) -> None:
        await self._call(f"/sleep?level={level}", timeout=300)

    async def resume(self, tags: list[str]) -> None:
        await self._call("/wake_up?" + "&".join(f"tags={t}" for t in tags), timeout=300)

    async def close(self) -> None:
        if self.watch is not None:
            self.watch.cancel()
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
        finish = _finish(choice.get("finish_reason"), i)
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


async def _generate_body(rid: str, prompt: dict, params: dict, encoded: EncodedImages
                         ) -> dict:
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
    return {"model": SERVED_NAME, "request_id": rid, "token_ids": prompt["prompt_token_ids"],
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
