"""SGLangBackend: the rollout contract over SGLang, in process (`mode="engine"`) or over its
native HTTP server in a child process on loopback (`mode="server"`).

The core encodes prompts with this backend's PromptEncoder (vocabulary and context length
are checked there: SGLang crashes on an out-of-vocabulary token id instead of rejecting
it) and decodes texts. Each sample is one SGLang request, streamed; what SGLang cannot
stop by itself as the contract says (stop tokens with ignore_eos, stop strings with
min_tokens) is cut here as the tokens arrive.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
import uuid

import attrs

import rollout
from rollout import Capabilities, Chunk, GenerationError, InvalidRequestError, RolloutError
from rollout.weights.buckets import DEFAULT_BUCKET_BYTES, iter_unpacked
from rollout.weights.checkpoint import checkpoint_shapes
from rollout.weights.lora import linear_modules, no_such_adapter, read_adapter
from rollout.kit import options
from rollout.kit.process import check_nice, niced_children
from rollout.kit.prompts import PromptEncoder, prompt_field
from rollout.kit.structured import constraint_error
from rollout.kit.text import TextStream, first_stop
from rollout.kit.weight_spans import runs_of

from rollout_sglang import protocol
from rollout_sglang.engine import Engine
from rollout_sglang.engines import END_TIMEOUT_S, STREAM_ARGS, InProcessEngine, ServerEngine
from rollout_sglang.transport import TRANSPORTS, make_sender
from rollout_sglang.weights import checked_groups

MODES = ("engine", "server")
# Sampling masks and processed logprobs both come from SGLang's sampling mask, which it
# gives only without a custom logit processor, and which is its own set.
DRAWN_SET_UNSUPPORTED = {
    "drawn_set.penalties": "SGLang returns the set a token was drawn from only without a "
                           "custom logit processor, and the backend's penalties are one",
    "drawn_set.top_p_after_truncation": "SGLang keeps top_p of the whole distribution's "
                                        "mass, not of what top_k and min_p kept: the set it "
                                        "draws from is not docs/sampling.md's"}
DRAWN_SET_ALLOWED = ("with return_sampling_mask or processed logprobs at temperature > 0: "
                     "no penalties, and top_p 1 where top_k or min_p is set")
# Model types SGLang loads as vision-language models whose images this backend sends (and
# the tests check against the HF backend): Qwen2-VL.
VISION_MODEL_TYPES = ("qwen2_vl",)


# Structured outputs through xgrammar (the grammar dialect every backend reads), compact
# JSON (a random model otherwise loops on whitespace); `engine_args` may override.
ENGINE_DEFAULTS = {"grammar_backend": "xgrammar",
                   "constrained_json_disable_any_whitespace": True,
                   # The penalties (processors.py), which need each request's output up
                   # to date when they run: the overlap scheduler hands it one token late.
                   "enable_custom_logit_processor": True,
                   "disable_overlap_schedule": True,
                   # Tokens per stream output, where a request does not say (each does:
                   # see SGLangBackend.stream_interval).
                   "stream_interval": 1}


ADAPTERS_OFF = ("SGLang sets up its LoRA memory pool when it starts: pass engine_args "
                "enable_lora=True (and max_lora_rank, max_loras_per_batch) to load adapters")
DEFAULT_MAX_LORA_RANK = 16  # when engine_args do not say: vLLM's default too


def cpu_reasons(device: str) -> dict[str, str]:
    if device != "cpu":
        return {}
    return {
        "seed": "SGLang uses per-request seeds only with deterministic inference, which it "
                "refuses on CPU (no supported attention backend); sampling_seed is ignored",
        "release": "SGLang's memory saver is CUDA-only: on CPU release/resume free nothing, "
                   "and a release while a request runs crashes the scheduler",
    }


def lora_args(device: str, shapes: dict, engine_args: dict) -> dict:
    """SGLang's LoRA settings where `engine_args` enable it, under what they set: every
    linear layer of the model adaptable, and on CPU the one LoRA backend with no GPU
    kernel (torch_native). SGLang's LoRA layers pin host memory, which needs CUDA: where
    pinning fails, enable_lora is refused here rather than crash SGLang's scheduler."""
    if not engine_args.get("enable_lora"):
        return {}
    import importlib

    try:  # asked of torch as SGLang's LoRA layers see it
        importlib.import_module("sglang.srt.lora.layers").torch.empty(1, pin_memory=True)
    except RuntimeError as exc:
        raise InvalidRequestError(
            "engine_args.enable_lora", f"SGLang's LoRA layers pin host memory, which this "
            f"machine cannot ({exc})", "leave it out on a machine without CUDA") from None
    modules = sorted({name.rsplit(".", 1)[-1] for name in linear_modules(shapes)})
    return {"max_lora_rank": DEFAULT_MAX_LORA_RANK, "lora_target_modules": modules,
            **({"lora_backend": "torch_native"} if device == "cpu" else {})}


