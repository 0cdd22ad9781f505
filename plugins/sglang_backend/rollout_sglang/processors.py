"""Rollout's penalties for SGLang, as a custom logit processor.

SGLang's own penalizers differ from the definition every backend shares (vLLM's): its
repetition penalty covers the output only, not the prompt, and it applies its penalties
before the logit bias, where vLLM applies them after. This processor applies the
repetition penalty over the prompt and the output, then the frequency and presence
penalties over the output, to logits that already carry the bias and the min_new_tokens
ban, so the order and the formulas are docs/sampling.md's. It runs in SGLang's scheduler
(`--enable-custom-logit-processor`), which imports it from this installed package, and
reads the request from the `__req__` that SGLang hands custom processors. The request's
output must be up to date when it runs: SGLang's overlap scheduler hands it one token late.
"""

from __future__ import annotations

from collections import Counter

import torch
from sglang.srt.sampling.custom_logit_processor import CustomLogitProcessor


class Penalties(CustomLogitProcessor):
    def __call__(self, logits: torch.Tensor, custom_param_list=None) -> torch.Tensor:
        for row, params in enumerate(custom_param_list or ()):
            request = params["__req__"]
            # The same dict every step: the counts grow by the tokens made since the last.
            state = params.setdefault("_state", {"prompt": set(request.origin_input_ids),
                                                 "counts": Counter(), "done": 0})
            counts = state["counts"]
            counts.update(request.output_ids[state["done"]:])
            state["done"] = len(request.output_ids)
            r = params["repetition_penalty"]
            if r != 1.0:
                ids = torch.tensor(sorted(state["prompt"] | counts.keys()), device=logits.device)
                z = logits[row, ids]
                logits[row, ids] = torch.where(z > 0, z / r, z * r)
            if counts:
                ids = torch.tensor(list(counts), device=logits.device)
                made = torch.tensor(list(counts.values()), dtype=logits.dtype,
                                    device=logits.device)
                logits[row, ids] -= (params["frequency_penalty"] * made
                                     + params["presence_penalty"])
        return logits
