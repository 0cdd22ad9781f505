"""SGLangBackend: the rollout contract over SGLang, in process (`mode="engine"`) or over its
native HTTP server in a child process on loopback (`mode="server"`).

Prompts are tokenized and checked here (vocabulary, context length), and results are
decoded here, so errors and texts are the same as with every other backend; SGLang crashes
on an out-of-vocabulary token id instead of rejecting it.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import attrs

import rollout
from rollout import Capabilities, InvalidRequestError, Result, RolloutError, TokenLogprob
from rollout.kit.buckets import DEFAULT_BUCKET_BYTES
from rollout.kit.checkpoint import checkpoint_shapes
from rollout.kit.prompts import PromptEncoder, prompt_field
from rollout.kit.structured import constraint_error

from rollout_sglang import protocol
from rollout_sglang.engines import InProcessEngine, ServerEngine
from rollout_sglang.weights import checked_groups

MODES = ("engine", "server")
ABORT_RETRY_S = 5.0  # how long an abort keeps chasing a request SGLang has not registered yet


# Structured outputs through xgrammar (the grammar dialect every backend reads), compact
# JSON (a random model otherwise loops on whitespace); `engine_args` may override.
ENGINE_DEFAULTS = {"grammar_backend": "xgrammar",
                   "constrained_json_disable_any_whitespace": True,
                   # The penalties (processors.py), which need each request's output up
                   # to date when they run: the overlap scheduler hands it one token late.
                   "enable_custom_logit_processor": True,
                   "disable_overlap_schedule": True}


def _stop_at_tokens(sample: protocol.Sample, s) -> protocol.Sample:
    """SGLang's ignore_eos also ignores stop_token_ids (Req._check_token_based_finish
    returns early), so the sample runs on past a stop token: it ends at the first one here.
    Its tokens up to there are what SGLang would have made had it stopped."""
    if not (s.ignore_eos and s.stop_token_ids):
        return sample
    stops = set(s.stop_token_ids)
    end = next((i + 1 for i, t in enumerate(sample.token_ids) if t in stops), None)
    return sample if end is None else _stopped_at(sample, end)


def _stopped_at(sample: protocol.Sample, end: int) -> protocol.Sample:
    """The sample's first `end` tokens (and their logprobs), ended by a stop."""
    return protocol.Sample(sample.token_ids[:end], "stop",
                           sample.logprobs[:end] if sample.logprobs is not None else None,
                           sample.top_logprobs[:end] if sample.top_logprobs is not None
                           else None)


def first_stop(text: str, stops, after: int = 0) -> tuple[int, int] | None:
    """(start, end) of the stop string match that ends first, among those ending past
    `after` characters (the text of the first min_tokens tokens)."""
    found = []
    for stop in stops:
        i = text.find(stop, max(0, after - len(stop) + 1))
        if i >= 0:
            found.append((i + len(stop), i))
    return (min(found)[1], min(found)[0]) if found else None


def cpu_reasons(device: str) -> dict[str, str]:
    if device != "cpu":
        return {}
    return {
        "seed": "SGLang uses per-request seeds only with deterministic inference, which it "
                "refuses on CPU (no supported attention backend); sampling_seed is ignored",
        "release": "SGLang's memory saver is CUDA-only: on CPU release/resume free nothing, "
                   "and a release while a request runs crashes the scheduler",
    }