def vision_args(model: str, image_cache_mb: int) -> dict:
    """SGLang replaces a Qwen2-VL processor's pixel limits with its own (its get_processor
    sets `size` to 3136..1003520 pixels), so an image would become another grid, and
    another number of tokens, than the model's own image processor makes (the HF backend's,
    a trainer's). The model's limits go back to SGLang's processor with every image.

    SGLang's image preprocessing cache (keyed on the image's content) is off for Qwen2-VL
    unless sized: without it every turn of a trajectory runs the processor again on every
    earlier image."""
    from transformers import AutoImageProcessor

    size = AutoImageProcessor.from_pretrained(model).size
    limits = {"shortest_edge": size.shortest_edge, "longest_edge": size.longest_edge}
    return {"mm_process_config": {"image": {"size": limits}},
            "mm_preprocess_cache_size_mb": image_cache_mb}


def checked_options(mode: str, stream_interval, image_cache_mb, weight_transport: str | None,
                    nice, engine_args: dict | None) -> tuple[str, dict]:
    """The backend's options checked (InvalidRequestError naming the field), before anything
    loads: the weight transport (the mode's default where none is given) and engine_args."""
    if mode not in MODES:
        raise InvalidRequestError("mode", f"got {mode!r}", ", ".join(MODES))
    if isinstance(stream_interval, bool) or not isinstance(stream_interval, int) \
            or stream_interval < 1:
        raise InvalidRequestError("stream_interval", f"got {stream_interval!r}",
                                  "an integer >= 1")
    # SGLang's mm_preprocess_cache_size_mb: whole MiB
    if isinstance(image_cache_mb, bool) or not isinstance(image_cache_mb, int) \
            or image_cache_mb < 0:
        raise InvalidRequestError("image_cache_mb", f"got {image_cache_mb!r}",
                                  "a whole number of MiB >= 0 (0: no cache)")
    check_nice(nice)
    # The update group in server mode: measured 5x faster than a tensor payload there.
    weight_transport = weight_transport or ("gloo" if mode == "server" else "tensor")
    if weight_transport not in TRANSPORTS:
        raise InvalidRequestError("weight_transport", f"got {weight_transport!r}",
                                  ", ".join(TRANSPORTS))
    if weight_transport != "tensor" and mode != "server":
        raise InvalidRequestError(
            "weight_transport", f"{weight_transport!r} needs mode='server' (in process, "
            "tensors reach SGLang's scheduler as file descriptors, without a copy)",
            "'tensor' with mode='engine'")
    engine_args = options.engine_args(engine_args, "SGLang")
    for name, value in STREAM_ARGS.items():  # set by the engines, never silently undone
        if engine_args.get(name, value) != value:
            raise InvalidRequestError(
                f"engine_args.{name}", f"got {engine_args[name]!r}: the backend reads "
                "SGLang's stream outputs as new tokens only", f"{value!r}, or leave it out")
    if "stream_interval" in engine_args:  # SGLang's default, which no request takes
        raise InvalidRequestError(
            "engine_args.stream_interval", "every request gives its own (1 to a caller "
            "that streams)", "the backend option stream_interval")
    return weight_transport, engine_args


def engine_arguments(model: str, device: str, dtype: str, max_total_tokens: int,
                     random_seed: int, shapes: dict, image_cache_mb: int | None,
                     vocab_size: int, moe: bool, engine_args: dict) -> dict:
    """SGLang's engine arguments: the backend's settings (a vision model's too, where
    `image_cache_mb` is given), with the caller's `engine_args` over them."""
    return {**lora_args(device, shapes, engine_args),
            "model_path": model, "device": device, "dtype": dtype,
            # A sampling mask may hold every token: top_k unset is sent as the vocabulary.
            "sampling_mask_max_tokens": vocab_size,
            # SGLang records each token's experts only when started so (a buffer per token).
            "enable_return_routed_experts": moe,
            "max_total_tokens": max_total_tokens, "random_seed": random_seed,
            "sleep_on_idle": True, "log_level": "error",
            "enable_memory_saver": device != "cpu", **ENGINE_DEFAULTS,
            **(vision_args(model, image_cache_mb) if image_cache_mb is not None else {}),
            **engine_args}


