"""HFBackend: transformers behind the rollout contract, with continuous batching.

Its own decode loop (not `model.generate`) lets every row of a batch carry its own
sampling parameters, seed, stop strings and length limit, and lets rows join and leave a
running batch at every step (engine_thread.py, on a thread of its own: the event loop never
runs the model). Choosing tokens (penalties, logit bias, min_p and min_tokens in vLLM's order,
structured outputs through xgrammar) is the kit's `rollout.kit.sampler`.

transformers' own continuous batching (`ContinuousBatchingManager`) is not used: it has no
per-request seeds, no per-request greedy/sampled mix or `n`, no stop strings, only the
chosen token's (processed) logprob, per-request temperature/top-k/top-p only, and no hook
for a per-row grammar mask.
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import rollout
from rollout import Capabilities, InvalidRequestError, Request
from rollout.weights.buckets import copy_tensor, unpack
from rollout.weights.lora import no_such_adapter
from rollout.kit.prompts import PromptEncoder, prompt_field
from rollout.kit.sampler import Grammars, Row, rows_for

from rollout_hf.engine_thread import Engine
from rollout_hf.handoff import Job, chunks
from rollout_hf.lora import Adapters
from rollout_hf import vision

POLL_S = 5.0  # a request that waits this long for tokens asks whether the engine lives


class HFBackend:
    def __init__(self, model: str, device: str | None = None, dtype: str = "auto",
                 batch_size: int = 32, max_model_len: int | None = None,
                 image_cache_mb: float = 256):
        if not isinstance(batch_size, int) or batch_size < 1:
            raise InvalidRequestError("batch_size", f"got {batch_size!r}", "an integer >= 1")
        if (isinstance(image_cache_mb, bool) or not isinstance(image_cache_mb, (int, float))
                or not 0 <= image_cache_mb < float("inf")):
            raise InvalidRequestError("image_cache_mb", f"got {image_cache_mb!r}",
                                      "a number of MiB >= 0 (0: no cache)")
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        torch_dtype = dtype if dtype == "auto" else getattr(torch, dtype)
        model_type = AutoConfig.from_pretrained(model).model_type
        if model_type in vision.MODEL_TYPES:
            from transformers import AutoImageProcessor, AutoModelForImageTextToText

            self.model = AutoModelForImageTextToText.from_pretrained(model, dtype=torch_dtype)
            self.vision = vision.Vision(self.model, AutoImageProcessor.from_pretrained(model),
                                        self.device, int(image_cache_mb * 2**20))
        else:
            self.model = AutoModelForCausalLM.from_pretrained(model, dtype=torch_dtype)
            self.vision = None
        self.model.to(self.device).eval()
        self.batch_size = batch_size
        config = self.model.config.get_text_config()
        self.max_model_len = max_model_len or getattr(config, "max_position_embeddings", 2048)
        self.vocab_size = self.model.get_input_embeddings().num_embeddings
        eos = self.model.generation_config.eos_token_id
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        if self.tokenizer.eos_token_id is not None:
            eos.append(self.tokenizer.eos_token_id)
        self.eos_ids = frozenset(eos)
        self.prompts = PromptEncoder(
            self.tokenizer, self.vocab_size, self.max_model_len,
            image_token_id=None if self.vision is None else self.vision.image_token_id)
        self.grammars = Grammars(self.tokenizer, self.vocab_size, self.eos_ids)  # compiles lazily
        self.pad_id = self.tokenizer.pad_token_id
        if self.pad_id is None:
            self.pad_id = min(self.eos_ids) if self.eos_ids else 0
        self._offloaded: Path | None = None
        self.adapters = Adapters(self.model)
        self.engine = Engine(self.model, self.tokenizer, batch_size=batch_size,
                             pad_id=self.pad_id, device=self.device,
                             grammar_vocab=self.vocab_size, adapters=self.adapters)

    @classmethod
    def describe_capabilities(cls) -> Capabilities:  # images, routed experts: with a model of that kind
        return Capabilities()

    @rollout.hookimpl
    def capabilities(self) -> Capabilities:
        model_type = self.model.config.model_type
        unsupported = {}
        if self.vision is None:
            unsupported["images"] = (
                f"a text-only model here (model type {model_type!r}); "
                f"images need a vision-language model of type {', '.join(vision.MODEL_TYPES)}")
        if not self.engine.routers.routers:
            unsupported["routed_experts"] = (
                f"a dense model here (model type {model_type!r}): no mixture-of-experts "
                "router to read")
        return Capabilities(unsupported=unsupported)

    @rollout.hookimpl
    def prompt_encoder(self) -> PromptEncoder:
        return self.prompts

    @rollout.hookimpl
    def stats(self) -> dict[str, int] | None:
        return None if self.vision is None else self.vision.stats()

    # --- generation ---------------------------------------------------------------------

    @rollout.hookimpl
    async def generate(self, request: Request, prompt_token_ids: list[int], images):
        if request.adapter is not None and request.adapter not in self.adapters.loaded:
            raise no_such_adapter(request.adapter, self.adapters.loaded)
        s = request.sampling
        job = Job(asyncio.get_running_loop(), s.prompt_logprobs)
        if s.structured_outputs is None and not images:
            job.rows = self._rows(job, request, prompt_token_ids)
        else:  # compiling a grammar, processing images take a while: not on the loop
            job.rows = await asyncio.to_thread(self._rows, job, request, prompt_token_ids,
                                               images)
        self.engine.submit(job)
        try:
            unfinished = s.n
            while unfinished:
                tokens = await job.take(POLL_S)
                if not tokens:
                    self.engine.check()
                    continue
                for chunk in chunks(tokens, s.logprobs, s.return_sampling_mask):
                    unfinished -= chunk.finish_reason is not None
                    yield chunk
        finally:
            job.cancelled = True  # the engine drops whatever is left at its next step

    def _rows(self, job: Job, request: Request, prompt: list[int], images=()) -> list[Row]:
        if images:  # the rows see each image's run of tokens; the job holds its pixels
            prompt, job.vision = self.vision.prepare(prompt, images, self.max_model_len,
                                                     prompt_field(request))
        return rows_for(request, prompt, owner=job, eos_ids=self.eos_ids,
                        max_model_len=self.max_model_len, device=self.device,
                        grammars=self.grammars)

    # --- weights and memory -------------------------------------------------------------

    @rollout.hookimpl
    def update_weights(self, buckets):
        # Between two steps: rows a "keep_kv" update runs beside stay in the batch.
        with self.engine.exclusive(), torch.no_grad():
            try:
                self._load(buckets)
            except BaseException as exc:  # rows beside it must not run on half the weights
                self.engine.fail_running(exc, "a weight update")
                raise
            self.engine.updates += 1

    def _load(self, buckets) -> None:
        params = dict(self.model.named_parameters(remove_duplicate=False))
        for bucket in buckets:
            named = unpack(bucket)
            for name, tensor in named:  # check the whole bucket before changing anything
                if name not in params:
                    raise InvalidRequestError("weights", f"unknown parameter {name!r}",
                                              "the model's parameter names")
                if tuple(tensor.shape) != tuple(params[name].shape):
                    raise InvalidRequestError(
                        "weights", f"{name!r} has shape {tuple(tensor.shape)}",
                        f"shape {tuple(params[name].shape)}")
            for name, tensor in named:
                copy_tensor(params[name], tensor)

    @rollout.hookimpl
    def load_adapter(self, name, config, buckets):
        with self.engine.exclusive():
            self.adapters.load(name, config, (t for b in buckets for t in unpack(b)))

    @rollout.hookimpl
    def unload_adapter(self, name):
        with self.engine.exclusive():
            self.adapters.unload(name)

    @rollout.hookimpl
    def release(self, tags):
        with self.engine.exclusive():  # which also frees what aborted requests left
            if "weights" in tags:
                if self.device.type == "cpu":
                    self._offload_to_disk()
                else:
                    self.model.to("cpu")
            if self.device.type == "cuda":
                torch.cuda.empty_cache()  # the KV cache lives only while requests run

    @rollout.hookimpl
    def resume(self, tags):
        if "weights" in tags:
            with self.engine.exclusive():
                if self._offloaded is not None:
                    self._load_from_disk()
                else:
                    self.model.to(self.device)

    def _offload_to_disk(self) -> None:
        # On CPU the weights already sit in host memory; writing them to disk and dropping
        # them is what actually frees that memory.
        tensors = dict(self.model.named_parameters(remove_duplicate=False))
        tensors.update(self.model.named_buffers(remove_duplicate=False))
        handle, name = tempfile.mkstemp(prefix="rollout-hf-", suffix=".pt")
        with open(handle, "wb") as f:
            torch.save({k: v.detach() for k, v in tensors.items()}, f)
        self._offloaded = Path(name)
        self.model.to("meta")

    def _load_from_disk(self) -> None:
        saved = torch.load(self._offloaded, map_location=self.device, weights_only=True)
        self.model.to_empty(device=self.device)
        current = dict(self.model.named_parameters(remove_duplicate=False))
        current.update(self.model.named_buffers(remove_duplicate=False))
        with torch.no_grad():
            for name, tensor in saved.items():
                current[name].copy_(tensor)
        self._offloaded.unlink()
        self._offloaded = None

    @rollout.hookimpl
    def close(self):
        self.engine.close()
        if self._offloaded is not None:
            self._offloaded.unlink(missing_ok=True)
        self.model = None
