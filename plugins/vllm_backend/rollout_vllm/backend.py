"""VLLMBackend: the rollout contract over vLLM, in process (`mode="engine"`), through
AsyncLLM with its engine core in a child process (`mode="async"`), or over its
OpenAI-compatible server in a child process (`mode="server"`)."""

from __future__ import annotations

import contextlib
import itertools
import math
import re
from collections.abc import Iterable, Iterator
from contextlib import aclosing

import rollout
from rollout import (Capabilities, EngineDeadError, GenerationError, InvalidRequestError,
                     RolloutError)
from rollout.kit import options
from rollout.kit.aio import engine_loop
from rollout.kit.process import check_nice, niced_children
from rollout.weights.buckets import DEFAULT_BUCKET_BYTES, Bucket, iter_unpacked
from rollout.weights.lora import linear_modules, no_such_adapter, read_adapter
from rollout.weights.checkpoint import checked_tensors, checkpoint_shapes
from rollout.kit.prompts import PromptEncoder
from rollout.contract.schemas import (LOGPROBS_MODES, PROMPT_LOGPROBS_MAX, SamplingParams,
                                      StructuredOutputs)
from rollout.kit.structured import constraint_error, structural_tag_grammar

from rollout_vllm.async_engine import AsyncEngine
from rollout_vllm.common import private_socket_folder
from rollout_vllm.cpu import cpu_engine_args, cpu_thread_binding, engine_threads
from rollout_vllm.engine import AdapterEngine, Engine, WeightPath
from rollout_vllm.in_process import InProcessEngine
from rollout_vllm.kept import KeptRequest
from rollout_vllm.lora import lora_request
from rollout_vllm.server_engine import ServerEngine
from rollout_vllm.transport import ENGINE_NAME, TRANSPORTS, GlooSender, ShmPipeline

MODES = ("engine", "async", "server")
# Vision-language model types whose prompts take images here: vLLM expands each image's one
# placeholder (the collapsed form the core sends) to its run of tokens, and greedy tokens
# were checked against the HF backend's (tests/test_images.py).
VISION_MODEL_TYPES = ("qwen2_vl",)
SHM_GROUP_BYTES = 64 * 2**20  # the default weight_group_bytes through shared memory
DEFAULT_MAX_LORA_RANK = 16  # vLLM's
ADAPTERS_OFF = ("vLLM reserves its LoRA slots when it starts: pass engine_args "
                "enable_lora=True (and max_lora_rank, max_loras) to load adapters")


def sleep_unsupported_reason() -> str | None:
    from vllm.platforms import current_platform

    if current_platform.is_sleep_mode_available():
        return None
    return (f"vLLM has no sleep mode on {type(current_platform).__name__} "
            "(its sleep() returns without freeing anything)")


# Structured outputs through xgrammar (one grammar dialect on every backend) and compact
# JSON: with any whitespace allowed, a random model loops on it. `engine_args` may override.
STRUCTURED_OUTPUTS_CONFIG = {"backend": "xgrammar", "disable_any_whitespace": True}


def vllm_sampling(s: SamplingParams) -> dict:
    """vLLM's SamplingParams fields (the same names in its /v1/completions body). vLLM's own
    order and formulas are docs/sampling.md's: logprobs come from the logits after the
    grammar mask and before bias, min_tokens, penalties and temperature (Sampler.forward)."""
    return {"n": s.n, "temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k or 0,
            "max_tokens": s.max_tokens, "stop": list(s.stop) or None,
            "stop_token_ids": list(s.stop_token_ids) or None, "seed": s.seed,
            "logprobs": s.logprobs, "ignore_eos": s.ignore_eos,
            "repetition_penalty": s.repetition_penalty, "presence_penalty": s.presence_penalty,
            "frequency_penalty": s.frequency_penalty, "min_p": s.min_p,
            "min_tokens": s.min_tokens, "logit_bias": dict(s.logit_bias) or None,
            "include_stop_str_in_output": s.include_stop_str_in_output,
            "structured_outputs": structured_outputs(s.structured_outputs),
            "prompt_logprobs": s.prompt_logprobs}


