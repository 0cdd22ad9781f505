"""ExampleBackend: the smallest complete backend, a transformers model behind the contract.

Every request decodes its samples one after another, one token per step, each step one
call on the engine's single thread: requests interleave step by step, and the event loop
never runs the model. The HF backend does the same work with continuous batching.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import rollout
from rollout import Capabilities, Chunk, InvalidRequestError, TokenLogprob
from rollout.weights.buckets import unpack
from rollout.kit.prompts import PromptEncoder
from rollout.kit.sampler import Grammars, LogitsProcessor, next_tokens, rows_for, uses_processing

LIFECYCLE_TIMEOUT_S = 600.0  # how long update_weights waits for the engine's thread


class ExampleBackend:
    def __init__(self, model: str, max_model_len: int | None = None):
        import torch  # heavy imports inside the class: `rollout backends` stays fast
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        self.max_model_len = max_model_len or self.model.config.max_position_embeddings
        self.vocab = self.model.get_input_embeddings().num_embeddings  # what prompts may use
        self.logits_width = self.model.get_output_embeddings().out_features
        eos = self.model.generation_config.eos_token_id
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        self.eos_ids = frozenset(eos + [self.tokenizer.eos_token_id]) - {None}
        self.prompts = PromptEncoder(self.tokenizer, self.vocab, self.max_model_len)
        self.grammars = Grammars(self.tokenizer, self.vocab, self.eos_ids)  # compiles lazily
        self.device = torch.device("cpu")
        # The engine: one thread runs every forward pass, so steps never race each other.
        self.engine = ThreadPoolExecutor(1, thread_name_prefix="rollout-example-engine")

    @classmethod
    def describe_capabilities(cls) -> Capabilities:  # also shown by `rollout backends`
        return Capabilities(unsupported={
            "release": "not in the example (the HF backend shows how to free memory)",
            "images": "the example serves text-only models",
            "prompt_logprobs": "not in the example (the HF backend scores prompts)",
            "sampling_mask": "not in the example (the HF backend returns it)",
            "routed_experts": "the example serves no mixture-of-experts model",
            "keep_kv": "not in the example (the HF backend keeps requests in its engine "
                       "through an update)",
        })

    @rollout.hookimpl
    def capabilities(self):
        return self.describe_capabilities()

    @rollout.hookimpl
    def prompt_encoder(self):
        return self.prompts

    # --- generation: on the engine loop, never blocking it ------------------------------

    @rollout.hookimpl
    async def generate(self, request, prompt_token_ids):
        loop = asyncio.get_running_loop()
        # One Row per sample: its parameters, seed, grammar and stop rule (the kit's).
        rows = await loop.run_in_executor(self.engine, lambda: rows_for(
            request, prompt_token_ids, owner=request.id, eos_ids=self.eos_ids,
            max_model_len=self.max_model_len, device=self.device, grammars=self.grammars))
        for row in rows:
            sample = _Sample(row, LogitsProcessor([row], self.logits_width, self.vocab,
                                                  self.device) if uses_processing(row) else None)
            while row.finish is None:
                # An abort or a timeout cancels this await; a step already queued runs on
                # the engine's thread and is dropped. There is nothing else to clean up.
                token, logprob, top = await loop.run_in_executor(self.engine, self._step, sample)
                yield Chunk(row.index, (token,),
                            logprobs=None if logprob is None else (logprob,),
                            top_logprobs=(tuple(TokenLogprob(i, v) for i, v in top),)
                            if row.logprobs else None,
                            finish_reason=row.finish)

    def _step(self, sample: _Sample) -> tuple[int, float | None, list | None]:
        """One token of one sample, on the engine's thread."""
        torch, row = self.torch, sample.row
        with torch.inference_mode():
            out = self.model(input_ids=torch.tensor([sample.feed]), use_cache=True,
                             past_key_values=sample.cache, logits_to_keep=1)
            chosen, logprobs, tops, _ = next_tokens([row], out.logits[:, -1, :].float(),
                                                    sample.processor)
        token = int(chosen[0])
        sample.cache, sample.feed = out.past_key_values, [token]
        row.push(token, self.tokenizer)  # sets row.finish when the sample ends
        return token, logprobs[0], tops[0]

    # --- weights (from the trainer's thread, while no request runs) ---------------------

    @rollout.hookimpl
    def update_weights(self, buckets):
        params = dict(self.model.named_parameters(remove_duplicate=False))

        def load():
            with self.torch.no_grad():
                for bucket in buckets:
                    named = unpack(bucket)
                    for name, tensor in named:  # check a whole bucket before changing it
                        if name not in params or params[name].shape != tensor.shape:
                            raise InvalidRequestError(
                                "weights", f"{name!r} with shape {tuple(tensor.shape)}",
                                "the model's parameter names and shapes")
                    for name, tensor in named:
                        params[name].copy_(tensor)

        # On the engine's thread, after any step an aborted request left queued there.
        self.engine.submit(load).result(LIFECYCLE_TIMEOUT_S)

    @rollout.hookimpl
    def close(self):
        self.engine.shutdown(wait=True, cancel_futures=True)


class _Sample:
    """One sample's decoding state between steps: its row, logits processor and KV cache."""

    def __init__(self, row, processor):
        self.row, self.processor = row, processor
        self.cache = None
        self.feed = row.prompt  # the tokens the next step runs: the prompt, then one token
