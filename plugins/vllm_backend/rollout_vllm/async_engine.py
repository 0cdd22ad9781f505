"""`AsyncEngine`: vLLM's AsyncLLM, its engine core in a child process (ZMQ) and its output
processing in this one, as vLLM's own server runs it. Its weight updates go through shared
memory (`rollout_vllm.transport.ShmPipeline`)."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import AsyncIterator
from contextlib import suppress

from rollout import Chunk, EngineDeadError
from rollout.kit.aio import LoopThread
from rollout.kit.process import children, die_with_parent_hook

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
from rollout_vllm.transport import ShmPipeline

# vLLM's engine core outlives a process killed without close() (only its workers watch
# their parent). This watchdog gets SIGTERM when this process ends (die_with_parent) and
# passes it on to the core and its workers (its arguments); any still there after
# WATCHDOG_GRACE_S get SIGKILL, since vLLM's own shutdown waits on its workers for seconds
# more on a loaded machine. Running, it exits once one of them is gone.
WATCHDOG_GRACE_S = 5
WATCHDOG = f"""alive() {{ for p; do kill -0 "$p" 2>/dev/null && return 0; done; return 1; }}
end() {{ kill -TERM "$@" 2>/dev/null; n=0
  while alive "$@" && [ $n -lt {WATCHDOG_GRACE_S * 10} ]; do sleep 0.1; n=$((n+1)); done
  kill -KILL "$@" 2>/dev/null; exit; }}
trap 'end "$@"' TERM
while kill -0 "$@" 2>/dev/null; do sleep 1 & wait $!; done"""


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
        pids = [str(pid) for p in self._core_processes() for pid in (p.pid, *children(p.pid))]
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

    def yield_cores(self) -> None:
        pass  # its outputs come to this process through a socket: no spin here

    async def generate(self, rid: str, prompt: dict, params: dict,
                       lora=None) -> AsyncIterator[Chunk | Spans]:
        from vllm.inputs import tokens_input

        self._check()
        sampling = sampling_params(params, self.stream_interval)
        k, scores = params.get("logprobs"), params.get("prompt_logprobs")
        # Tokens alone as a rendered token input: vLLM takes it on this thread. A prompt with
        # images goes through vLLM's renderer (its thread pool), which processes them.
        rendered = prompt if "multi_modal_data" in prompt else \
            tokens_input(prompt["prompt_token_ids"], cache_salt=prompt["cache_salt"])
        collector = None
        finished = False
        try:
            # vLLM's AsyncLLM.generate, with the collector of the request's outputs in hand.
            collector = await self.engine.add_request(rid, rendered, sampling,
                                                      lora_request=lora)
            while not finished:
                output = collector.get_nowait() or await collector.get()
                finished = output.finished
                for chunk in chunks([output], k, scores):
                    if isinstance(chunk, Chunk) and chunk.prompt_logprobs is not None:
                        scores = None  # (each of n samples' outputs repeats them)
                    yield chunk
        except asyncio.CancelledError:
            if collector is None or self.engine.errored:
                raise
            # An abort, or a "keep" update that continues the request later: first what
            # vLLM made and did not hand over yet, so that no token is lost or made again.
            finished = True
            for chunk in unfinished(await self._end(collector, k, scores)):
                yield chunk
            raise
        except Exception as exc:  # noqa: BLE001 - sorted: dead engine or this request's error
            raise self._error(exc) from None
        finally:
            if not finished and self.engine is not None and not self.engine.errored:
                # Also stops a request whose add was still being sent when it was cancelled;
                # a no-op after it ended.
                await self.engine.abort(rid)

    async def _end(self, collector, k: int | None, scores: int | None) -> list:
        """End the request in the engine; the chunks of what vLLM made for it and held back
        (up to `stream_interval` - 1 tokens a sample), which its abort puts in the
        request's collector."""
        try:
            await asyncio.wait_for(self.engine.abort(collector.request_id, internal=True),
                                   END_TIMEOUT_S)
            tail = collector.get_nowait()
        except Exception:  # noqa: BLE001 - a dead engine: what was handed over stands
            return []
        return chunks([tail], k, scores) if tail is not None else []

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
        return refusal(exc)

    async def _call(self, method: str, *args, **kwargs):
        """One of AsyncLLM's calls to the core; EngineDeadError if the core died."""
        self._check()
        try:
            return await getattr(self.engine, method)(*args, **kwargs)
        except Exception:
            if self.engine.errored:
                raise self._dead() from None
            raise

    def weight_path(self, transport: str, loop: LoopThread, timeout: float,
                    group_timeout: float) -> ShmPipeline:
        # The core is another process on this host: shared memory ("shm", the only
        # transport the backend allows here).
        return ShmPipeline(self, loop, timeout)

    async def load_weights(self, message: dict, timeout: float) -> None:
        # vLLM's own bound too: a worker stuck on a call fails it instead of holding it.
        await self._call("collective_rpc", "rollout_receive_shm", timeout=timeout,
                         args=(message,))

    async def load_adapter(self, lora, config: dict, tensors: dict, timeout: float) -> None:
        from safetensors.torch import save

        await self._call("collective_rpc", "rollout_load_adapter", timeout=timeout,
                         args=(lora.lora_int_id, config, save(tensors)))

    async def unload_adapter(self, lora, timeout: float) -> None:
        await self._call("collective_rpc", "rollout_unload_adapter", timeout=timeout,
                         args=(lora.lora_int_id,))

    async def pause(self) -> None:
        # "keep": the core's scheduler holds its requests where they are, KV cache and all.
        await self._call("pause_generation", mode="keep", clear_cache=False)

    async def go_on(self) -> None:
        await self._call("resume_generation")

    async def name_weights(self, name: str) -> None:
        await self._call("update_weight_version", name)

    async def release(self, level: int) -> None:
        with counted_across_clear(self.mm_counts):
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