def structured_outputs(so: StructuredOutputs | None) -> dict | None:
    """vLLM's StructuredOutputsParams as a dict; None without a constraint."""
    if so is None:
        return None
    if so.grammar is not None and not _has_ebnf_rule(so.grammar):
        # vLLM reads a grammar without a `::=` rule as Lark, a dialect the other backends
        # do not read: refused here, as xgrammar's EBNF parser would refuse it.
        raise InvalidRequestError("sampling.structured_outputs.grammar",
                                  "no rule (`name ::= ...`) in the grammar",
                                  "EBNF in the GBNF dialect that xgrammar reads")
    if so.structural_tag is not None:
        # As EBNF with compact JSON: vLLM's own structural-tag path lets JSON take any
        # whitespace, on which a weak model loops.
        return {"grammar": structural_tag_grammar(so.structural_tag)}
    value = {"json": so.json, "choice": list(so.choice) if so.choice else None,
             "regex": so.regex, "grammar": so.grammar}[so.kind]
    return {so.kind: value}


def _has_ebnf_rule(grammar: str) -> bool:
    return any("::=" in re.sub(r"(#|//).*$", "", line) for line in grammar.split("\n"))


def checked_options(mode: str, weight_transport: str | None, stream_interval,
                    logprobs_mode, nice, engine_args: dict | None) -> tuple[str, dict]:
    """The backend's options checked (InvalidRequestError naming the field), before anything
    loads: the weight transport (the mode's default where none is given) and engine_args,
    with vLLM's name for the logprobs mode in them."""
    if logprobs_mode not in LOGPROBS_MODES:
        raise InvalidRequestError("logprobs_mode", f"got {logprobs_mode!r}",
                                  ", ".join(LOGPROBS_MODES))
    if engine_args and "logprobs_mode" in engine_args:  # (the one place it is set)
        raise InvalidRequestError("engine_args.logprobs_mode", "set by the backend option",
                                  "logprobs_mode=" + " or ".join(LOGPROBS_MODES))
    if mode not in MODES:
        raise InvalidRequestError("mode", f"got {mode!r}", ", ".join(MODES))
    if weight_transport is None:
        # gloo in server mode: it needs no shared host, and it is as fast as shm for a
        # 327 MiB model on this machine (bench/bench_weight_sync.py).
        weight_transport = "gloo" if mode == "server" else "shm"
    if weight_transport not in TRANSPORTS or (weight_transport != "shm" and mode != "server"):
        raise InvalidRequestError("weight_transport", f"got {weight_transport!r}",
                                  "'shm', or in server mode 'gloo'")
    if not isinstance(stream_interval, int) or stream_interval < 1:
        raise InvalidRequestError("stream_interval", f"got {stream_interval!r}",
                                  "an integer >= 1")
    check_nice(nice)
    return weight_transport, {**options.engine_args(engine_args, "vLLM"),
                              "logprobs_mode": f"{logprobs_mode}_logprobs"}


def engine_arguments(model: str, mode: str, dtype: str, max_model_len: int,
                     enforce_eager: bool, weight_transport: str, vision: bool,
                     sleep_mode: bool, engine_args: dict) -> dict:
    """vLLM's engine arguments: the caller's `engine_args` over the backend's settings."""
    # vLLM refuses (prompt) logprobs over this: the contract's most.
    engine_args.setdefault("max_logprobs", PROMPT_LOGPROBS_MAX)
    if vision:
        # Images only (the contract has no video): vLLM then profiles and budgets no video
        # item, and never loads the video processor.
        engine_args.setdefault("limit_mm_per_prompt", {"video": 0})
        if mode == "server":
            # Image requests go to /inference/v1/generate, one of the scale-out routes,
            # with one top logprob more than asked (ServerEngine says why).
            engine_args.setdefault("enable_scale_out", True)
            engine_args.setdefault("max_logprobs", 21)
    if weight_transport == "gloo":  # vLLM's weight-transfer routes, into our engine
        engine_args.setdefault("weight_transfer_config", {"backend": ENGINE_NAME})
    structured = engine_args.pop("structured_outputs_config", None)
    return {"model": model, "dtype": dtype, "max_model_len": max_model_len,
            "enforce_eager": enforce_eager, "worker_extension_cls": _extension(),
            "enable_sleep_mode": sleep_mode,
            "structured_outputs_config": {**STRUCTURED_OUTPUTS_CONFIG, **(structured or {})}
            if structured is None or isinstance(structured, dict) else structured,
            **cpu_engine_args(engine_args)}


