"""A sample's text from its tokens: stop strings, and text streamed as tokens arrive.

The core decodes every backend's tokens here, so texts and stop-string cuts are the same
whatever the engine. A stop string counts only where it ends in text made after the first
`min_tokens` tokens (vLLM's rule); of several, the one that ends first wins.
"""

from __future__ import annotations

from rollout.contract.schemas import SamplingParams


def first_stop(text: str, stops, after: int = 0) -> tuple[int, int] | None:
    """(start, end) of the stop string that ends first in `text`, among the matches that
    end past `after` characters; None without one."""
    found = []
    for stop in stops:
        at = text.find(stop, max(0, after - len(stop) + 1))
        if at >= 0:
            found.append((at + len(stop), at))
    if not found:
        return None
    end, start = min(found)
    return start, end


def cut(text: str, s: SamplingParams, held: int = 0) -> tuple[str, bool]:
    """The text up to its first stop string (kept or not, as asked), and whether one
    matched. `held` is the length of the first min_tokens tokens' text."""
    match = first_stop(text, s.stop, held) if s.stop else None
    if match is None:
        return text, False
    return text[: match[1] if s.include_stop_str_in_output else match[0]], True


def final_text(decode, token_ids, s: SamplingParams) -> str:
    """The text of a finished sample: its tokens decoded, cut at its stop string."""
    text = decode(token_ids)
    held = len(decode(token_ids[: s.min_tokens])) if s.stop and s.min_tokens else 0
    return cut(text, s, held)[0]


class TextStream:
    """The text of one sample, given out as its tokens arrive.

    Tokens are decoded a few at a time (from a token before the last text boundary, so a
    character split across tokens comes out whole), and text that could still be the start
    of a stop string is held back until it cannot be, so the pieces given out always join
    to a prefix of the sample's final text."""

    def __init__(self, decode, s: SamplingParams):
        self.decode, self.s = decode, s
        self.tokens: list[int] = []
        self.text = ""  # decoded text of tokens[:self.read]
        self.prefix = self.read = 0  # token offsets of the last two text boundaries
        self.held = 0  # length of the first min_tokens tokens' text (stop strings start after)
        self.sent = ""
        self.stopped = False
        self.hold = max((len(x) for x in s.stop), default=1) - 1
        self.final: str | None = None  # the whole text, once finish() has made it

    def add(self, token_ids) -> str:
        """New text that is safe to show."""
        self.tokens += token_ids
        if self.stopped:
            return ""
        before = self.decode(self.tokens[self.prefix:self.read])
        after = self.decode(self.tokens[self.prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before):]
            self.prefix, self.read = self.read, len(self.tokens)
        if self.s.min_tokens and len(self.tokens) <= self.s.min_tokens:
            self.held = len(self.text)
        visible, self.stopped = cut(self.text, self.s, self.held)
        if not self.stopped and self.hold:
            visible = visible[: max(len(self.sent), len(visible) - self.hold)]
        return self._give(visible)

    def finish(self) -> str:
        """The rest of the final text (kept whole in `final`)."""
        self.final = final_text(self.decode, self.tokens, self.s)
        return self._give(self.final)

    def _give(self, visible: str) -> str:
        if not visible.startswith(self.sent):  # a tokenizer whose pieces do not join up
            return ""
        new, self.sent = visible[len(self.sent):], visible
        return new
