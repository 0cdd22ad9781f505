"""`InProcessEngine`: vLLM's LLMEngine with its engine core in this process, stepped by a
thread of ours, as `vllm.LLM` does, so that concurrent requests share continuous batching.
Its weight updates go in as the tensors themselves (`TensorPath`)."""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Iterable

from rollout import Chunk, EngineDeadError
from rollout.kit.aio import LoopThread

from rollout_vllm.common import (
    END_TIMEOUT_S,
    MMCacheCounts,
    chunks,
    counted_across_clear,
    refusal,
    sampling_params,
    unfinished,
)
from rollout_vllm.engine import Spans


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
        self.held = False  # no step while a weight update loads (the engine's thread's)

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
            while self._run_commands(block=self.held or not engine.has_unfinished_requests()):
                if not self.held and engine.has_unfinished_requests():
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
        for rid, prompt, sampling, lora in adds:
            try:
                # vLLM's renderer runs here, on this thread (for images: its processor).
                engine.add_request(rid, prompt, sampling, lora_request=lora)
            except Exception as exc:  # noqa: BLE001 - handed to that request's generator
                refused.append((rid, refusal(exc)))
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
        for rid, *_ in adds:
            self.streams[rid].sent = True
        if adds:
            self.commands.put(lambda engine: self._add_all(engine, adds))

    def model_config(self):
        return self.engine.model_config

    def yield_cores(self) -> None:
        # vLLM's reader spins for a second after each read of the worker's outputs
        # (shm_broadcast.SpinCondition, sched_yield in a loop): it would hold a core, and
        # the GIL, beside a trainer in this process, and starve a niced worker.
        for queue_ in self.engine.engine_core.engine_core.model_executor.response_mqs:
            queue_._spin_condition.busy_loop_s = 0

    async def generate(self, rid: str, prompt: dict, params: dict,
                       lora=None) -> AsyncIterator[Chunk | Spans]:
        if self.dead:
            raise EngineDeadError(self.dead)
        sampling = sampling_params(params, self.stream_interval)
        stream = self.streams[rid] = _Outputs()
        self.adds.append((rid, prompt, sampling, lora))
        if len(self.adds) == 1:
            # Sent once this loop iteration is over, with every request that came in it: the
            # engine then schedules them together instead of stepping on a trickle.
            self.loop.call_soon(self._send_adds)
        k, scores = params.get("logprobs"), params.get("prompt_logprobs")
        finished = False
        try:
            while not finished:
                outputs = await stream.take(self.loop)
                finished = outputs[-1].finished
                for chunk in chunks(outputs, k, scores):
                    if isinstance(chunk, Chunk) and chunk.prompt_logprobs is not None:
                        scores = None  # (each of n samples' outputs may repeat them)
                    yield chunk
        except asyncio.CancelledError:
            if not stream.sent or self.dead:
                raise
            # An abort, or a "keep" update that continues the request later: first what
            # vLLM made and did not hand over yet, so that no token is lost or made again.
            tail = await self._end(rid)
            finished = True
            for chunk in unfinished(chunks(stream.drain() + tail, k, scores)):
                yield chunk
            raise
        finally:
            del self.streams[rid]
            if not finished and stream.sent and not self.dead:
                # The command queue is FIFO: this comes after the add, registered or not.
                self.commands.put(lambda engine: engine.abort_request([rid]))

    async def _end(self, rid: str) -> list:
        """End request `rid` in the engine; the outputs of what vLLM made for it and held
        back (up to `stream_interval` - 1 tokens a sample). Bounded: the command waits for
        the step that runs, or for a weight load."""
        def end(engine):
            from vllm.v1.engine import FinishReason

            processor = engine.output_processor
            states = [processor.request_states.get(i)
                      for i in processor.external_req_ids.get(rid, ())]
            try:
                held_back = [state.make_request_output([], None, FinishReason.ABORT, None)
                             for state in states if state is not None]
            finally:
                engine.abort_request([rid])
            return [output for output in held_back if output is not None]

        try:
            # Queued at once: the engine's thread runs it before any command that comes
            # after the cancellation.
            return await asyncio.wait_for(self._submit(end), END_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - too slow, or a dead engine: what was handed
            return []      # over stands

    async def _call(self, fn):
        """Run `fn(engine)` on the engine's thread between steps; its result."""
        return await self._submit(fn)

    def _submit(self, fn) -> asyncio.Future:
        """Queue `fn(engine)` for the engine's thread now (commands run in the order they
        came); the future of its result."""
        if self.dead:
            raise EngineDeadError(self.dead)
        future = self.loop.create_future()
        self.calls.add(future)
        future.add_done_callback(self.calls.discard)

        def run(engine):
            try:
                result = fn(engine)
            except Exception as exc:  # noqa: BLE001 - handed to the caller
                self.loop.call_soon_threadsafe(_settle, future, None, exc)
            else:
                self.loop.call_soon_threadsafe(_settle, future, result, None)

        self.commands.put(run)
        return future

    def weight_path(self, transport: str, loop: LoopThread, timeout: float,
                    group_timeout: float) -> TensorPath:
        # The worker is in this process: no transport to choose (the backend allows "shm",
        # its default, and nothing goes through shared memory).
        return TensorPath(self, loop, timeout)

    async def load_tensors(self, tensors: dict, timeout: float) -> None:
        # In process: the tensors themselves, no copy through bytes.
        await self._call(lambda engine: engine.collective_rpc(
            "rollout_load_tensors", timeout=timeout, args=(list(tensors.items()),)))

    async def load_adapter(self, lora, config: dict, tensors: dict, timeout: float) -> None:
        # In process: copies of the tensors (the caller's may be views it reuses), no bytes.
        owned = {name: t.clone() for name, t in tensors.items()}
        await self._call(lambda engine: engine.collective_rpc(
            "rollout_load_adapter_tensors", timeout=timeout,
            args=(lora.lora_int_id, config, owned)))

    async def unload_adapter(self, lora, timeout: float) -> None:
        await self._call(lambda engine: engine.collective_rpc(
            "rollout_unload_adapter", timeout=timeout, args=(lora.lora_int_id,)))

    async def pause(self) -> None:
        # Commands run between steps on the engine's thread: no step runs until go_on.
        await self._call(lambda engine: setattr(self, "held", True))

    async def go_on(self) -> None:
        await self._call(lambda engine: setattr(self, "held", False))

    async def name_weights(self, name: str) -> None:
        await self._call(lambda engine: engine.set_weight_version(name))

    async def release(self, level: int) -> None:
        with counted_across_clear(self.mm_counts):
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


class TensorPath:
    """Weight updates into an `InProcessEngine`: one call per group, on the engine loop."""

    def __init__(self, engine: InProcessEngine, loop: LoopThread, timeout: float):
        self.engine, self.loop, self.timeout = engine, loop, timeout

    def update(self, groups: Iterable[dict]) -> None:
        for group in groups:
            self.loop.run(self.engine.load_tensors(group, self.timeout), self.timeout + 60,
                          "vLLM weight update")

    def close(self) -> None:
        pass  # nothing is held between updates


class _Outputs:
    """One request's outputs (or its error) as the engine's thread hands them over; its
    generator waits here. Outputs that pile up while it is busy are taken together."""

    __slots__ = ("items", "waiter", "sent")

    def __init__(self):
        self.items: list = []
        self.waiter: asyncio.Future | None = None
        self.sent = False  # handed to the engine's thread

    def drain(self) -> list:
        """The outputs that came and were not taken (its error left out)."""
        items, self.items = self.items, []
        return [item for item in items if not isinstance(item, BaseException)]

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


def _settle(future: asyncio.Future, result, exception) -> None:
    if not future.done():
        if exception is not None:
            future.set_exception(exception)
        else:
            future.set_result(result)
