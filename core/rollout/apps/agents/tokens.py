"""Exact tokens across turns: the model's sampled ids are never re-tokenized.

After a turn, the runner appends only the tokens of what came after it: the end of the
assistant turn that the model did not sample itself (say `<|im_end|>` after a length cut,
or the `\\n` a template puts after it), the new messages (tool results, a user turn), and
the next generation prompt. Those tokens come from the chat template, rendered behind a
fixed conversation and cut off from it, so they do not depend on how the template would
render the history.

`check_render` compares the whole conversation, re-rendered by the template, with the
tokens the trajectory holds, and names what differs: "same" (the template gives exactly
these tokens), "retokenized" (the same text, other token boundaries) or "rewritten" (the
template renders the history differently, e.g. drops earlier reasoning). The trajectory
keeps its tokens in every case; the rule says what a re-rendering trainer would have got.
"""

from __future__ import annotations

from rollout.contract.errors import RolloutError
from rollout.kit.prompts import template_message
from rollout.contract.schemas import Message

# The fixed conversation new messages are rendered behind (its content never matters).
_BEHIND = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]


class TemplateError(RolloutError):
    """The chat template cannot be used turn by turn (it renders new messages differently
    depending on what came before them)."""

    kind = "template"


class ChatTokens:
    """The chat template of one model, as token ids, for one set of tools."""

    def __init__(self, tokenizer, tools: list[dict] | None = None):
        self.tokenizer = tokenizer
        self.tools = tools or None
        behind = self._render(_BEHIND, generation_prompt=False)
        cut = behind.rindex(_BEHIND[-1]["content"]) + len(_BEHIND[-1]["content"])
        # What the template puts after an assistant turn's content, as token ids.
        self.end_of_turn = self._ids(behind[cut:])
        self._behind = behind

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=self.tools, add_generation_prompt=generation_prompt, tokenize=False)

    def _ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def prompt(self, messages: list[Message]) -> list[int]:
        """The first prompt: the messages with the generation prompt."""
        return self._ids(self._render([template_message(m) for m in messages], True))

    def continuation(self, sampled: list[int], new: list[Message]) -> list[int]:
        """The tokens after a turn's sampled ones: the rest of the assistant turn's end,
        the new messages, and the generation prompt."""
        # The longest start of the end-of-turn tokens that the sample already ends with.
        eot = self.end_of_turn
        have = next(k for k in range(len(eot), -1, -1)
                    if k == 0 or list(sampled[-k:]) == eot[:k])
        after = self._render(_BEHIND + [template_message(m) for m in new], True)
        if not after.startswith(self._behind):
            raise TemplateError("the chat template renders new messages differently "
                                "depending on the conversation before them")
        return eot[have:] + self._ids(after[len(self._behind):])

    def check_render(self, messages: list[Message], ids: list[int],
                     generation_prompt: bool = True) -> tuple[str, int | None]:
        """How the template's rendering of `messages` compares with `ids`: ("same" |
        "retokenized" | "rewritten", the first token where they differ)."""
        text = self._render([template_message(m) for m in messages], generation_prompt)
        rendered = self._ids(text)
        if rendered == list(ids):
            return "same", None
        first = first_difference(rendered, ids)
        held = self.tokenizer.decode(list(ids), skip_special_tokens=False)
        return ("retokenized" if held == text else "rewritten"), first


def first_difference(a, b) -> int:
    """The first index where two token sequences differ (the shorter one's length when one
    starts the other)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