class SGLangBackend:
    def __init__(self, model: str, mode: str = "engine", device: str | None = None,
                 dtype: str = "auto", max_total_tokens: int = 4096, random_seed: int = 0,
                 engine_args: dict | None = None, startup_timeout: float = 600.0,
                 request_timeout: float = 3600.0, weight_group_bytes: int = DEFAULT_BUCKET_BYTES,
                 weight_transport: str | None = None, weight_group_timeout: float = 600.0,
                 image_cache_mb: int = 256, stream_interval: int = 16, nice: int = 0):
        weight_transport, engine_args = checked_options(
            mode, stream_interval, image_cache_mb, weight_transport, nice, engine_args)
        from transformers import AutoConfig, AutoTokenizer

        if device is None:
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
        config = AutoConfig.from_pretrained(model)
        text_config = config.get_text_config()  # the config itself for a text model
        self.device = device
        self.model_type = config.model_type
        # Experts per token of a mixture-of-experts model; None for a dense one.
        self.moe_top_k = getattr(text_config, "num_experts_per_tok", None)
        self.vision = config.model_type in VISION_MODEL_TYPES
        self.max_model_len = text_config.max_position_embeddings
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        self.prompts = PromptEncoder(
            self.tokenizer, text_config.vocab_size, self.max_model_len,
            image_token_id=config.image_token_id if self.vision else None)
        self.shapes = checkpoint_shapes(model)
        self.weight_group_bytes = weight_group_bytes
        self.request_timeout = request_timeout
        # Tokens per SGLang stream output for a caller that does not stream: each output
        # costs SGLang's scheduler and tokenizer manager work (with the tiny model on CPU,
        # 256 x 64 tokens one by one: about a fifth of all CPU time). A caller that
        # streams gets every token as SGLang makes it.
        self.stream_interval = stream_interval
        args = engine_arguments(model, device, dtype, max_total_tokens, random_seed,
                                self.shapes, image_cache_mb if self.vision else None,
                                text_config.vocab_size, self.moe_top_k is not None,
                                engine_args)
        self.vocab_size = text_config.vocab_size
        self.routing_reason = None if args["enable_return_routed_experts"] else (
            f"a dense model here (model type {self.model_type!r}): no mixture-of-experts "
            "router to read" if self.moe_top_k is None else
            "engine_args turned SGLang's enable_return_routed_experts off")
        self.penalties = args["enable_custom_logit_processor"] and \
            args["disable_overlap_schedule"]
        self.adapters_reason = None if args.get("enable_lora") else ADAPTERS_OFF
        self.max_lora_rank = args.get("max_lora_rank")
        self.lora_names: dict[str, str] = {}  # adapter name -> the name SGLang has it under
        self._new_lora = itertools.count(1)  # a new SGLang name per load
        self._session_open = False  # an SGLang weight-update session we began and did not end
        # Weight updates made (each chunk is stamped with it: Chunk.weight_update), begun,
        # and failed midway.
        self.updates = self._began = self._failed = 0
        self._start(args, mode, startup_timeout, weight_transport, weight_group_timeout, nice)

    def _start(self, args: dict, mode: str, startup_timeout: float, weight_transport: str,
               weight_group_timeout: float, nice: int) -> None:
        self.engine: Engine = InProcessEngine(args, startup_timeout) if mode == "engine" \
            else ServerEngine(args, startup_timeout, self.request_timeout)
        self.weights = make_sender(weight_transport, self.engine, self.request_timeout,
                                   weight_group_timeout)
        try:
            with niced_children(nice):  # (SGLang's side in this process waits on sockets)
                self.engine.start()
            # SGLang's scheduler keeps a few tokens of the context for itself and refuses
            # longer prompts; they get our typed error instead.
            limit = self.engine.run(self.engine.max_input_tokens(), 60, "SGLang server info")
            self.prompts.max_model_len = min(self.max_model_len, limit + 1)
        except BaseException:
            self.engine.close()
            raise

    @classmethod
    def describe_capabilities(cls, device: str = "cpu",
                              adapters_reason: str | None = ADAPTERS_OFF) -> Capabilities:
        # images: with a vision-language model (VISION_MODEL_TYPES), in both modes;
        # routed experts: with a mixture-of-experts model; adapters: with enable_lora (the
        # instance says)
        unsupported = cpu_reasons(device)
        unsupported.update(DRAWN_SET_UNSUPPORTED)
        unsupported["trace_replay"] = (
            "SGLang's sampling parameters have no trace replay (vLLM's "
            "trace_decode_token_ids): it samples every token")
        unsupported["batch_invariant"] = (
            "SGLang is batch-invariant only in its deterministic inference, a mode of the "
            "whole server that rollout does not start (and SGLang refuses on CPU); the HF "
            "backend runs such a request alone")
        if adapters_reason:
            unsupported["adapters"] = adapters_reason
        return Capabilities(unsupported=unsupported)

    @rollout.hookimpl
    def capabilities(self) -> Capabilities:
        unsupported = self.describe_capabilities(self.device, self.adapters_reason).unsupported
        if not self.vision:
            unsupported["images"] = (
                f"a text-only model here (model type {self.model_type!r}); images need a "
                f"vision-language model of type {', '.join(VISION_MODEL_TYPES)}")
        if self.routing_reason:
            unsupported["routed_experts"] = self.routing_reason
        return Capabilities(unsupported=unsupported)

    @rollout.hookimpl
    def prompt_encoder(self) -> PromptEncoder:
        return self.prompts

    @rollout.hookimpl
    def stats(self) -> dict[str, int] | None:
        return self.engine.image_stats() if self.vision else None

    # --- generation ---------------------------------------------------------------------

    @rollout.hookimpl
    async def generate(self, request, prompt_token_ids, streaming, images):
        s = request.sampling
        self._check_sampling(s)
        lora = None if request.adapter is None else self._lora_name(request.adapter)
        # Like the other backends, generation stops at the context length (reason "length");
        # SGLang would reject the request instead.
        max_tokens = min(s.max_tokens, self.max_model_len - len(prompt_token_ids))
        s = attrs.evolve(s, max_tokens=max_tokens, min_tokens=min(s.min_tokens, max_tokens))
        # Logprobs SGLang computes after penalties, bias or min_tokens are replaced by a
        # scoring prefill of the whole sample, so such a sample is held back until it ends
        # and is rescored, then given out in one chunk; SGLang is not asked for its own.
        rescored = s.logprobs is not None and not protocol.processed(s) \
            and protocol.reshapes_logprobs(s)
        sent = attrs.evolve(s, logprobs=None) if rescored else s
        # One placeholder per image (the core's collapsed form), which SGLang's processor
        # expands; the images as the engine takes them (PIL in process, data: URLs by HTTP,
        # encoded off the event loop).
        image_data = await asyncio.to_thread(self.engine.image_data, images) if images else None
        # One token an output also where the sample is cut here, not in SGLang, which
        # would otherwise run on to the end of the output.
        interval = 1 if streaming or cuts_here(s) else self.stream_interval
        # Fixed-length unique rids: SGLang's scheduler aborts every rid with a given prefix.
        samples = [self._sample(i, self._salted(protocol.generate_body(
            uuid.uuid4().hex, prompt_token_ids, sent, image_data, lora, interval,
            self.vocab_size)), s, prompt_token_ids, rescored, image_data,
            (self.updates, self._began, self._failed)) for i in range(s.n)]
        # One sample is read on the request's own task; several, on a task each.
        chunks = samples[0] if len(samples) == 1 else _merged(samples)
        try:
            if s.prompt_logprobs is not None:  # scored by a prefill of its own, first
                out = await self.engine.generate(self._salted(protocol.prompt_score_body(
                    uuid.uuid4().hex, prompt_token_ids, s.prompt_logprobs, lora)))
                yield Chunk(0, **protocol.parse_prompt_scores(out, len(prompt_token_ids),
                                                              s.prompt_logprobs))
            async with contextlib.aclosing(chunks):  # closed, SGLang aborts what still runs
                async for chunk in chunks:
                    yield chunk
        except RolloutError as exc:
            if isinstance(exc, InvalidRequestError) and exc.field == "prompt_token_ids":
                exc = InvalidRequestError(prompt_field(request), exc.detail, exc.allowed)
            if isinstance(exc, rollout.EngineDeadError):
                raise
            raise constraint_error(exc, s.structured_outputs) from None

    def _salted(self, body: dict) -> dict:
        """Each weights' prefixes apart in SGLang's radix cache: requests kept beside a
        "keep_kv" update go on caching prefixes the old weights made, which no new request
        may reuse."""
        return {**body, "cache_salt": str(self.updates)}

    async def _sample(self, index: int, body: dict, s, prompt: list[int], rescored: bool,
                      image_data, since: tuple[int, int, int]):
        """The chunks of one sample, SGLang request `body`; `since`: the updates made,
        begun and failed when the request came."""
        updates, began, failed = since
        sample = _Sample(s, self.prompts.decode, rescored)
        cached = None  # SGLang's last word on prefix-cache hits, for the final chunk
        expanded = None  # the prompt's length in SGLang, each image's run of tokens included
        routing = None  # SGLang's, once it sends it (as the sample ends)
        # Once an update begins beside the sample, its tokens wait for the output that ends
        # it, where SGLang says which weights made each (those already out were made
        # before the update held the scheduler).
        waiting: list[protocol.Delta] = []
        async with contextlib.aclosing(self.engine.stream(body)) as outputs:
            async for out in outputs:
                meta = out.get("meta_info") or {}
                expanded = meta.get("prompt_tokens", expanded)
                routing = meta.get("routed_experts", routing)
                delta = protocol.parse_delta(out, None if rescored else s.logprobs,
                                             "sampling_logprobs_mode" in body)
                if delta.cached_tokens is not None:
                    cached = delta.cached_tokens
                if s.return_sampling_mask and s.temperature == 0:  # the argmax alone
                    delta = delta._replace(sampling_mask=[(t,) for t in delta.token_ids])
                given = sample.add(delta)
                if self._began != began and not rescored:
                    waiting.append(given)
                if given.finish_reason is not None:
                    break  # leaving the stream aborts a sample cut here in SGLang
                if given.token_ids and not waiting:
                    yield Chunk(index, given.token_ids, given.logprobs, given.top_logprobs,
                                cached_tokens=delta.cached_tokens,
                                sampling_mask=given.sampling_mask, weight_update=updates)
            else:
                raise GenerationError("SGLang ended a sample's stream unfinished")
        if given.finish_reason == "abort" and self._failed != failed:
            raise GenerationError("a weight update failed midway beside this request, and "
                                  "its weights are half new: SGLang aborted it")
        logprobs, top = given.logprobs, given.top_logprobs
        if rescored:
            logprobs, top = await self._raw_logprobs(prompt, given.token_ids, s.logprobs,
                                                     image_data, expanded, body["lora_path"])
            if self._began != began:
                raise GenerationError(
                    "a weight update ran beside this sample, whose logprobs are rescored "
                    "(penalties, logit_bias or min_tokens with raw logprobs) by the weights "
                    "loaded when it ends: they would not be those that made its tokens")
        # Every token but the last ran through the model.
        experts = self._experts(s, routing, (expanded or len(prompt)) + len(sample.tokens) - 1)
        last = given._replace(logprobs=logprobs, top_logprobs=top)
        runs = _runs(updates, last, waiting, meta, len(sample.tokens))
        for update, run in runs[:-1]:
            yield Chunk(index, run.token_ids, run.logprobs, run.top_logprobs,
                        sampling_mask=run.sampling_mask, weight_update=update)
        update, run = runs[-1]
        yield Chunk(index, run.token_ids, run.logprobs, run.top_logprobs, given.finish_reason,
                    cached_tokens=cached, sampling_mask=run.sampling_mask,
                    routed_experts=experts, weight_update=update)

    def _experts(self, s, routing, ran: int):
        if not s.return_routed_experts:
            return None
        if routing is None:
            raise GenerationError("SGLang sent no routed experts")
        return protocol.routed_experts(routing, ran, self.moe_top_k)

    def _check_sampling(self, s) -> None:
        """What SGLang cannot do as the contract says is refused, never done otherwise."""
        if protocol.asks_for_the_drawn_set(s):
            penalty = protocol.penalty(s)
            if penalty is not None:
                raise InvalidRequestError(f"sampling.{penalty}",
                                          DRAWN_SET_UNSUPPORTED["drawn_set.penalties"],
                                          DRAWN_SET_ALLOWED)
            if s.top_p < 1 and (s.top_k is not None or s.min_p > 0):
                raise InvalidRequestError(
                    "sampling.top_p", DRAWN_SET_UNSUPPORTED["drawn_set.top_p_after_truncation"],
                    DRAWN_SET_ALLOWED)
        if s.return_routed_experts and cuts_here(s):
            raise InvalidRequestError(
                "sampling.return_routed_experts", "SGLang gives a sample's routing as it "
                "ends it, and the backend ends this one itself, before SGLang would",
                "no stop_token_ids with ignore_eos, and no stop with min_tokens")
        if s.logprobs is not None and not protocol.processed(s) \
                and s.structured_outputs is not None and protocol.reshapes_logprobs(s):
            raise InvalidRequestError(
                "sampling.logprobs", "SGLang's logprobs come after penalties, bias and "
                "min_tokens, and the raw ones cannot be recomputed under a constraint",
                "no logprobs, or no penalties, logit_bias or min_tokens with a constraint")
        if protocol.penalized(s) and not self.penalties:
            raise InvalidRequestError(
                "sampling.repetition_penalty", "the penalties need SGLang's custom logit "
                "processor and no overlap scheduler, which engine_args changed",
                "no penalties, or the backend's default engine_args")

    async def _raw_logprobs(self, prompt: list[int], tokens: list[int], logprobs: int,
                            image_data=None, expanded: int | None = None,
                            lora: str | None = None):
        """The sample's logprobs from a scoring prefill: the raw model's, as the contract
        wants, where SGLang's own are after penalties, bias and the min_tokens ban. (A
        prefill knows no constraint: _check_sampling refuses that case.)"""
        if not tokens:
            return [], [] if logprobs else None
        out = await self.engine.generate(self._salted(
            protocol.score_body(uuid.uuid4().hex, prompt, tokens, logprobs, image_data,
                                expanded, lora)))
        return protocol.parse_scores(out, len(tokens), logprobs)

    # --- weights and memory -------------------------------------------------------------

    @rollout.hookimpl
    def update_weights(self, buckets):
        """One SGLang session, the scheduler held in place meanwhile: requests running
        beside a "keep_kv" update stay in it with their KV cache, and SGLang marks where
        their tokens change weights (named by the number of updates made). A failure
        midway aborts them (the weights are half new), and the core refuses requests until
        a full update succeeds."""
        self._began += 1  # before the hold: a sample that sees it waits for SGLang's spans
        self.engine.run(self.engine.pause(), 60, "SGLang pause_generation")
        try:
            self._load(buckets)
            self.engine.run(self.engine.name_weights(self.updates + 1), 60,
                            "SGLang update_weight_version")
            self.updates += 1
        except BaseException:
            self._failed += 1
            # The first error is the one to report; the scheduler goes on either way.
            with contextlib.suppress(Exception):
                self.engine.run(self.engine.abort_all(), 60, "SGLang abort_request")
            with contextlib.suppress(Exception):
                self.engine.run(self.engine.go_on(), 60, "SGLang continue_generation")
            raise
        # No flush: new requests are salted apart from what the old weights cached
        # (_salted), which SGLang evicts as it needs the room. (A flush cannot run beside
        # kept requests, and where none run it took 0.8 s a push on CPU.)
        self.engine.run(self.engine.go_on(), 60, "SGLang continue_generation")

    def _load(self, buckets) -> None:
        """The buckets in one SGLang weight-update session. A failure midway (the
        trainer's tensors stop coming, a transfer fails) ends the session, bounded, so that
        the next update can begin."""
        if self._session_open:  # the last failure could not end it (nor maybe tell us it did)
            with contextlib.suppress(GenerationError):
                self._end_session()
            self._session_open = False
        self.engine.run(self.engine.begin_update(), 60, "SGLang begin_weight_update")
        self._session_open = True
        try:
            for group in checked_groups(buckets, self.shapes, self.weight_group_bytes):
                self.weights.send(group)
        except BaseException:
            with contextlib.suppress(Exception):  # the first error is the one to report
                self._end_session()
            raise
        self._end_session()

    def _end_session(self) -> None:
        self.engine.run(self.engine.end_update(), 60, "SGLang end_weight_update")
        self._session_open = False

    def update_weights_from_disk(self, path: str) -> None:
        """Load a checkpoint folder with the model's architecture from this host's disk."""
        self.engine.run(self.engine.update_from_disk(str(path)), self.request_timeout,
                        "SGLang update_weights_from_disk")
        self._flush()

    def _flush(self) -> None:
        """Drop the KV cache. SGLang flushes only once its scheduler is idle, and requests
        the core has aborted may still be leaving it: retried until they are gone."""
        deadline = time.monotonic() + 30
        while not self.engine.run(self.engine.flush_cache(), 60, "SGLang flush_cache"):
            if time.monotonic() > deadline:
                raise rollout.GenerationError("SGLang did not flush its cache within 30 s")
            time.sleep(0.2)

    # --- LoRA adapters (with enable_lora) -------------------------------------------------

    def _lora_name(self, name: str) -> str:
        sglang_name = self.lora_names.get(name)
        if sglang_name is None:
            raise no_such_adapter(name, self.lora_names)
        return sglang_name

    @rollout.hookimpl
    def load_adapter(self, name, config, buckets):
        """Loaded under a new SGLang name, then the one it replaces unloaded: a load that
        fails leaves the old one serving, and no cached prefix of the old weights (SGLang's
        radix cache keys on the adapter) is reused."""
        adapter = read_adapter(config, iter_unpacked(buckets), linear_modules(self.shapes),
                               self.max_lora_rank)
        tensors = adapter.peft_tensors()  # the caller's: the engine sends SGLang a copy
        modules = adapter.target_modules()
        sglang_name = f"{name}#{next(self._new_lora)}"
        self.engine.run(self.engine.load_adapter(sglang_name, adapter.rank, adapter.scale,
                                                 modules, tensors),
                        self.request_timeout, "SGLang adapter load")
        replaced = self.lora_names.get(name)
        self.lora_names[name] = sglang_name
        if replaced is not None:
            self.engine.run(self.engine.unload_adapter(replaced), self.request_timeout,
                            "SGLang adapter unload")

    @rollout.hookimpl
    def unload_adapter(self, name):
        self.engine.run(self.engine.unload_adapter(self.lora_names.pop(name)),
                        self.request_timeout, "SGLang adapter unload")

    @rollout.hookimpl
    def release(self, tags):
        self._flush()  # SGLang's release asserts an idle scheduler (see _flush)
        self.engine.run(self.engine.release(list(tags)), 600, "SGLang release")

    @rollout.hookimpl
    def resume(self, tags):
        self.engine.run(self.engine.resume(list(tags)), 600, "SGLang resume")

    @rollout.hookimpl
    def close(self):
        try:
            self.weights.close()
        finally:
            self.engine.close()


