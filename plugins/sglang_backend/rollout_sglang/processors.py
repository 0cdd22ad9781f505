"""A custom logit processor that makes SGLang's repetition penalty cover the prompt.

SGLang's penalizer counts the output's tokens only (BatchedRepetitionPenalizer); rollout's
definition, like vLLM's, covers every token seen in the prompt or the output. This adds the
prompt's tokens not yet in the output, with the same formula, so each seen token is
penalised once. It runs in SGLang's scheduler (`--enable-custom-logit-processor`), which
imports it from this installed package; `__req__` is the request SGLang hands to custom
processors.
"""

from __future__ import annotations

import torch
from sglang.srt.sampling.custom_logit_processor import CustomLogitProcessor


class PromptRepetitionPenalty(CustomLogitProcessor):
    def __call__(self, logits: torch.Tensor, custom_param_list=None) -> torch.Tensor:
        for row, params in enumerate(custom_param_list or ()):
            penalty = params["repetition_penalty"]
            request = params["__req__"]
            if "_prompt" not in params:  # the same dict every step: computed once
                params["_prompt"] = set(request.origin_input_ids)
            ids = params["_prompt"].difference(request.output_ids)
            if not ids:
                continue
            index = torch.tensor(sorted(ids), device=logits.device)
            z = logits[row, index]
            logits[row, index] = torch.where(z > 0, z / penalty, z * penalty)
        return logits


def prompt_penalty_fields(repetition_penalty: float) -> dict:
    """What a generate body carries for the prompt's share of the repetition penalty."""
    if repetition_penalty == 1.0:
        return {}
    return {"custom_logit_processor": PromptRepetitionPenalty.to_str(),
            "custom_params": {"repetition_penalty": repetition_penalty}}