SERVER_KEEP_KV = ("vLLM's OpenAI server says which weights made each token only on its "
                  "scale-out route (/inference/v1/generate), not on /v1/completions, which "
                  "text requests take; mode='engine' or 'async' offer it")
# What vLLM's sampling masks, routed experts and trace replay need; absent from the CPU
# build.
RUNNER_V2 = ("vLLM's Model Runner V2, which needs Triton: the CPU build refuses it ('Model "
             "Runner V2 requires Triton'; no Triton with a CPU backend is on PyPI)")


class VLLMBackend:
    def __init__(self, model: str, mode: str = "engine", dtype: str = "auto",
                 max_model_len: int | None = None, enforce_eager: bool = False,
                 engine_args: dict | None = None, startup_timeout: float = 600.0,
                 request_timeout: float = 3600.0, weight_group_bytes: int | None = None,
                 stream_interval: int = 16, weight_transport: str | None = None,
                 weight_group_timeout: float = 300.0, logprobs_mode: str = "raw",
                 nice: int = 0):
        weight_transport, engine_args = checked_options(mode, weight_transport,
                                                        stream_interval, logprobs_mode,
                                                        nice, engine_args)
        self.logprobs_mode = logprobs_mode  # vLLM's is fixed at start
        self.mode = mode
        # Weight updates made (each chunk is stamped with it: Chunk.weight_update), begun,
        # and failed midway.
        self.updates = self._began = self._failed = 0
        from transformers import AutoConfig, AutoTokenizer

        config = AutoConfig.from_pretrained(model)
        text_config = config.get_text_config()  # a vision-language model's language part
        self.max_model_len = max_model_len or text_config.max_position_embeddings
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        self.shapes = checkpoint_shapes(model)
        # Smaller groups through shared memory: packing one overlaps the worker's reload of
        # the one before (bench/bench_weight_sync.py), and the two files stay small.
        self.weight_group_bytes = weight_group_bytes or (
            SHM_GROUP_BYTES if weight_transport == "shm" and mode != "engine"
            else DEFAULT_BUCKET_BYTES)
        self.sleep_reason = sleep_unsupported_reason()
        args = engine_arguments(model, mode, dtype, self.max_model_len, enforce_eager,
                                weight_transport, config.model_type in VISION_MODEL_TYPES,
                                self.sleep_reason is None, engine_args)
        self.request_timeout = request_timeout
        self.stream_interval = stream_interval
        self.calls = itertools.count()  # numbers each engine call's id
        self._start(args, startup_timeout, weight_transport, weight_group_timeout, nice)
        self.images_reason = _images_reason(config, mode, self.engine.model_config())
        # Adapters in every mode, where vLLM reserved its LoRA slots at the start.
        self.adapters_reason = None if args.get("enable_lora") else ADAPTERS_OFF
        self.max_lora_rank = args.get("max_lora_rank", DEFAULT_MAX_LORA_RANK)
        self.lora_ids: dict[str, int] = {}  # adapter name -> the vLLM LoRA id it is under
        self._new_lora_id = itertools.count(1)  # a new one per load: vLLM's caches key on it
        self.prompts = PromptEncoder(
            self.tokenizer, text_config.vocab_size, self.max_model_len,
            image_token_id=None if self.images_reason else config.image_token_id)

    def _start(self, args: dict, startup_timeout: float, weight_transport: str,
               weight_group_timeout: float, nice: int) -> None:
        private_socket_folder()
        cpu_thread_binding()
        self.engine: Engine = (
            InProcessEngine(args, self.stream_interval) if self.mode == "engine" else
            AsyncEngine(args, self.stream_interval) if self.mode == "async" else
            ServerEngine(args, startup_timeout, self.request_timeout, self.stream_interval))
        # The engine's asyncio side lives on the loop the core runs requests on: no hop
        # between loops per token.
        self.loop = engine_loop()
        # Chosen here, once: every update takes this path, whatever the engine.
        self.weights: WeightPath = self.engine.weight_path(
            weight_transport, self.loop, self.request_timeout, weight_group_timeout)
        try:
            parameters = sum(math.prod(shape) for shape in self.shapes.values())
            # (None: no safetensors to count)
            with engine_threads(parameters or None), niced_children(nice):
                self.loop.run(self.engine.start(), startup_timeout, "starting vLLM")
            if nice:
                self.engine.yield_cores()
        except BaseException:
            self.loop.run(self.engine.close(), 60, "stopping vLLM")
            raise

    @property
    def shm(self) -> ShmPipeline | None:
        """The weight path, where it is shared memory (its two files)."""
        return self.weights if isinstance(self.weights, ShmPipeline) else None

    @property
    def gloo(self) -> GlooSender | None:
        """The weight path, where it is a gloo group."""
        return self.weights if isinstance(self.weights, GlooSender) else None

    @classmethod
    def describe_capabilities(cls, sleep_reason: str | None = None,
                              images_reason: str | None = None,
                              adapters_reason: str | None = ADAPTERS_OFF,
                              logprobs_mode: str = "raw",
                              keep_kv_reason: str | None = None) -> Capabilities:
        # images: with a Qwen2-VL model; adapters: with enable_lora; keep_kv: but in server
        # mode (the instance says).
        unsupported = {"images": images_reason} if images_reason else {}
        unsupported["sampling_mask"] = (
            f"vLLM returns it only from {RUNNER_V2}, started with return_sampling_mask and "
            "processed logprobs")
        unsupported["routed_experts"] = (
            f"vLLM returns them only from {RUNNER_V2}, started with "
            "enable_return_routed_experts; the HF backend returns them")
        unsupported["trace_replay"] = (
            f"vLLM replays a trace (trace_decode_token_ids) only in {RUNNER_V2}; the HF "
            "backend replays them")
        unsupported["batch_invariant"] = (
            "vLLM's batch invariance (VLLM_BATCH_INVARIANT) is a mode of the whole engine "
            "made of Triton kernels for GPUs, which rollout does not start; the HF backend "
            "runs such a request alone")
        if keep_kv_reason:
            unsupported["keep_kv"] = keep_kv_reason
        for other in set(LOGPROBS_MODES) - {logprobs_mode}:
            unsupported[f"logprobs_mode.{other}"] = (
                f"vLLM fixes its logprobs mode at start; this one was started with "
                f"logprobs_mode={logprobs_mode} (the backend option)")
        if adapters_reason:
            unsupported["adapters"] = adapters_reason
        reason = sleep_reason or sleep_unsupported_reason()
        if reason:
            unsupported["release"] = reason
        return Capabilities(unsupported=unsupported, logprobs_mode=logprobs_mode)

    @rollout.hookimpl
    def capabilities(self) -> Capabilities:
        return self.describe_capabilities(self.sleep_reason, self.images_reason,
                                          self.adapters_reason, self.logprobs_mode,
                                          SERVER_KEEP_KV if self.mode == "server" else None)

    @rollout.hookimpl
    def prompt_encoder(self) -> PromptEncoder:
        return self.prompts

    @rollout.hookimpl
    def stats(self) -> dict[str, int] | None:
        # vLLM's multimodal processor cache, keyed by our image ids: a lookup that misses
        # runs the image processor.
        counts = None if self.images_reason else self.engine.mm_cache_counts()
        if counts is None:
            return None
        hits, lookups = counts
        return {"images_processed": lookups - hits, "image_cache_hits": hits}

    # --- generation ---------------------------------------------------------------------

    @rollout.hookimpl
    async def generate(self, request, prompt_token_ids, streaming, images):
        s = request.sampling
        # Unique per call: two calls may share our id, and vLLM takes a duplicate silently.
        rid = f"{request.id}-{next(self.calls)}"
        began, failed = self._began, self._failed
        kept = KeptRequest(self.updates)
        try:
            # Token by token for a caller that streams; else `stream_interval` tokens a piece,
            # which costs vLLM less per token.
            params = {**vllm_sampling(s), "stream_interval": 1 if streaming
                      else self.stream_interval}
            prompt = _prompt(prompt_token_ids, images, str(self.updates))
            lora = None if request.adapter is None else self._lora_request(request.adapter)
            async with aclosing(self.engine.generate(rid, prompt, params, lora)) as items:
                async for item in items:
                    if self._failed != failed:  # (leaving the stream stops it in vLLM)
                        raise GenerationError("a weight update failed midway beside this "
                                              "request, and its weights are half new")
                    for chunk in kept.take(item, self._began != began):
                        yield chunk
        except EngineDeadError:
            raise
        except RolloutError as exc:
            raise constraint_error(exc, s.structured_outputs) from None

    # --- weights and memory (from the trainer's thread, never the engine loop) ----------

    @rollout.hookimpl
    def update_weights(self, buckets):
        """With the scheduler held between two steps: requests running beside a "keep_kv"
        update keep their place and KV cache, and vLLM says which weights made each of their
        tokens (named by the number of updates made). A failure midway fails them (the
        weights are half new), and the core refuses requests until a full update succeeds.
        No prefix-cache reset: each request is salted by the updates made (`_prompt`), so
        none reuses what older weights cached, and vLLM evicts that as it needs the room."""
        self._began += 1  # before the hold: a sample that sees it waits for vLLM's spans
        self.loop.run(self.engine.pause(), 60, "vLLM pause_generation")
        try:
            # Groups are made here, on the trainer's thread (it runs the trainer's
            # iterator); the engine loop only carries each group's call. Every wait is
            # bounded.
            self.weights.update(layer_groups(buckets, self.shapes, self.weight_group_bytes))
            self.loop.run(self.engine.name_weights(str(self.updates + 1)), 60,
                          "vLLM update_weight_version")
            self.updates += 1
        except BaseException:
            self._failed += 1
            with contextlib.suppress(Exception):  # the first error is the one to report
                self.loop.run(self.engine.go_on(), 60, "vLLM resume_generation")
            raise
        self.loop.run(self.engine.go_on(), 60, "vLLM resume_generation")

    # --- LoRA adapters (with enable_lora) -------------------------------------------------

    def _lora_request(self, name: str):
        lora_id = self.lora_ids.get(name)
        if lora_id is None:  # vLLM would look for it on disk, and its engine die of that
            raise no_such_adapter(name, self.lora_ids)
        return lora_request(name, lora_id)

    @rollout.hookimpl
    def load_adapter(self, name, config, buckets):
        adapter = read_adapter(config, iter_unpacked(buckets), linear_modules(self.shapes),
                               self.max_lora_rank)
        tensors = adapter.peft_tensors()
        # What vLLM's PEFTHelper reads (the core passed a plain config: JSON's types).
        peft_config = {"r": adapter.rank, "lora_alpha": config.get("lora_alpha", adapter.rank),
                       "use_rslora": bool(config.get("use_rslora")),
                       "target_modules": adapter.target_modules()}
        engine: AdapterEngine = self.engine
        lora_id = next(self._new_lora_id)
        self.loop.run(engine.load_adapter(lora_request(name, lora_id), peft_config,
                                          tensors, self.request_timeout),
                      self.request_timeout + 60, "vLLM adapter load")
        replaced = self.lora_ids.get(name)
        self.lora_ids[name] = lora_id
        if replaced is not None:
            self.loop.run(engine.unload_adapter(lora_request(name, replaced),
                                                self.request_timeout),
                          self.request_timeout + 60, "vLLM adapter unload")

    @rollout.hookimpl
    def unload_adapter(self, name):
        lora = lora_request(name, self.lora_ids.pop(name))
        self.loop.run(self.engine.unload_adapter(lora, self.request_timeout),
                      self.request_timeout + 60, "vLLM adapter unload")

    @rollout.hookimpl
    def release(self, tags):
        # vLLM's level 1 offloads weights to host memory and drops the KV cache.
        self.loop.run(self.engine.release(1), 600, "vLLM sleep")
        if "weights" not in tags:
            self.loop.run(self.engine.resume(["weights"]), 600, "vLLM wake-up")

    @rollout.hookimpl
    def resume(self, tags):
        self.loop.run(self.engine.resume(list(tags)), 600, "vLLM wake-up")

    @rollout.hookimpl
    def close(self):
        self.weights.close()  # a gloo group: the server leaves it too, bounded
        self.loop.run(self.engine.close(), 120, "stopping vLLM")