async def _merged(streams: list):
    """The items of several async iterators as they come, read on a task each; cancelled,
    those the iterators give as they are cancelled too."""
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(stream):
        try:
            async with contextlib.aclosing(stream):
                async for item in stream:
                    queue.put_nowait(item)
        except Exception as exc:  # noqa: BLE001 - raised by the reader
            queue.put_nowait(exc)
        queue.put_nowait(end)

    tasks = [asyncio.create_task(pump(stream)) for stream in streams]
    try:
        left = len(tasks)
        while left:
            item = await queue.get()
            if item is end:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    except asyncio.CancelledError:
        # Stopped (an abort, a "keep" update): each stream, cancelled, hands over what
        # SGLang made and held back (as one read on the request's own task does).
        for task in tasks:
            task.cancel()
        await asyncio.wait(tasks, timeout=2 * END_TIMEOUT_S)
        while not queue.empty():
            item = queue.get_nowait()
            if item is not end and not isinstance(item, BaseException):
                yield item
        raise
    finally:
        for task in tasks:  # a task cancelled before it started never reached SGLang
            task.cancel()


def cuts_here(s) -> bool:
    """Whether the backend ends the sample itself, where SGLang would go on (_Sample)."""
    return bool((s.ignore_eos and s.stop_token_ids) or (s.min_tokens and s.stop))


