"""Sampling in PyTorch with the contract's meaning of every `SamplingParams` field, for a
backend whose engine hands it logits (the HF backend and the example backend use it):

- `rows_for` makes one `Row` per sample of a request: its parameters, seeded generator,
  grammar matcher, and the rule that ends it (`Row.push`: stop tokens, stop strings,
  grammar end, length);
- `LogitsProcessor` applies the grammar mask, logit bias, the min_tokens ban and the
  penalties to a batch of rows, each with its own values (docs/sampling.md's order);
- `next_tokens` chooses each row's token (greedy, or temperature, min_p, top-k and top-p
  from the row's own generator) and reads its logprob and top logprobs (raw or processed)
  and the set it was drawn from;
- `Grammars` compiles structured outputs with xgrammar (imported on first use).

This package needs torch, which such a backend has; the rest of the kit does not.
"""

from __future__ import annotations

import random

import torch

from rollout.contract.schemas import Request
from rollout.kit.sampler.choose import choose, sampled_from
from rollout.kit.sampler.grammars import Grammars
from rollout.kit.sampler.processors import LogitsProcessor, uses_processing
from rollout.kit.sampler.row import Row

__all__ = ["Grammars", "LogitsProcessor", "Row", "choose", "next_tokens", "rows_for",
           "uses_processing"]


def rows_for(request: Request, prompt: list[int], *, owner: object, eos_ids: frozenset[int],
             max_model_len: int, device: torch.device, grammars: Grammars | None) -> list[Row]:
    """One Row per sample of `request`. Compiling a grammar may take a while: call this off
    the event loop when the request has `structured_outputs`."""
    s = request.sampling
    grammar = None if s.structured_outputs is None else grammars.compile(s.structured_outputs)
    limit = min(s.max_tokens, max_model_len - len(prompt))
    if s.trace_decode_token_ids:
        limit = min(limit, len(s.trace_decode_token_ids))
    rows = []
    for index in range(s.n):
        generator = None
        if not s.greedy:
            seed = random.getrandbits(63) if s.seed is None else hash((s.seed, index)) % 2**63
            generator = torch.Generator(device).manual_seed(seed)
        rows.append(Row(
            owner=owner, index=index, prompt=list(prompt),
            temperature=s.temperature, top_p=s.top_p, top_k=s.top_k or 0,
            max_new=limit,
            # (A trace ends the sample, not an EOS in it: the schema refused stop tokens.)
            stop_ids=frozenset(s.stop_token_ids) | (
                frozenset() if s.ignore_eos or s.trace_decode_token_ids else eos_ids),
            stop=s.stop, logprobs=s.logprobs, generator=generator,
            processed=s.logprobs_mode == "processed", mask=s.return_sampling_mask,
            routing=[] if s.return_routed_experts else None, trace=s.trace_decode_token_ids,
            alone=s.batch_invariant,
            repetition_penalty=s.repetition_penalty, presence_penalty=s.presence_penalty,
            frequency_penalty=s.frequency_penalty, min_p=s.min_p, min_tokens=s.min_tokens,
            logit_bias=dict(s.logit_bias), adapter=request.adapter,
            matcher=None if grammar is None else grammars.matcher(grammar)))
    return rows


def next_tokens(rows: list[Row], logits: torch.Tensor, processor: LogitsProcessor | None):
    """Every row's next token (a tensor), and per row its logprob, its top logprobs as
    (token id, logprob) pairs and the ids it was drawn from (each None where the row did
    not ask). `logits` are the raw next-token logits [rows, vocab]; `processor` is None
    when no row uses one."""
    scores, min_p = logits, None
    if processor is not None:
        processor.constrain(logits)  # before the logprobs: they see the grammar
        scores, min_p = processor.process(logits), processor.min_p
    device = logits.device
    temperature = torch.tensor([r.temperature for r in rows], device=device)
    top_k = torch.tensor([r.top_k for r in rows], device=device)
    top_p = torch.tensor([r.top_p for r in rows], device=device)
    drawn = chosen = choose(scores, temperature, top_k, top_p, [r.generator for r in rows],
                            min_p)
    traced = [i for i, r in enumerate(rows) if r.trace is not None]
    if traced:  # trace replay: the given token in place of the draw, scored as if drawn
        chosen = drawn.clone()
        chosen[traced] = torch.tensor([rows[i].trace[len(rows[i].tokens)] for i in traced],
                                      device=device)
    if processor is not None:
        processor.advance(chosen)

    # What rows asking for processed logprobs or masks drew from, computed once for both.
    masks: list = [None] * len(rows)
    asked = [i for i, r in enumerate(rows) if r.mask or (r.processed and r.logprobs is not None)]
    if asked:
        index = torch.tensor(asked, device=device)
        drawn_logprobs, kept = sampled_from(scores[index], temperature[index], top_k[index],
                                            top_p[index], None if min_p is None else min_p[index])
        for j, i in enumerate(asked):
            if rows[i].mask:
                masks[i] = (int(drawn[i]),) if kept[j] is None else tuple(kept[j].tolist())
    logprobs: list = [None] * len(rows)
    tops: list = [None] * len(rows)
    want = [i for i, r in enumerate(rows) if r.logprobs is not None]
    if want:
        index = torch.tensor(want, device=device)
        measured = logits[index].log_softmax(dim=-1)
        processed = [j for j, i in enumerate(want) if rows[i].processed]
        if processed:  # (the distribution each was drawn from: docs/sampling.md)
            measured[processed] = drawn_logprobs[[asked.index(want[j]) for j in processed]]
        picked = measured.gather(1, chosen[index][:, None])[:, 0].tolist()
        k = max(rows[i].logprobs for i in want)
        if k:
            values, top_ids = (t.tolist() for t in measured.topk(k))
        for j, i in enumerate(want):
            logprobs[i] = picked[j]
            if rows[i].logprobs:
                tops[i] = list(zip(top_ids[j][: rows[i].logprobs],
                                   values[j][: rows[i].logprobs]))
    return chosen, logprobs, tops, masks
