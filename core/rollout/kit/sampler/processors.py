"""The logits a token is chosen from, for what goes beyond temperature, top-k and top-p.

The order is vLLM's (its v1 sampler), so that a request means the same on every backend:

1. the structured-output mask: tokens that would break the row's grammar get -inf. The
   returned logprobs are the log_softmax of this (vLLM's default "raw_logprobs" are taken
   after its grammar bitmask and before everything else);
2. logit_bias, and the min_tokens ban (EOS and stop token ids get -inf);
3. the repetition penalty over the tokens of the prompt and the output, then the frequency
   and presence penalties over those of the output.

Greedy rows take the argmax of the result; sampled rows then go through temperature,
min_p, top-k and top-p (choose.py).

Every per-row tensor here exists only when some row of the batch uses its feature, and a
batch that uses none gets no processor at all: it costs nothing more than before. Rows of
one batch may be at different steps (rows join a running batch): all state is per row, and
built from what each row has generated so far, so a backend rebuilds it when rows join.
"""

from __future__ import annotations

import torch

from rollout.kit.sampler.grammars import allowed_tokens


def uses_processing(row) -> bool:
    return (row.matcher is not None or bool(row.logit_bias) or row.min_tokens > 0
            or row.min_p > 0 or _penalized(row))


def _penalized(row) -> bool:
    return (row.repetition_penalty != 1 or row.presence_penalty != 0
            or row.frequency_penalty != 0)


class LogitsProcessor:
    """Per-row state of one batch, aligned with its rows (`select` follows drops)."""

    def __init__(self, rows, vocab: int, grammar_vocab: int, device: torch.device):
        """`vocab` is the logits' width, `grammar_vocab` the one the grammars were compiled
        for (the embedding rows); they differ only for an lm_head wider than the embeddings."""
        n = len(rows)
        self.vocab, self.grammar_vocab = vocab, grammar_vocab
        self.matchers = [r.matcher for r in rows]
        # Tokens each row must still make before EOS, stop tokens or stop strings may end it.
        self.held = [max(0, r.min_tokens - len(r.tokens)) for r in rows]
        self.min_p = self.bias = self.ban = self.counts = None
        if any(r.min_p > 0 for r in rows):
            self.min_p = torch.tensor([float(r.min_p) for r in rows], device=device)
        if any(r.logit_bias for r in rows):
            self.bias = torch.zeros(n, vocab, device=device)
            for i, r in enumerate(rows):
                if r.logit_bias:
                    ids = torch.tensor(list(r.logit_bias), device=device)
                    self.bias[i, ids] = torch.tensor([float(b) for b in r.logit_bias.values()],
                                                     device=device)
        if any(self.held):
            self.ban = torch.zeros(n, vocab, dtype=torch.bool, device=device)
            for i, r in enumerate(rows):
                ids = [t for t in r.stop_ids if t < vocab]  # a larger id never comes
                if self.held[i] and ids:
                    self.ban[i, ids] = True
        if any(_penalized(r) for r in rows):
            # Dense [rows, vocab] counts: one scatter per step, no Python per token.
            self.rep = torch.tensor([float(r.repetition_penalty) for r in rows], device=device)
            self.freq = torch.tensor([float(r.frequency_penalty) for r in rows], device=device)
            self.pres = torch.tensor([float(r.presence_penalty) for r in rows], device=device)
            self.counts = torch.zeros(n, vocab, device=device)  # occurrences in the output
            self.seen = torch.zeros(n, vocab, dtype=torch.bool, device=device)  # prompt | output
            # From what each row has so far: a row that joined late has output already.
            prompt_rows, prompt_ids = _flat([r.prompt for r in rows], device)
            self.seen[prompt_rows, prompt_ids] = True
            output_rows, output_ids = _flat([r.tokens for r in rows], device)
            self.counts.index_put_((output_rows, output_ids),
                                   torch.ones(len(output_ids), device=device), accumulate=True)
            self.seen |= self.counts > 0

    def constrain(self, logits: torch.Tensor) -> None:
        """Set the tokens each constrained row's grammar forbids to -inf, in place."""
        rows = [i for i, m in enumerate(self.matchers) if m is not None]
        if not rows:
            return
        allowed = allowed_tokens([self.matchers[i] for i in rows], self.grammar_vocab,
                                 logits.device)
        if self.vocab != self.grammar_vocab:  # tokens the grammar never heard of: forbidden
            wide = allowed.new_zeros(len(rows), self.vocab)
            width = min(self.vocab, self.grammar_vocab)
            wide[:, :width] = allowed[:, :width]
            allowed = wide
        index = torch.tensor(rows, device=logits.device)
        logits[index] = logits[index].masked_fill(~allowed, float("-inf"))

    def process(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits to choose from this step; `logits` is kept as it is for the logprobs.
        A -inf stays -inf through every stage."""
        z = logits
        if self.bias is not None:
            z = z + self.bias
        if self.ban is not None and any(self.held):
            holding = torch.tensor([h > 0 for h in self.held], device=z.device)
            banned = z.masked_fill(self.ban & holding[:, None], float("-inf"))
            # A grammar that allows only EOS here wins over min_tokens: a row with nothing
            # left to choose keeps EOS.
            z = torch.where(banned.isneginf().all(dim=-1, keepdim=True), z, banned)
        if self.counts is not None:
            r = self.rep[:, None]
            z = torch.where(self.seen, torch.where(z > 0, z / r, z * r), z)
            z = z - self.freq[:, None] * self.counts - self.pres[:, None] * (self.counts > 0)
        return z

    def advance(self, chosen: torch.Tensor) -> None:
        """Count the tokens just chosen (the matchers advance in `Row.push`)."""
        if self.ban is not None:
            self.held = [max(0, h - 1) for h in self.held]
        if self.counts is not None:
            rows = torch.arange(len(chosen), device=chosen.device)
            self.counts[rows, chosen] += 1
            self.seen[rows, chosen] = True

    def select(self, keep: list[int], index: torch.Tensor) -> None:
        """Keep only the rows `keep` (as `index` on the device), in that order."""
        self.matchers = [self.matchers[i] for i in keep]
        self.held = [self.held[i] for i in keep]
        for name in ("min_p", "bias", "ban", "counts", "seen", "rep", "freq", "pres"):
            value = getattr(self, name, None)
            if value is not None:
                setattr(self, name, value[index])


def _flat(lists: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, token id) of every token of `lists`, as two long tensors."""
    rows = [i for i, ids in enumerate(lists) for _ in ids]
    return (torch.tensor(rows, dtype=torch.long, device=device),
            torch.tensor([t for ids in lists for t in ids], dtype=torch.long, device=device))
