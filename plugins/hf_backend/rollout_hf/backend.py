"""HFBackend: batched generation with transformers, behind the rollout contract.

Its own decode loop (not `model.generate`) lets every row of a batch carry its own
sampling parameters, seed, stop strings and length limit, and lets `abort` end single rows.
Penalties, logit bias, min_p and min_tokens are in processors.py (in vLLM's order), and
structured outputs in grammars.py (xgrammar, one matcher per row).
"""

from __future__ import annotations

import random
import tempfile
import threading
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import rollout
from rollout import Capabilities, InvalidRequestError, Request
from rollout.kit.buckets import unpack
from rollout.kit.prompts import PromptEncoder

from rollout_hf.decode import Row, decode_batch
from rollout_hf.grammars import Grammars


class HFBackend:
    def __init__(self, model: str, device: str | None = None, dtype: str = "auto",
                 batch_size: int = 32, max_model_len: int | None = None):
        if not isinstance(batch_size, int) or batch_size < 1:
            raise InvalidRequestError("batch_size", f"got {batch_size!r}", "an integer >= 1")
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        torch_dtype = dtype if dtype == "auto" else getattr(torch, dtype)
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=torch_dtype)
        self.model.to(self.device).eval()
        self.batch_size = batch_size
        config = self.model.config
        self.max_model_len = max_model_len or getattr(config, "max_position_embeddings", 2048)
        self.vocab_size = self.model.get_input_embeddings().num_embeddings
        eos = self.model.generation_config.eos_token_id
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        if self.tokenizer.eos_token_id is not None:
            eos.append(self.tokenizer.eos_token_id)
        self.eos_ids = frozenset(eos)
        self.prompts = PromptEncoder(self.tokenizer, self.vocab_size, self.max_model_len)
        self.grammars = Grammars(self.tokenizer, self.vocab_size, self.eos_ids)  # compiles lazily
        self.pad_id = self.tokenizer.pad_token_id
        if self.pad_id is None:
            self.pad_id = min(self.eos_ids) if self.eos_ids else 0
        self._run_lock = threading.Lock()
        self._in_flight: set[str] = set()
        self._aborted: set[str] = set()
        self._offloaded: Path | None = None

    @classmethod
    def describe_capabilities(cls) -> Capabilities:
        return Capabilities(unsupported={"images": "the HF backend serves text-only models"})

    @rollout.hookimpl
    def capabilities(self) -> Capabilities:
        return self.describe_capabilities()

    # --- generation ---------------------------------------------------------------------

    @rollout.hookimpl
    def generate(self, requests):
        outputs: list = [None] * len(requests)
        rows: list[Row] = []
        for i, request in enumerate(requests):
            structured = request.sampling.structured_outputs
            try:
                prompt = self.prompts.encode(request)
                grammar = None if structured is None else self.grammars.compile(structured)
            except InvalidRequestError as exc:
                outputs[i] = exc
                continue
            rows += [self._row(i, request, prompt, k, grammar)
                     for k in range(request.sampling.n)]
        ids = {requests[row.slot].id for row in rows}
        self._in_flight |= ids  # before the lock, so a queued call can be aborted too
        try:
            with self._run_lock, torch.inference_mode():
                rows.sort(key=lambda r: len(r.prompt))  # less padding per batch
                for start in range(0, len(rows), self.batch_size):
                    decode_batch(self.model, self.tokenizer, rows[start : start + self.batch_size],
                                 self.pad_id, self.device, self._aborted, self.vocab_size)
        finally:
            self._in_flight -= ids
            self._aborted -= ids
        for row in rows:
            if outputs[row.slot] is None:
                outputs[row.slot] = [None] * requests[row.slot].sampling.n
            outputs[row.slot][row.index] = row.result(self.tokenizer)
        return outputs

    def _row(self, slot: int, request: Request, prompt: list[int], index: int,
             grammar=None) -> Row:
        s = request.sampling
        generator = None
        if not s.greedy:
            seed = random.getrandbits(63) if s.seed is None else hash((s.seed, index)) % 2**63
            generator = torch.Generator(self.device).manual_seed(seed)
        return Row(
            slot=slot, index=index, request_id=request.id, prompt=prompt,
            temperature=s.temperature, top_p=s.top_p, top_k=s.top_k or 0,
            max_new=min(s.max_tokens, self.max_model_len - len(prompt)),
            stop_ids=frozenset(s.stop_token_ids) | (frozenset() if s.ignore_eos else self.eos_ids),
            stop=s.stop, logprobs=s.logprobs, generator=generator,
            repetition_penalty=s.repetition_penalty, presence_penalty=s.presence_penalty,
            frequency_penalty=s.frequency_penalty, min_p=s.min_p, min_tokens=s.min_tokens,
            logit_bias=dict(s.logit_bias), include_stop=s.include_stop_str_in_output,
            matcher=None if grammar is None else self.grammars.matcher(grammar),  # one per row
        )

    @rollout.hookimpl
    def abort(self, request_ids):
        running = set(self._in_flight)
        self._aborted |= running if request_ids is None else running & set(request_ids)

    # --- weights and memory -------------------------------------------------------------

    @rollout.hookimpl
    def update_weights(self, buckets):
        params = dict(self.model.named_parameters(remove_duplicate=False))
        with torch.no_grad():
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
                    params[name].copy_(tensor)

    @rollout.hookimpl
    def release(self, tags):
        if "weights" in tags:
            if self.device.type == "cpu":
                self._offload_to_disk()
            else:
                self.model.to("cpu")
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the KV cache lives only during generate

    @rollout.hookimpl
    def resume(self, tags):
        if "weights" in tags:
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
        if self._offloaded is not None:
            self._offloaded.unlink(missing_ok=True)
        self.model = None
