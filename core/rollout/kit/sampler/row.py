"""One sample being generated (`Row`): its sampling parameters, its tokens so far, and when
it ends. The text of a sample is the core's; a row only decodes to know whether a stop
string has appeared (the core then cuts the text at the same place)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rollout.kit.text import first_stop


@dataclass(eq=False)
class Row:
    """One sample of one request, and what it has generated so far."""

    owner: object  # what the backend knows the row's request by (the HF backend: its Job)
    index: int  # which of the request's n samples
    prompt: list[int]
    temperature: float
    top_p: float
    top_k: int
    max_new: int
    stop_ids: frozenset[int]
    stop: tuple[str, ...]
    logprobs: int | None
    generator: torch.Generator | None
    processed: bool = False  # logprobs of the processed distribution (logprobs_mode)
    mask: bool = False  # return the ids each token was drawn from (return_sampling_mask)
    # Per token run through the model, per MoE layer, its experts (return_routed_experts);
    # None where not asked. The backend appends after each forward pass.
    routing: list | None = None
    trace: tuple[int, ...] | None = None  # the tokens to take in place of draws (trace replay)
    alone: bool = False  # run in a batch of its own (sampling.batch_invariant)
    # What processors.py applies (the defaults change nothing and cost nothing).
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: dict[int, float] = field(default_factory=dict)
    matcher: object | None = None  # an xgrammar GrammarMatcher of this row alone
    adapter: str | None = None  # the LoRA adapter its forward passes take (Request.adapter)
    tokens: list[int] = field(default_factory=list)
    finish: str | None = None
    _text_len: int | None = None  # length of the text at the last stop-string check

    def push(self, token: int, tokenizer) -> str | None:
        """Add the chosen token; returns the finish reason if it ends the sample."""
        self.tokens.append(token)
        if self.matcher is not None and not self._advance_matcher(token):
            self.finish = "stop"  # the grammar is complete (its last token is EOS)
        elif token in self.stop_ids:
            self.finish = "stop"
        elif (self.stop and len(self.tokens) > self.min_tokens  # vLLM: first min_tokens
              and self._at_stop_string(tokenizer)):               # tokens cannot stop it
            self.finish = "stop"
        elif len(self.tokens) >= self.max_new:
            self.finish = "length"
        return self.finish

    def _advance_matcher(self, token: int) -> bool:
        """Whether the row may go on under its grammar. The mask only lets through tokens
        the matcher accepts, so a refusal cannot happen; if it did, the row ends there."""
        return self.matcher.accept_token(token) and not self.matcher.is_terminated()

    def _at_stop_string(self, tokenizer) -> bool:
        text = tokenizer.decode(self.tokens, skip_special_tokens=True)
        if self._text_len is None:  # first check (token 1, or min_tokens + 1): text before it
            self._text_len = len(tokenizer.decode(self.tokens[:-1], skip_special_tokens=True))
        # Look only where this token's text can complete a stop string (the core's rule, in
        # rollout.kit.text), so one within the first min_tokens tokens never ends the sample.
        after, self._text_len = self._text_len, len(text)
        return first_stop(text, self.stop, after) is not None
