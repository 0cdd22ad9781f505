"""Structured outputs: xgrammar grammars, compiled once per backend, matched once per row.

xgrammar is imported on the first constrained request, so a backend that never sees one
does not pay for it.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict

import torch

from rollout.contract.errors import InvalidRequestError
from rollout.contract.schemas import StructuredOutputs
from rollout.kit.structured import choice_grammar, structural_tag_grammar

ALLOWED = {
    "regex": "a regular expression that xgrammar can compile",
    "json": "a JSON schema that xgrammar supports",
    "choice": "a list of strings",
    "grammar": "EBNF in xgrammar's GBNF dialect, with a `root` rule",
    "structural_tag": "xgrammar's structural tag format",
}
# xgrammar's messages start with "[time] /path/file.cc:line: "; the rest is what matters.
_CPP_PREFIX = re.compile(r"^\[[^\]]*\]\s+\S+:\d+:\s*")


class Grammars:
    """Compiles a request's `structured_outputs` and hands out one matcher per row."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids, cache_size: int = 64):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_ids = sorted(stop_ids)
        self.cache_size = cache_size
        self._compiler = None
        self._cache: OrderedDict = OrderedDict()  # (kind, value) -> CompiledGrammar, LRU
        self._lock = threading.Lock()  # requests compile on worker threads, several at once

    def compile(self, structured: StructuredOutputs):
        """The compiled grammar, or the request's InvalidRequestError naming the field."""
        kind = structured.kind
        value = getattr(structured, kind)
        field = f"sampling.structured_outputs.{kind}"
        try:
            key = (kind, json.dumps(value, sort_keys=True) if isinstance(value, dict) else value)
            with self._lock:
                if key in self._cache:
                    self._cache.move_to_end(key)
                    return self._cache[key]
                compiled = self._compile(kind, value)
                self._cache[key] = compiled
                if len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
                return compiled
        except (RuntimeError, ValueError, TypeError) as exc:
            message = _CPP_PREFIX.sub("", str(exc).strip()).splitlines()[0] if str(exc) else ""
            raise InvalidRequestError(field, message or type(exc).__name__,
                                      ALLOWED[kind]) from None

    def matcher(self, compiled):
        import xgrammar

        return xgrammar.GrammarMatcher(compiled)

    def _compile(self, kind: str, value):
        compiler = self._get_compiler()
        if kind == "regex":
            return compiler.compile_regex(value)
        if kind == "json":
            # Compact JSON, no whitespace at all: with any whitespace allowed a weak model loops
            # on it, and xgrammar's default separators are ", " and ": ".
            return compiler.compile_json_schema(json.dumps(value), any_whitespace=False,
                                               separators=(",", ":"))
        if kind == "choice":
            return compiler.compile_grammar(choice_grammar(value))
        if kind == "structural_tag":
            return compiler.compile_grammar(structural_tag_grammar(value))
        return compiler.compile_grammar(value)

    def _get_compiler(self):
        if self._compiler is None:
            import xgrammar

            # vocab_size is the model's (embedding rows, often padded past the tokenizer);
            # the stop ids are the backend's EOS ids, the only tokens the grammar's end allows.
            info = xgrammar.TokenizerInfo.from_huggingface(
                self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_ids or None)
            self._compiler = xgrammar.GrammarCompiler(info)
        return self._compiler


def allowed_tokens(matchers, vocab: int, device: torch.device) -> torch.Tensor:
    """A bool [len(matchers), vocab] mask of the tokens each matcher allows next.

    The packed bitmask (32 tokens per int32) is filled on CPU and unpacked with plain
    tensor ops, so it works on any device without xgrammar's kernels.
    """
    import xgrammar

    bitmask = xgrammar.allocate_token_bitmask(len(matchers), vocab)
    for i, matcher in enumerate(matchers):
        matcher.fill_next_token_bitmask(bitmask, i)
    shifts = torch.arange(32, dtype=torch.int32, device=device)
    bits = (bitmask.to(device)[:, :, None] >> shifts) & 1
    return bits.view(len(matchers), -1)[:, :vocab].bool()
