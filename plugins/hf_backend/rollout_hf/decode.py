"""The decode loop: left-padded prompts, one forward pass per step with a KV cache."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from rollout import Result, TokenLogprob
from rollout_hf.processors import LogitsProcessor, uses_processing
from rollout_hf.sampling import choose


@dataclass
class Row:
    """One sample of one request, and what it has generated so far."""

    slot: int
    index: int
    request_id: str
    prompt: list[int]
    temperature: float
    top_p: float
    top_k: int
    max_new: int
    stop_ids: frozenset[int]
    stop: tuple[str, ...]
    logprobs: int | None
    generator: torch.Generator | None
    # What processors.py applies (the defaults change nothing and cost nothing).
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: dict[int, float] = field(default_factory=dict)
    include_stop: bool = False  # include_stop_str_in_output
    matcher: object | None = None  # an xgrammar GrammarMatcher of this row alone
    tokens: list[int] = field(default_factory=list)
    token_logprobs: list[float] = field(default_factory=list)
    top: list[tuple[TokenLogprob, ...]] = field(default_factory=list)
    finish: str | None = None
    text: str | None = None  # set when a stop string cut it
    _text_len: int | None = None  # length of the text at the last stop-string check

    def push(self, token: int, logprobs: torch.Tensor | None, tokenizer) -> None:
        self.tokens.append(token)
        if logprobs is not None:
            self.token_logprobs.append(float(logprobs[token]))
            if self.logprobs:
                values, ids = logprobs.topk(self.logprobs)
                self.top.append(tuple(TokenLogprob(int(i), float(v))
                                      for i, v in zip(ids.tolist(), values.tolist())))
        if self.matcher is not None and not self._advance_matcher(token):
            self.finish = "stop"  # the grammar is complete (its last token is EOS)
        elif token in self.stop_ids:
            self.finish = "stop"
        elif (self.stop and len(self.tokens) > self.min_tokens  # vLLM: first min_tokens
              and self._cut_at_stop_string(tokenizer)):           # tokens cannot stop it
            self.finish = "stop"
        elif len(self.tokens) >= self.max_new:
            self.finish = "length"

    def _advance_matcher(self, token: int) -> bool:
        """Whether the row may go on under its grammar. The mask only lets through tokens
        the matcher accepts, so a refusal cannot happen; if it did, the row ends there."""
        return self.matcher.accept_token(token) and not self.matcher.is_terminated()

    def _cut_at_stop_string(self, tokenizer) -> bool:
        text = tokenizer.decode(self.tokens, skip_special_tokens=True)
        if self._text_len is None:  # first check (token 1, or min_tokens + 1): text before it
            self._text_len = len(tokenizer.decode(self.tokens[:-1], skip_special_tokens=True))
        # Like vLLM, look only where this token's text can complete a stop string, so a stop
        # string within the first min_tokens tokens does not end the sample later; of several,
        # the one that ends first wins (then the first listed).
        start, self._text_len = self._text_len, len(text)
        hits = [(at, s) for s in self.stop
                if (at := text.find(s, max(0, start - len(s) + 1))) >= 0]
        if hits:
            at, s = min(hits, key=lambda hit: hit[0] + len(hit[1]))
            self.text = text[: at + len(s)] if self.include_stop else text[:at]
        return bool(hits)

    def result(self, tokenizer) -> Result:
        text = self.text if self.text is not None else tokenizer.decode(
            self.tokens, skip_special_tokens=True)
        return Result(
            request_id=self.request_id, index=self.index, token_ids=tuple(self.tokens),
            text=text, finish_reason=self.finish or "abort", prompt_tokens=len(self.prompt),
            logprobs=tuple(self.token_logprobs) if self.logprobs is not None else None,
            top_logprobs=tuple(self.top) if self.logprobs else None,
        )


def decode_batch(model, tokenizer, rows: list[Row], pad_id: int, device: torch.device,
                 aborted: set[str], grammar_vocab: int | None = None) -> None:
    """Generate for `rows` in place until each one stops, hits its limit or is aborted.
    `grammar_vocab` is the vocabulary size the rows' grammars were compiled for."""
    for row in rows:
        if row.request_id in aborted:
            row.finish = "abort"
    live = [r for r in rows if not r.finish]
    if not live:
        return
    width = max(len(r.prompt) for r in live)
    input_ids = torch.tensor([[pad_id] * (width - len(r.prompt)) + r.prompt for r in live],
                             device=device)
    mask = torch.tensor([[0] * (width - len(r.prompt)) + [1] * len(r.prompt) for r in live],
                        device=device)
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    cache = DynamicCache()
    # Only a batch with a row that uses penalties, bias, min_p, min_tokens or a grammar
    # gets a processor; it is built at the first step, when the logits' width is known.
    processing = any(uses_processing(r) for r in live)
    processor = None
    step = 0  # tokens generated so far, the same for every live row of the batch
    while live:
        out = model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                    past_key_values=cache, use_cache=True, logits_to_keep=1)
        logits = out.logits[:, -1, :].float()
        scores, min_p = logits, None
        if processing:
            if processor is None:
                processor = LogitsProcessor(live, logits.shape[-1],
                                            grammar_vocab or logits.shape[-1], device)
            processor.constrain(logits)  # before the logprobs: they see the grammar's mask
            scores, min_p = processor.process(logits, step), processor.min_p
        chosen_t = choose(scores, *_params(live, device), [r.generator for r in live], min_p)
        if processor is not None:
            processor.advance(chosen_t)
        chosen = chosen_t.tolist()
        step += 1
        logprobs = logits.log_softmax(dim=-1) if any(
            r.logprobs is not None for r in live) else None
        for i, row in enumerate(live):
            if row.request_id in aborted:
                row.finish = "abort"
            else:
                row.push(chosen[i], None if logprobs is None or row.logprobs is None
                         else logprobs[i], tokenizer)
        keep = [i for i, row in enumerate(live) if not row.finish]
        if not keep:
            break
        if len(keep) < len(live):  # drop finished rows so they cost nothing more
            index = torch.tensor(keep, device=device, dtype=torch.long)
            cache.reorder_cache(index)
            mask, positions = mask[index], positions[index]
            if processor is not None:
                processor.select(keep, index)
            live = [live[i] for i in keep]
            chosen = [chosen[i] for i in keep]
        input_ids = torch.tensor(chosen, device=device)[:, None]
        mask = torch.cat([mask, mask.new_ones(len(live), 1)], dim=-1)
        positions = positions[:, -1:] + 1


def _params(rows: list[Row], device: torch.device) -> tuple[torch.Tensor, ...]:
    return (torch.tensor([r.temperature for r in rows], device=device),
            torch.tensor([r.top_k for r in rows], device=device),
            torch.tensor([r.top_p for r in rows], device=device))