PER_TOKEN = ("token_ids", "logprobs", "top_logprobs", "sampling_mask")  # Delta's fields


def sliced(delta: protocol.Delta, a: int, b: int) -> protocol.Delta:
    """Tokens [a, b) of `delta` with what each carries."""
    return delta._replace(**{name: value[a:b] for name, value in zip(delta._fields, delta)
                             if name in PER_TOKEN and value is not None})


def joined(deltas: list[protocol.Delta]) -> protocol.Delta:
    """One Delta of consecutive ones, with the last's finish."""
    return deltas[-1]._replace(**{
        name: None if getattr(deltas[-1], name) is None else
        [x for d in deltas for x in getattr(d, name)] for name in PER_TOKEN})


def by_weights(delta: protocol.Delta, end: int, spans) -> list[tuple[int, protocol.Delta]]:
    """The tokens of `delta`, the last of a sample's `end` tokens, in runs of the weights
    that made them, (updates, run), from SGLang's (updates, start, end) spans."""
    runs = runs_of(end - len(delta.token_ids), end, spans)
    return [(update, sliced(delta, a, b)) for update, a, b in runs] \
        or [(spans[-1][0], delta)]  # (no tokens: the finish alone)


class _Sample:
    """One sample as SGLang streams it: ended where SGLang would not stop by itself, and
    held back whole when its logprobs are to be rescored."""

    def __init__(self, s, decode, held_back: bool):
        self.s, self.decode, self.held_back = s, decode, held_back
        self.tokens: list[int] = []
        # SGLang's ignore_eos also ignores stop_token_ids (Req._check_token_based_finish
        # returns early), so the sample runs on past a stop token: it ends at the first
        # one here, with the tokens SGLang would have made had it stopped.
        self.stop_tokens = frozenset(s.stop_token_ids) if s.ignore_eos else frozenset()
        # SGLang checks stop strings from the first token on (Req.update_finish_state);
        # with min_tokens they go to it unsent, and are looked for here in the text.
        self.text = TextStream(decode, attrs.evolve(s, stop=(), min_tokens=0)) \
            if s.min_tokens and s.stop else None
        self.masks: list | None = None  # the sampling masks of the tokens held back
        self.held: int | None = None  # length of the first min_tokens tokens' text
        self.searched = 0  # text searched for stop strings so far

    def add(self, delta: protocol.Delta) -> protocol.Delta:
        """What to give out for SGLang's new output."""
        ids = delta.token_ids
        end = self._stop_token(ids)
        if self.text is not None:
            at = self._stop_string(ids if end is None else ids[:end])
            end = end if at is None else at
        if end is not None:
            delta = sliced(delta, 0, end)._replace(finish_reason="stop")
        self.tokens += delta.token_ids
        if not self.held_back:
            return delta
        if delta.sampling_mask is not None:
            self.masks = (self.masks or []) + delta.sampling_mask
        if delta.finish_reason is None:
            return protocol.Delta([], None, None, None)
        return protocol.Delta(self.tokens, None, None, delta.finish_reason,
                              sampling_mask=self.masks)

    def _stop_token(self, ids) -> int | None:
        if not self.stop_tokens:
            return None
        return next((i + 1 for i, t in enumerate(ids) if t in self.stop_tokens), None)

    def _stop_string(self, ids) -> int | None:
        """Where in `ids` the first stop string that ends in text made after the first
        min_tokens tokens ends the sample; None without one."""
        s = self.s
        self.text.add(ids)
        tokens = self.text.tokens
        if len(tokens) <= s.min_tokens:
            return None
        if self.held is None:
            self.held = len(self.decode(tokens[:s.min_tokens]))
        # Found in the text decoded as it comes, then placed in the whole text's decoding,
        # which is what the core cuts the text at.
        found = first_stop(self.text.text, s.stop, max(self.held, self.searched))
        self.searched = len(self.text.text)
        match = found and first_stop(self.decode(tokens), s.stop, self.held)
        if not match:
            return None
        before = len(self.tokens)
        end = len(tokens)
        while end > max(s.min_tokens + 1, before) and \
                len(self.decode(tokens[:end - 1])) >= match[1]:
            end -= 1
        return end - before


def _runs(updates: int, last: protocol.Delta, held: list[protocol.Delta], meta: dict,
          length: int):
    """A sample's last tokens in runs by the weights that made them: `last` under `updates`,
    or, where an update began beside the sample and `held` its outputs from then on (the
    last of them the one `last` completes), those split by the spans SGLang gave as it
    ended the sample."""
    if not held:
        return [(updates, last)]
    spans = protocol.weight_spans(meta)
    if spans is None:  # a sample cut here: SGLang did not end it
        raise GenerationError(
            "a weight update ran beside this sample, which the backend ends itself "
            "(stop_token_ids with ignore_eos, or stop with min_tokens): SGLang says "
            "which weights made each token only as it ends a sample")
    return by_weights(joined([*held[:-1], last]), length, spans)