class SGLangBackend:
    def __init__(self, model: str, mode: str = "engine", device: str | None = None,
                 dtype: str = "auto", max_total_tokens: int = 4096, random_seed: int = 0,
                 engine_args: dict | None = None, startup_timeout: float = 600.0,
                 request_timeout: float = 3600.0, weight_group_bytes: int = DEFAULT_BUCKET_BYTES):
        if mode not in MODES:
            raise InvalidRequestError("mode", f"got {mode!r}", ", ".join(MODES))
        from transformers import AutoConfig, AutoTokenizer

        if device is None:
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
        config = AutoConfig.from_pretrained(model)
        self.device = device
        self.max_model_len = config.max_position_embeddings
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        self.prompts = PromptEncoder(self.tokenizer, config.vocab_size, self.max_model_len)
        self.shapes = checkpoint_shapes(model)
        self.weight_group_bytes = weight_group_bytes
        self.request_timeout = request_timeout
        args = {"model_path": model, "device": device, "dtype": dtype,
                "max_total_tokens": max_total_tokens, "random_seed": random_seed,
                "sleep_on_idle": True, "log_level": "error",
                "enable_memory_saver": device != "cpu", **ENGINE_DEFAULTS,
                **(engine_args or {})}
        self.penalties = args["enable_custom_logit_processor"] and \
            args["disable_overlap_schedule"]
        self.engine = InProcessEngine(args, startup_timeout) if mode == "engine" else \
            ServerEngine(args, startup_timeout, request_timeout)
        self._running: dict[str, list[str]] = {}  # our request id -> SGLang rids
        self._aborted: set[str] = set()
        try:
            self.engine.start()
            # SGLang's scheduler keeps a few tokens of the context for itself and refuses
            # longer prompts; they get our typed error instead.
            limit = self.engine.run(self.engine.max_input_tokens(), 60, "SGLang server info")
            self.prompts.max_model_len = min(self.max_model_len, limit + 1)
        except BaseException:
            self.engine.close()
            raise

    @classmethod
    def describe_capabilities(cls, device: str = "cpu") -> Capabilities:
        unsupported = {"images": "this backend sends text and token prompts only (for now)",
                       **cpu_reasons(device)}
        return Capabilities(unsupported=unsupported, concurrent_generate=True)

    @rollout.hookimpl
    def capabilities(self) -> Capabilities:
        return self.describe_capabilities(self.device)

    # --- generation ---------------------------------------------------------------------

    @rollout.hookimpl
    def generate(self, requests):
        async def run_all():
            return await asyncio.gather(*(self._one(r) for r in requests))

        # Requests end on their own timeouts; this bound only guards against a lost wakeup.
        return self.engine.run(run_all(), self.request_timeout + 60, "SGLang generate")

    async def _one(self, request):
        try:
            prompt = self.prompts.encode(request)
            self._check_sampling(request.sampling)
        except InvalidRequestError as exc:
            return exc
        # Like the other backends, generation stops at the context length (reason "length");
        # SGLang would reject the request instead.
        room = self.max_model_len - len(prompt)
        max_tokens = min(request.sampling.max_tokens, room)
        s = attrs.evolve(request.sampling, max_tokens=max_tokens,
                         min_tokens=min(request.sampling.min_tokens, max_tokens))
        # Fixed-length unique rids: SGLang's scheduler aborts every rid with a given prefix.
        rids = [uuid.uuid4().hex for _ in range(s.n)]
        self._running[request.id] = rids
        try:
            outs = await asyncio.gather(
                *(self.engine.generate(protocol.generate_body(rid, prompt, s)) for rid in rids))
            samples = [self._stop_at_strings(_stop_at_tokens(
                protocol.parse_output(o, s.logprobs), s), s) for o in outs]
            if s.logprobs is not None and protocol.reshapes_logprobs(s):
                samples = await asyncio.gather(*(self._raw_logprobs(prompt, x, s.logprobs)
                                                 for x in samples))
        except RolloutError as exc:
            if isinstance(exc, InvalidRequestError) and exc.field == "prompt_token_ids":
                exc = InvalidRequestError(prompt_field(request), exc.detail, exc.allowed)
            if isinstance(exc, rollout.EngineDeadError):
                raise
            return constraint_error(exc, s.structured_outputs)
        finally:
            self._running.pop(request.id, None)
            self._aborted.discard(request.id)
        return [self._result(request, sample, len(prompt), i) for i, sample in enumerate(samples)]

    def _check_sampling(self, s) -> None:
        """What SGLang cannot do as the contract says is refused, never done otherwise."""
        if s.logprobs is not None and s.structured_outputs is not None \
                and protocol.reshapes_logprobs(s):
            raise InvalidRequestError(
                "sampling.logprobs", "SGLang's logprobs come after penalties, bias and "
                "min_tokens, and the raw ones cannot be recomputed under a constraint",
                "no logprobs, or no penalties, logit_bias or min_tokens with a constraint")
        if protocol.penalized(s) and not self.penalties:
            raise InvalidRequestError(
                "sampling.repetition_penalty", "the penalties need SGLang's custom logit "
                "processor and no overlap scheduler, which engine_args changed",
                "no penalties, or the backend's default engine_args")

    async def _raw_logprobs(self, prompt: list[int], sample: protocol.Sample,
                            logprobs: int) -> protocol.Sample:
        """The sample's logprobs from a scoring prefill: the raw model's, as the contract
        wants, where SGLang's own are after penalties, bias and the min_tokens ban. (A
        prefill knows no constraint: _check_sampling refuses that case.)"""
        if not sample.token_ids:
            return sample
        out = await self.engine.generate(
            protocol.score_body(uuid.uuid4().hex, prompt, sample.token_ids, logprobs))
        return protocol.parse_scores(out, sample, logprobs)

    def _stop_at_strings(self, sample: protocol.Sample, s) -> protocol.Sample:
        """SGLang checks stop strings from the first token on (Req.update_finish_state);
        with min_tokens they go to it unsent, and the sample ends here at the first match
        that ends in text made after the first min_tokens tokens."""
        if not (s.min_tokens and s.stop):
            return sample
        tokens = sample.token_ids
        text = self.prompts.decode(tokens)
        match = first_stop(text, s.stop, len(self.prompts.decode(tokens[:s.min_tokens])))
        if match is None:
            return sample
        end = next(k for k in range(s.min_tokens + 1, len(tokens) + 1)
                   if len(self.prompts.decode(tokens[:k])) >= match[1])
        return _stopped_at(sample, end)

    def _result(self, request, sample: protocol.Sample, prompt_tokens: int, index: int) -> Result:
        text = self.prompts.decode(sample.token_ids)
        s = request.sampling
        held = len(self.prompts.decode(sample.token_ids[:s.min_tokens])) if s.min_tokens else 0
        match = first_stop(text, s.stop, held)
        if match is not None:  # the text ends before the stop string, whatever SGLang's
            # detokenizer did, or right after it if it is kept
            text = text[: match[1] if s.include_stop_str_in_output else match[0]]
        return Result(
            request_id=request.id, index=index, token_ids=tuple(sample.token_ids), text=text,
            finish_reason=sample.finish_reason, prompt_tokens=prompt_tokens,
            logprobs=tuple(sample.logprobs) if sample.logprobs is not None else None,
            top_logprobs=tuple(tuple(TokenLogprob(t, lp) for t, lp in step)
                               for step in sample.top_logprobs)
            if sample.top_logprobs is not None else None)

    @rollout.hookimpl
    def abort(self, request_ids):
        async def abort_now():
            if request_ids is None:
                self._aborted.update(self._running)
                await self.engine.abort(None)
                return
            for rid in self._targets(request_ids):
                await self.engine.abort(rid)
            # SGLang drops an abort for a rid it has not registered yet; try again shortly.
            asyncio.ensure_future(self._chase(list(request_ids)))

        self.engine.run(abort_now(), 60, "SGLang abort")

    def _targets(self, request_ids) -> list[str]:
        ids = [i for i in request_ids if i in self._running]
        self._aborted.update(ids)
        return [rid for i in ids for rid in self._running[i]]

    async def _chase(self, request_ids: list[str]) -> None:
        deadline = time.monotonic() + ABORT_RETRY_S
        while time.monotonic() < deadline:
            await asyncio.sleep(0.2)
            live = [i for i in request_ids if i in self._running]
            if not live:
                return
            try:
                for rid in self._targets(live):
                    await self.engine.abort(rid)
            except RolloutError:
                return

    # --- weights and memory -------------------------------------------------------------

    @rollout.hookimpl
    def update_weights(self, buckets):
        timeout = self.request_timeout
        self.engine.run(self.engine.begin_update(), 60, "SGLang begin_weight_update")
        try:
            for group in checked_groups(buckets, self.shapes, self.weight_group_bytes):
                self.engine.run(self.engine.update_tensors(group), timeout, "SGLang weight update")
        finally:
            self.engine.run(self.engine.end_update(), 60, "SGLang end_weight_update")
        self._flush()

    def update_weights_from_disk(self, path: str) -> None:
        """Load a checkpoint folder with the model's architecture from this host's disk."""
        self.engine.run(self.engine.update_from_disk(str(path)), self.request_timeout,
                        "SGLang update_weights_from_disk")
        self._flush()

    def _flush(self) -> None:
        # An aborted request can still be leaving the scheduler; the flush then fails.
        deadline = time.monotonic() + 30
        while not self.engine.run(self.engine.flush_cache(), 60, "SGLang flush_cache"):
            if time.monotonic() > deadline:
                raise rollout.GenerationError("SGLang did not flush its cache within 30 s")
            time.sleep(0.2)

    @rollout.hookimpl
    def release(self, tags):
        self.engine.run(self.engine.release(list(tags)), 600, "SGLang release")

    @rollout.hookimpl
    def resume(self, tags):
        self.engine.run(self.engine.resume(list(tags)), 600, "SGLang resume")

    @rollout.hookimpl
    def close(self):
        self.engine.close()
