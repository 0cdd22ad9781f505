"""What one trajectory holds: every token after the first prompt with a mask of the sampled
ones, their logprobs and the weight versions that sampled them, the conversation, a record
per turn, the reward and why it ended."""

from __future__ import annotations

import attrs

from rollout.contract.schemas import Message, WeightSpan, add_span

END_REASONS = ("done", "max_turns", "max_tokens", "context_length", "tool_error", "timeout",
               "aborted", "error")
RENDER_RULES = ("same", "retokenized", "rewritten")  # see rollout.apps.agents.tokens


@attrs.define
class ToolCallRecord:
    name: str
    arguments: str
    outcome: str  # rollout.apps.agents.tools.OUTCOMES
    detail: str
    seconds: float
    truncated: bool = False


@attrs.define
class Turn:
    index: int
    prompt_tokens: int  # the whole prompt this turn sent (history included)
    sampled_tokens: int
    finish_reason: str
    text: str  # what the model said, as decoded
    appended_tokens: int = 0  # tokens after it: end of turn, tool results, next prompt
    tool_calls: list[ToolCallRecord] = attrs.field(factory=list)
    engine_s: float = 0.0
    tools_s: float = 0.0
    cached_tokens: int | None = None  # of the prompt, from the prefix cache (engine's word)
    # How the template's re-rendering of the conversation up to this turn's prompt compares
    # with the tokens sent (RENDER_RULES), and the first token where it differs.
    render: str | None = None
    render_differs_at: int | None = None
    images_added: list[str] = attrs.field(factory=list)  # uuids of the images first sent here


@attrs.define
class Trajectory:
    id: str
    prompt_ids: list[int] = attrs.field(factory=list)
    # Every token after the prompt, in order: sampled ones (mask 1, with their sampling
    # logprob) and the ones the runner appended (mask 0, logprob 0.0).
    response_ids: list[int] = attrs.field(factory=list)
    mask: list[int] = attrs.field(factory=list)
    logprobs: list[float] = attrs.field(factory=list)
    # Which weights sampled which tokens (`rollout.WeightSpan`s): spans (version, start, end)
    # over `response_ids` that cover exactly the sampled tokens (mask 1), in order; the
    # appended tokens between turns are in none.
    weight_versions: list[WeightSpan] = attrs.field(factory=list)
    messages: list[Message] = attrs.field(factory=list)
    # The images of the conversation, one per image placeholder in the tokens, in order
    # (`rollout.kit.images.PromptImage`: the RGB picture and its uuid).
    images: list = attrs.field(factory=list)
    turns: list[Turn] = attrs.field(factory=list)
    reward: float | None = None
    end_reason: str = "error"
    end_detail: str = ""
    # How the template renders the finished conversation, against all the tokens (set for
    # trajectories that end "done" when the runner checks renders).
    final_render: str | None = None

    @property
    def num_turns(self) -> int:
        return len(self.turns)

    @property
    def render(self) -> str | None:
        """The rule that applied over the whole trajectory: the furthest from "same"."""
        seen = [t.render for t in self.turns if t.render is not None]
        seen += [self.final_render] if self.final_render is not None else []
        return max(seen, key=RENDER_RULES.index) if seen else None

    def add(self, token_ids, sampled: bool, logprobs=None, weight_versions=()) -> None:
        """Append tokens; sampled ones with their result's `weight_versions` (spans over
        these tokens; none given: one span of version None, unknown)."""
        token_ids = list(token_ids)
        start = len(self.response_ids)
        if sampled and token_ids:
            spans = weight_versions or (WeightSpan(None, 0, len(token_ids)),)
            for span in spans:
                add_span(self.weight_versions, span.version, start + span.start,
                         start + span.end)
        self.response_ids += token_ids
        self.mask += [int(sampled)] * len(token_ids)
        self.logprobs += list(logprobs) if logprobs is not None else [0.0] * len(token_ids)

    def end(self, reason: str, detail: str = "") -> None:
        self.end_reason, self.end_detail = reason, detail
