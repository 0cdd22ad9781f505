"""The two ways the backend reaches SGLang, behind one interface (rollout_sglang.engine):

- `InProcessEngine`: `sglang.Engine` created in this process; its tokenizer manager runs
  on the engine loop (`rollout.kit.aio.engine_loop()`), where the core runs requests, so a
  token goes from SGLang to the caller without a hop between threads;
- `ServerEngine`: `sglang.launch_server` as a child process on loopback
  (`rollout.kit.child_server`), spoken to with SGLang's native HTTP API through aiohttp,
  also on the engine loop.

Both take the bodies built in `rollout_sglang.protocol`. `stream()` yields one sample's
outputs as SGLang makes them; closing it (or cancelling its reader) aborts the sample in
SGLang. `run()` waits, from another thread, for a coroutine on the engine loop with a
timeout, and fails within about a second once the engine is dead.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import signal
import sys
import threading
import time
import weakref

from rollout import EngineDeadError, GenerationError, RolloutError, RolloutTimeoutError
from rollout.kit.aio import Lines, engine_loop
from rollout.kit.child_server import ChildServer
from rollout.kit.images import EncodedImages
from rollout.kit.process import HOST, ServerProcess, cli_flags

from rollout_sglang import protocol
from rollout_sglang.coalesce import coalesce_requests

POLL_S = 0.25
# A sample that is stopped: how long to wait for what SGLang made and held back (one step);
# after it, what was handed over is what the caller gets.
END_TIMEOUT_S = 10
# Without it SGLang returns logprobs divided by the temperature; the contract wants raw ones.
ENGINE_ENV = {"SGLANG_RETURN_ORIGINAL_LOGPROB": "1"}
# Stream outputs carry the new tokens only (protocol.parse_delta reads them so): otherwise
# every output repeats the whole sample so far, logprobs included, which costs O(n^2).
STREAM_ARGS = {"incremental_streaming_output": True}


def wait(loop, coro, timeout: float, what: str, check) -> object:
    """Run `coro` on `loop`; raise RolloutTimeoutError after `timeout` s, and whatever
    `check()` raises (the engine died) within POLL_S of it happening."""
    try:
        check()
    except BaseException:
        coro.close()  # never started; closing it avoids a "never awaited" warning
        raise
    future = asyncio.run_coroutine_threadsafe(coro, loop)
    deadline = time.monotonic() + timeout
    while True:
        try:
            return future.result(POLL_S)
        except concurrent.futures.TimeoutError:
            pass
        try:
            check()
        except BaseException:
            future.cancel()
            raise
        if time.monotonic() > deadline:
            future.cancel()
            raise RolloutTimeoutError(f"{what} did not finish within {timeout:.0f} s")


# --- in process -------------------------------------------------------------------------

_LIVE: weakref.WeakSet = weakref.WeakSet()
_handler_installed = False


def _on_sigquit(signum, frame) -> None:
    # SGLang's scheduler signals its parent when it fails. Its default handler kills the
    # whole process tree, the trainer included; ours marks the engines dead instead.
    for engine in list(_LIVE):
        engine.die("SGLang's scheduler failed and sent SIGQUIT (its traceback is in this "
                   "process's stderr); create a new backend")


_closing_engine = threading.local()  # .children: the engine's processes, while it closes


def _kill_only_engine_children(original):
    """SGLang's Engine.shutdown SIGKILLs every child of this process: in a trainer, its data
    loader workers, torch's shared-memory manager (then a shared tensor's release aborts
    the process) and the other engines. While one of ours closes, only its own die."""

    def kill_process_tree(parent_pid, include_parent=True, **kwargs):
        children = getattr(_closing_engine, "children", None)
        if children is None or include_parent or parent_pid != os.getpid():
            return original(parent_pid, include_parent=include_parent, **kwargs)
        for pid in children:
            original(pid, include_parent=True, **kwargs)

    return kill_process_tree


def _install_sigquit_handler() -> None:
    global _handler_installed
    if not _handler_installed and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGQUIT, _on_sigquit)
        _handler_installed = True


class InProcessEngine:
    """sglang.Engine in this process. It is created on a thread of its own that then waits
    until close: SGLang's subprocesses die with the thread that started them (their
    PR_SET_PDEATHSIG), and created off the main thread, SGLang installs no signal handler
    of its own, so a scheduler failure does not kill this process (the backend must then
    be created from the main thread for our handler to be installed).

    SGLang's tokenizer manager runs its receive loop on the event loop of its first call:
    every call is made on the engine loop, so that loop is SGLang's."""

    def __init__(self, engine_args: dict, startup_timeout: float):
        self.engine_args = {**engine_args, **STREAM_ARGS}
        self.startup_timeout = startup_timeout
        self.llm = None
        self.loop = engine_loop().loop
        self.dead: str | None = None
        self._thread: threading.Thread | None = None
        self._closing = threading.Event()
        self._waiting: set[asyncio.Task] = set()  # tasks waiting on SGLang
        self._children: list[int] = []  # the processes sglang.Engine started

    def start(self) -> None:
        os.environ.update(ENGINE_ENV)  # read by the scheduler process SGLang spawns
        _install_sigquit_handler()
        ready, failure = threading.Event(), []

        def main():
            try:
                import psutil
                import sglang
                import sglang.srt.entrypoints.engine as sglang_engine

                if not hasattr(sglang_engine.kill_process_tree, "__wrapped__"):
                    wrapped = _kill_only_engine_children(sglang_engine.kill_process_tree)
                    wrapped.__wrapped__ = sglang_engine.kill_process_tree
                    sglang_engine.kill_process_tree = wrapped
                asyncio.set_event_loop(self.loop)  # Engine.loop: not a loop of its own
                before = {child.pid for child in psutil.Process().children()}
                self.llm = sglang.Engine(**self.engine_args)
                coalesce_requests(self.llm.tokenizer_manager, self.loop)
                self._children = [child.pid for child in psutil.Process().children()
                                  if child.pid not in before]
            except BaseException as exc:  # noqa: BLE001 - handed to the starting thread
                failure.append(exc)
                return
            finally:
                ready.set()
            self._closing.wait()

        self._thread = threading.Thread(target=main, name="rollout-sglang", daemon=True)
        self._thread.start()
        if not ready.wait(self.startup_timeout):
            raise RolloutTimeoutError(
                f"sglang.Engine did not start within {self.startup_timeout:.0f} s")
        if failure:
            raise EngineDeadError(f"sglang.Engine failed to start: {failure[0]!r}") from failure[0]
        _LIVE.add(self)

    def check(self) -> None:
        if self.dead:
            raise EngineDeadError(self.dead)

    def die(self, why: str) -> None:
        """From any thread (a signal handler): fail what waits on the engine."""
        self.dead = why

        def wake():
            for task in list(self._waiting):
                task.cancel()

        self.loop.call_soon_threadsafe(wake)

    @contextlib.contextmanager
    def _dies_with_engine(self):
        """Nothing wakes a task waiting on a dead SGLang: `die()` cancels it, and it raises
        EngineDeadError instead."""
        self.check()
        task = asyncio.current_task()
        self._waiting.add(task)
        try:
            yield
        except asyncio.CancelledError:
            if self.dead is None:
                raise
            task.uncancel()
            raise EngineDeadError(self.dead) from None
        finally:
            self._waiting.discard(task)

    def run(self, coro, timeout: float, what: str):
        return wait(self.loop, coro, timeout, what, self.check)

    @property
    def _tm(self):
        return self.llm.tokenizer_manager

    async def max_input_tokens(self) -> int:
        return int(self._tm.max_req_input_len)

    @staticmethod
    def image_data(images) -> list:
        """A prompt's images (rollout.kit.images.PromptImage) as `image_data`: SGLang takes
        PIL images in process, with no copy or encoding."""
        return [im.image for im in images]

    def image_stats(self) -> dict[str, int] | None:
        """SGLang's image preprocessing cache counters, read from its tokenizer manager in
        this process (cumulative; a cache flush keeps them); None with the cache off, where
        SGLang processes every image and counts none."""
        llm = self.llm  # None once closed, from another thread
        processor = getattr(llm.tokenizer_manager, "mm_processor", None) if llm else None
        cache = getattr(processor, "mm_preprocess_cache", None)
        if cache is None or not cache.enabled:
            return None
        counts = cache.stats()
        # A miss that joins another request's run on the same image waits for its result.
        joined = counts["singleflight_joins"]
        return {"images_processed": counts["misses"] - joined,
                "image_cache_hits": counts["hits"] + joined}

    async def stream(self, body: dict):
        """The sample's outputs. Cancelled or closed, SGLang's generator aborts the request
        itself, whether the scheduler has it yet or not (it is handed over synchronously,
        and marked as handed over, in one step)."""
        with self._dies_with_engine():
            try:
                async for out in self._request(body):
                    yield out
            except ValueError as exc:  # SGLang's request validation
                raise protocol.engine_error(str(exc)) from None
            except asyncio.CancelledError:
                # An abort, or a "keep" update that continues the sample later: first what
                # SGLang made and did not hand over yet, so that no token is lost or made
                # again. SGLang's generator has asked the scheduler to abort the request,
                # which answers with those tokens; its state waits for that answer.
                state = self._tm.rid_to_state.get(body["rid"])
                if state is not None and self.dead is None:
                    for out in await _held_back_in(state):
                        yield out
                raise

    async def generate(self, body: dict) -> dict:
        """One answer, for a body without streaming."""
        with self._dies_with_engine():
            try:
                return await anext(self._request(body))
            except ValueError as exc:
                raise protocol.engine_error(str(exc)) from None

    def _request(self, body: dict):
        """SGLang's answers to the body, from its tokenizer manager as
        `Engine.async_generate` asks for them, with every field of GenerateReqInput (the
        engine's method takes fewer: no return_sampling_mask)."""
        request = protocol.struct("generate")(**body)
        return self.llm.tokenizer_manager.generate_request(request, None)

    async def _call(self, name: str, method, body: dict):
        result = await method(protocol.struct(name)(**body), None)
        if isinstance(result, tuple) and not result[0]:
            raise GenerationError(f"SGLang {name} failed: {result[1]}")
        return result

    async def begin_update(self) -> None:
        await self._call("begin_weight_update", self._tm.begin_weight_update, {})

    async def update_tensors(self, group: list) -> None:
        from rollout_sglang.weights import serialize

        # The scheduler is this process's child: tensors travel as file descriptors.
        body = protocol.update_tensor_body(serialize(group, as_text=False))
        await self._call("update_weights_from_tensor", self._tm.update_weights_from_tensor, body)

    async def end_update(self) -> None:
        await self._call("end_weight_update", self._tm.end_weight_update, {})

    async def pause(self) -> None:
        await self._tm.pause_generation(protocol.struct("pause_generation")(
            **protocol.PAUSE_IN_PLACE))

    async def go_on(self) -> None:
        await self._tm.continue_generation(protocol.struct("continue_generation")(
            **protocol.GO_ON))

    async def name_weights(self, updates: int) -> None:
        await self._tm.update_weight_version(protocol.struct("update_weight_version")(
            **protocol.weights_named(updates)))

    async def abort_all(self) -> None:
        self._tm.abort_request(abort_all=True)

    async def load_adapter(self, name: str, rank: int, scale: float, modules: list[str],
                           tensors: dict) -> None:
        from rollout_sglang.weights import flattened, serialize

        # The scheduler is this process's child: the buffer travels as a file descriptor.
        body = protocol.adapter_body(name, rank, scale, modules,
                                     serialize(flattened(tensors), as_text=False))
        await self._lora_call("load_lora_adapter_from_tensors", body)

    async def unload_adapter(self, name: str) -> None:
        await self._lora_call("unload_lora_adapter", {"lora_name": name})

    async def _lora_call(self, name: str, body: dict) -> None:
        result = await getattr(self._tm, name)(protocol.struct(name)(**body), None)
        if not result.success:
            raise GenerationError(f"SGLang {name} failed: {result.error_message}")

    async def update_from_disk(self, path: str) -> None:
        await self._call("update_weights_from_disk", self._tm.update_weights_from_disk,
                         protocol.update_disk_body(path))

    async def flush_cache(self) -> bool:
        return bool((await self._tm.flush_cache()).success)

    async def release(self, tags: list[str]) -> None:
        await self._call("release", self._tm.release_memory_occupation, {"tags": tags})

    async def resume(self, tags: list[str]) -> None:
        await self._call("resume", self._tm.resume_memory_occupation, {"tags": tags})

    def close(self) -> None:
        _LIVE.discard(self)
        llm, self.llm = self.llm, None
        try:
            if llm is not None:
                _closing_engine.children = self._children
                try:
                    llm.shutdown()
                finally:
                    _closing_engine.children = None
                tasks = list(getattr(llm.tokenizer_manager, "asyncio_tasks", ()))
                if tasks and self.loop.is_running():
                    # Its receive loop would otherwise wait on the engine loop forever.
                    async def cancel():
                        for task in tasks:
                            task.cancel()
                        await asyncio.wait(tasks, timeout=5)

                    asyncio.run_coroutine_threadsafe(cancel(), self.loop).result(10)
        finally:
            self._closing.set()
            if self._thread is not None:
                self._thread.join(30)


