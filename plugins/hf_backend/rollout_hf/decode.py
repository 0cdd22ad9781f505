"""The decode loop: left-padded prompts, one forward pass per step with a KV cache."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from rollout import Result, TokenLogprob
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
    tokens: list[int] = field(default_factory=list)
    token_logprobs: list[float] = field(default_factory=list)
    top: list[tuple[TokenLogprob, ...]] = field(default_factory=list)
    finish: str | None = None
    text: str | None = None  # set when a stop string cut it

    def push(self, token: int, logprobs: torch.Tensor | None, tokenizer) -> None:
        self.tokens.append(token)
        if logprobs is not None:
            self.token_logprobs.append(float(logprobs[token]))
            if self.logprobs:
                values, ids = logprobs.topk(self.logprobs)
                self.top.append(tuple(TokenLogprob(int(i), float(v))
                                      for i, v in zip(ids.tolist(), values.tolist())))
        if token in self.stop_ids:
            self.finish = "stop"
        elif self.stop and self._cut_at_stop_string(tokenizer):
            self.finish = "stop"
        elif len(self.tokens) >= self.max_new:
            self.finish = "length"

    def _cut_at_stop_string(self, tokenizer) -> bool:
        text = tokenizer.decode(self.tokens, skip_special_tokens=True)
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        if hits:
            self.text = text[: min(hits)]
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
                 aborted: set[str]) -> None:
    """Generate for `rows` in place until each one stops, hits its limit or is aborted."""
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
    while live:
        out = model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                    past_key_values=cache, use_cache=True, logits_to_keep=1)
        logits = out.logits[:, -1, :].float()
        chosen = choose(logits, *_params(live, device), [r.generator for r in live]).tolist()
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
            live = [live[i] for i in keep]
            chosen = [chosen[i] for i in keep]
        input_ids = torch.tensor(chosen, device=device)[:, None]
        mask = torch.cat([mask, mask.new_ones(len(live), 1)], dim=-1)
        positions = positions[:, -1:] + 1


def _params(rows: list[Row], device: torch.device) -> tuple[torch.Tensor, ...]:
    return (torch.tensor([r.temperature for r in rows], device=device),
            torch.tensor([r.top_k for r in rows], device=device),
            torch.tensor([r.top_p for r in rows], device=device))
