"""TRL's `GRPOTrainer` sampling through any `rollout` backend or `rollout serve` pool.

TRL's extension point for this is `rollout_func`: the trainer hands it each batch of prompts
and takes back prompt ids, completion ids and the sampled tokens' logprobs. `RolloutFunc`
is such a function. Before sampling at a new optimizer step it pushes the trainer's weights
through this project's transports (in process, shared memory or gloo to replicas), so every
completion comes from the current policy:

    sampler = rollout.load_backend("vllm", "my-model")  # or rollout.ServedRollout.start/connect
    trainer = GRPOTrainer(model="my-model", reward_funcs=..., args=GRPOConfig(...),
                          train_dataset=..., rollout_func=RolloutFunc(sampler))

With `peft_config` (LoRA), only the adapter goes to the sampler each step, as `load_adapter`;
the sampler then needs adapters (HF, or vLLM with `engine_args={"enable_lora": True}`).

The sampling fields come from the trainer's config (temperature, top_p, top_k, min_p,
repetition_penalty, max_completion_length, generation_kwargs, vllm_structured_outputs_regex);
prompts are tokenized exactly as TRL tokenizes them (its chat template, tools and
chat_template_kwargs), so `prompt_ids` are the trainer's own.
"""

from __future__ import annotations

import itertools
from typing import Any

from rollout.contract.errors import InvalidRequestError, UnsupportedError
from rollout.contract.sampler import Sampler
from rollout.weights.lora import pack_adapter


class RolloutFunc:
    """A `rollout_func` for TRL's GRPOTrainer that samples from any `rollout.Sampler` (a
    `Rollout` or a `ServedRollout`) and keeps its weights at the trainer's. A trainer with
    `peft_config` trains a LoRA adapter: only the adapter is pushed (`load_adapter`, under
    the name `adapter`), and every request samples with it.

    `push_weights=False` leaves the weights alone (a sampler fed some other way)."""

    def __init__(self, sampler: Sampler, *, push_weights: bool = True,
                 adapter: str = "policy"):
        self.sampler = sampler
        self.push_weights = push_weights
        self.adapter = adapter
        self._adapted = False  # the trainer trains a LoRA adapter (known at the first push)
        self._pushed_step: int | None = None

    def __call__(self, prompts: list, trainer: Any) -> dict:
        if self.push_weights:
            self.sync_weights(trainer)
        prompt_ids = tokenize(prompts, trainer)
        sampling = sampling_fields(trainer)
        # TRL repeats each prompt num_generations times in a row; one request with n copies
        # samples the group at once and shares its prefix.
        adapter = self.adapter if self._adapted else None
        requests = [{"prompt_token_ids": list(ids), "adapter": adapter,
                     "sampling": {**sampling, "n": len(list(run))}}
                    for ids, run in itertools.groupby(prompt_ids, key=tuple)]
        results = [r for c in self.sampler.generate(requests) for r in c.unwrap()]
        return {"prompt_ids": [list(r.prompt_token_ids) for r in results],
                "completion_ids": [list(r.token_ids) for r in results],
                "logprobs": [list(r.logprobs) for r in results]}

    def sync_weights(self, trainer: Any) -> None:
        """Push the trainer's weights (or its LoRA adapter) once per optimizer step (the
        first call pushes too: the sampler may hold other weights than the trainer's)."""
        step = trainer.state.global_step
        if step == self._pushed_step:
            return
        accelerator = trainer.accelerator
        model = accelerator.unwrap_model(trainer.model)
        self._adapted = hasattr(model, "peft_config")
        if accelerator.is_main_process:
            if self._adapted:
                # Packed only where nothing wraps or shards the model (one process, no
                # DeepSpeed or FSDP): moving its parameters is then safe.
                packable = accelerator.num_processes == 1 and trainer.model is model
                self._push_adapter(model, step, packable)
            else:
                self.sampler.update_weights(model.named_parameters(), version=step)
        accelerator.wait_for_everyone()  # no process samples before the push is in
        self._pushed_step = step

    def _push_adapter(self, model: Any, step: int, packable: bool) -> None:
        """The trained adapter's tensors (megabytes) instead of the merged model; the
        sampler's base weights are the model's own, which LoRA training leaves frozen.
        `packable`: the adapter may be kept in one block of memory, which a sampler in this
        process copies as one (`rollout.weights.lora.pack_adapter`)."""
        from peft import get_peft_model_state_dict

        name = model.active_adapter
        if packable:
            try:
                pack_adapter(model, name)
            except ValueError:
                pass  # parameters on several devices or of several dtypes: pushed as they are
        tensors = get_peft_model_state_dict(model, adapter_name=name)
        self.sampler.load_adapter(self.adapter, ((k, t.detach()) for k, t in tensors.items()),
                                  model.peft_config[name].to_dict(), version=step)


def tokenize(prompts: list, trainer: Any) -> list[list[int]]:
    """The prompts' token ids as TRL makes them: the chat template with a generation prompt
    for conversations, the plain tokenizer for text."""
    processing = trainer.processing_class
    if isinstance(prompts[0], str):
        return processing(text=prompts)["input_ids"]
    if any(isinstance(m.get("content"), list) and any(p.get("type") == "image"
                                                      for p in m["content"])
           for prompt in prompts for m in prompt):
        raise UnsupportedError("images", "rollout.integrations.trl sends token ids, not yet "
                               "images")
    return processing.apply_chat_template(
        conversation=prompts, tools=getattr(trainer, "tools", None) or None,
        chat_template=getattr(trainer, "chat_template", None), add_generation_prompt=True,
        tokenize=True, return_dict=True,
        **(getattr(trainer, "chat_template_kwargs", None) or {}))["input_ids"]


def sampling_fields(trainer: Any) -> dict:
    """`rollout` sampling fields from the trainer's config, with TRL's meanings: top_k 0 is no
    limit, min_p None is none, and generation_kwargs override the rest. A key `rollout` does
    not know is refused by the request's validation, never dropped."""
    args = trainer.args
    if args.max_completion_length is None:  # TRL then runs to the model's own limit
        raise InvalidRequestError("max_completion_length", "None: no limit is not supported",
                                  "a number of tokens")
    fields = {"temperature": args.temperature, "top_p": args.top_p,
              "top_k": args.top_k if args.top_k and args.top_k > 0 else None,
              "min_p": args.min_p or 0.0, "repetition_penalty": args.repetition_penalty,
              "max_tokens": args.max_completion_length, "logprobs": 0}
    regex = getattr(args, "vllm_structured_outputs_regex", None)
    if regex:
        fields["structured_outputs"] = {"regex": regex}
    fields.update(args.generation_kwargs or {})
    return fields