async def _held_back_in(state) -> list[dict]:
    """The outputs that SGLang's scheduler sends for an aborted request (its `ReqState`),
    as `_unfinished`; none if they do not come within END_TIMEOUT_S."""
    try:
        async with asyncio.timeout(END_TIMEOUT_S):
            while not state.finished:
                await state.event.wait()
                state.event.clear()
    except TimeoutError:
        return []
    outs, state.out_list = state.out_list, []
    return _unfinished(outs)


# --- HTTP server ------------------------------------------------------------------------

async def _outputs(lines: Lines):
    """The outputs of SGLang's server-sent events, to its [DONE]; ConnectionError if the
    stream ends without it."""
    async for line in lines:
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return
        out = json.loads(data)
        if "error" in out:  # SGLang's validation, sent as an event
            raise protocol.engine_error(_message(out))
        yield out
    raise ConnectionError("the stream ended without [DONE]")


class ServerEngine:
    """SGLang's HTTP server, started by us as a child process on 127.0.0.1.

    Weight updates send SGLang's tensor payload, which is pickle (SGLang unpickles it with an
    allow-list, but it is still pickle). This engine only ever sends it to the server it
    started itself on the loopback address; there is deliberately no way to point it at a
    user-supplied URL.
    """

    def __init__(self, engine_args: dict, startup_timeout: float, request_timeout: float):
        self.engine_args = {**engine_args, **STREAM_ARGS}
        self.startup_timeout = startup_timeout
        self.request_timeout = request_timeout
        self.server = ChildServer("sglang")
        self.url = self.server.url
        self.loop = engine_loop().loop
        self.encoded = EncodedImages()  # each image's data: URL, for every later turn

    @property
    def process(self) -> ServerProcess | None:
        return self.server.process

    def argv(self) -> list[str]:
        args = dict(self.engine_args)
        argv = [sys.executable, "-m", "sglang.launch_server", "--model-path",
                args.pop("model_path"), "--host", HOST, "--port", str(self.server.port)]
        # Dict-valued arguments (mm_process_config) are JSON on SGLang's command line.
        return argv + cli_flags({key: json.dumps(value) if isinstance(value, dict) else value
                                 for key, value in args.items()})

    def start(self) -> None:
        # On the engine loop, whose thread lives as long as the process (the server dies
        # with it). The server's readiness wait is bounded by itself; the margin covers
        # launching it and opening the session.
        self.run(self.server.start(self.argv(), ENGINE_ENV, self.startup_timeout),
                 self.startup_timeout + 90, "starting SGLang's server")

    def check(self) -> None:
        self.server.check()

    def run(self, coro, timeout: float, what: str):
        return wait(self.loop, coro, timeout, what, self.check)

    async def _once(self, path: str, body: dict | None, timeout: float):
        import aiohttp

        async with self.server.session.post(
                self.url + path, json=body if body is not None else {},
                timeout=aiohttp.ClientTimeout(total=timeout)) as response:
            return response.status, _json(await response.text())

    async def _call(self, path: str, body: dict | None = None, timeout: float | None = None,
                    retries: int = 0):
        """POST and return the answer. Connection errors are retried `retries` times with
        backoff (only idempotent calls pass retries); a dead server raises EngineDeadError."""
        import aiohttp

        for attempt in range(retries + 1):
            self.check()
            try:
                status, data = await self._once(path, body, timeout or self.request_timeout)
                break
            except aiohttp.ClientConnectionError as exc:
                if attempt == retries:
                    raise await self.server.failure(exc, "SGLang server call") from None
                await asyncio.sleep(0.25 * 2**attempt)
        return _answer(path, status, data)

    def image_data(self, images) -> list:
        """A prompt's images as `image_data` over HTTP: PNG data: URLs (lossless, so SGLang
        decodes the very pixels the core loaded), each encoded once for all later turns."""
        return [self.encoded.url(im) for im in images]

    @staticmethod
    def image_stats() -> None:
        """The server's image cache counters are not exposed over HTTP (SGLang 0.5.23)."""

    async def max_input_tokens(self) -> int:
        import aiohttp

        async with self.server.session.get(self.url + "/server_info",
                                           timeout=aiohttp.ClientTimeout(total=60)) as response:
            return int((await response.json(content_type=None))["max_req_input_len"])

    async def stream(self, body: dict):
        """The sample's outputs, from SGLang's server-sent events. Closing the connection
        (this generator closed or its reader cancelled) makes SGLang abort the request, at
        whatever stage it is: its streaming response is cancelled on the disconnect."""
        import aiohttp

        self.check()
        try:
            async with self.server.session.post(
                    self.url + "/generate", json=body,
                    timeout=aiohttp.ClientTimeout(total=None, sock_read=self.request_timeout)
            ) as response:
                if response.status != 200:
                    _answer("/generate", response.status, _json(await response.text()))
                lines = Lines(response.content)  # read on after a cancellation
                started = False
                try:
                    async for out in _outputs(lines):
                        started = True
                        yield out
                except asyncio.CancelledError:
                    # As in process (InProcessEngine.stream), once the server holds the
                    # request (before, closing the connection aborts it).
                    if started:
                        for out in await self._held_back(body["rid"], lines):
                            yield out
                    raise
        except (aiohttp.ClientError, ConnectionError) as exc:
            raise await self.server.failure(exc, "SGLang server call") from None

    async def _held_back(self, rid: str, lines: Lines) -> list[dict]:
        """Abort a request and read the rest of its stream: what SGLang made and held
        back, which its abort sends; none if it does not come within END_TIMEOUT_S."""
        import aiohttp

        try:
            async with asyncio.timeout(END_TIMEOUT_S):
                await self._call("/abort_request", {"rid": rid})
                return _unfinished([out async for out in _outputs(lines)])
        except (TimeoutError, ConnectionError, aiohttp.ClientError, RolloutError):
            return []

    async def generate(self, body: dict) -> dict:
        """One answer, for a body without streaming."""
        return await self._call("/generate", body)

    async def begin_update(self) -> None:
        await self._call("/begin_weight_update", {}, timeout=60)

    async def update_tensors(self, group: list) -> None:
        from rollout_sglang.weights import serialize

        # The server is not our child: tensors travel as named files (serialize).
        body = protocol.update_tensor_body(serialize(group, as_text=True))
        await self._call("/update_weights_from_tensor", body)  # `group` stays alive until here

    async def end_update(self) -> None:
        await self._call("/end_weight_update", {}, timeout=60)

    async def pause(self) -> None:
        await self._call("/pause_generation", protocol.PAUSE_IN_PLACE, timeout=60)

    async def go_on(self) -> None:
        await self._call("/continue_generation", protocol.GO_ON, timeout=60)

    async def name_weights(self, updates: int) -> None:
        await self._call("/update_weight_version", protocol.weights_named(updates), timeout=60)

    async def abort_all(self) -> None:
        await self._call("/abort_request", {"abort_all": True}, timeout=60)

    async def load_adapter(self, name: str, rank: int, scale: float, modules: list[str],
                           tensors: dict) -> None:
        from rollout_sglang.weights import flattened, serialize

        await self._call("/load_lora_adapter_from_tensors", protocol.adapter_body(
            name, rank, scale, modules, serialize(flattened(tensors), as_text=True)))

    async def unload_adapter(self, name: str) -> None:
        await self._call("/unload_lora_adapter", {"lora_name": name})

    async def init_group(self, body: dict, timeout: float) -> None:
        """Join the update group; answers once the trainer has joined too."""
        await self._call("/init_weights_update_group", body, timeout=timeout)

    async def update_distributed(self, body: dict) -> None:
        """Receive one announced group of tensors by broadcast, and load it."""
        await self._call("/update_weights_from_distributed", body)

    async def destroy_group(self, name: str) -> None:
        await self._call("/destroy_weights_update_group", {"group_name": name}, timeout=10)

    async def update_from_disk(self, path: str) -> None:
        await self._call("/update_weights_from_disk", protocol.update_disk_body(path))

    async def flush_cache(self) -> bool:
        try:
            await self._call("/flush_cache", None, timeout=60, retries=2)
        except GenerationError:
            return False
        return True

    async def release(self, tags: list[str]) -> None:
        await self._call("/release_memory_occupation", {"tags": tags}, timeout=300)

    async def resume(self, tags: list[str]) -> None:
        await self._call("/resume_memory_occupation", {"tags": tags}, timeout=300)

    def close(self) -> None:
        try:
            if self.loop.is_running():
                asyncio.run_coroutine_threadsafe(self.server.close_session(),
                                                 self.loop).result(10)
        finally:
            self.server.stop()


def _json(text: str):
    try:
        return json.loads(text) if text else None
    except ValueError:
        return text


def _answer(path: str, status: int, data):
    if status == 400:
        raise protocol.engine_error(_message(data))
    if status != 200:
        raise GenerationError(f"SGLang server answered {status} on {path}: {data}")
    if isinstance(data, dict) and data.get("success") is False:
        raise GenerationError(f"SGLang {path} failed: {data.get('message')}")
    return data


def _message(data) -> str:
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict):
            return str(error.get("message", error))
        return str(error or data.get("message") or data.get("error_message") or data)
    return str(data)


def _unfinished(outs: list[dict]) -> list[dict]:
    """The outputs SGLang sends as it aborts a request, their finish taken off (the caller
    stops the sample, and may go on from it); those with no token dropped."""
    return [{**out, "meta_info": {**out["meta_info"], "finish_reason": None}}
            for out in outs if out.get("output_ids")]