def _images_reason(config, mode: str, model_config) -> str | None:
    """Why this backend's prompts cannot take images; None where they can."""
    if config.model_type not in VISION_MODEL_TYPES:
        return (f"a text-only model here (model type {config.model_type!r}); images need a "
                f"vision-language model of type {', '.join(VISION_MODEL_TYPES)}")
    if mode == "server":
        return None  # the server's model config is in its process; a refusal comes per request
    if model_config is None or not model_config.is_multimodal_model:
        return "vLLM did not load this model as a vision-language model"
    return None


def _prompt(prompt_token_ids: list[int], images, salt: str) -> dict:
    """vLLM's prompt: token ids with one placeholder per image (vLLM expands each to the
    image's run), the images with their content hashes (vLLM caches processed images, and
    their encoder outputs, under these ids), and `salt` for its prefix cache: each weights'
    prefixes apart, since requests kept beside a "keep_kv" update go on caching prefixes
    the old weights made."""
    prompt = {"prompt_token_ids": prompt_token_ids, "cache_salt": salt}
    if images:
        prompt["multi_modal_data"] = {"image": [im.image for im in images]}
        prompt["multi_modal_uuids"] = {"image": [im.id for im in images]}
    return prompt


def _extension() -> str:
    from rollout_vllm.worker import WeightUpdateExtension

    return f"{WeightUpdateExtension.__module__}.{WeightUpdateExtension.__qualname__}"


# --- weights into vLLM ------------------------------------------------------------------
# vLLM fuses q/k/v and gate/up projections, and one reload call must carry every piece of a
# fused parameter: split across calls, the weights come out wrong with no error. So tensors
# are regrouped by decoder layer, after the checkpoint's checks.

LAYER = re.compile(r"^(.*?\blayers\.\d+)\.")


def _group_of(name: str) -> str:
    match = LAYER.match(name)
    return match.group(1) if match else name


def layer_groups(buckets: Iterable[Bucket], shapes: dict[str, tuple[int, ...]],
                 max_bytes: int) -> Iterator[dict]:
    """Checked tensors regrouped so that no decoder layer is split between two groups;
    groups are merged up to about `max_bytes`."""
    group: dict = {}
    size, last = 0, None
    for name, tensor in checked_tensors(buckets, shapes):
        key = _group_of(name)
        if group and key != last and size >= max_bytes:
            yield group
            group, size = {}, 0
        group[name] = tensor.contiguous()
        size += tensor.numel() * tensor.element_size()
        last = key
    if group:
        yield group
