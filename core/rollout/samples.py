"""What one sample of a request has made so far, over one engine call or several (a keep
update, or `continue_from`, continues a sample from its tokens): its tokens, logprobs,
weight spans and streamed text, assembled into the sample's `Result`."""

from __future__ import annotations

import attrs

from rollout.contract.errors import InvalidRequestError
from rollout.contract.schemas import Chunk, Request, Result, WeightSpan, add_span
from rollout.kit.text import TextStream, cut, final_text


class Sample:
    """What one sample of a request has made so far, over one engine call or several."""

    def __init__(self, decode, s, streaming: bool, index: int, prompt_tokens: int):
        self.decode, self.s, self.index = decode, s, index
        self.prompt_tokens: int | None = prompt_tokens  # for the first chunk out, then None
        self.tokens: list[int] = []
        self.logprobs: list[float] | None = [] if s.logprobs is not None else None
        self.top: list | None = [] if s.logprobs else None
        self.masks: list | None = [] if s.return_sampling_mask else None
        self.routed: tuple | None = None  # the last engine call's (it covers every token)
        self.spans: list[WeightSpan] = []
        self.finish: str | None = None
        self.cached: int | None = None
        # The prompt's scores (sampling.prompt_logprobs) from the first engine call that
        # gave them; a continued call's prompt starts with the same tokens.
        self.prompt_scores: tuple | None = None
        self.stream = TextStream(decode, s) if streaming else None
        self.streamed_end = False
        self.before = 0  # tokens made before the running engine call (in its prompt)

    def go_on_from(self, done: Result, prompt: list[int]) -> None:
        """Start from an aborted result of the same prompt (`Request.continue_from`)."""
        if done.token_ids and list(done.prompt_token_ids) != prompt:
            raise InvalidRequestError(
                "continue_from", "its prompt_token_ids are not this request's prompt",
                "a Result of the same prompt")
        self.tokens = list(done.token_ids)
        if self.logprobs is not None:
            self.logprobs = list(done.logprobs or ())
        if self.top is not None:
            self.top = list(done.top_logprobs or ())
        if self.masks is not None:
            self.masks = list(done.sampling_mask or ())
        self.routed = done.routed_experts
        self.spans = list(done.weight_versions) or (
            [WeightSpan(done.weight_version, 0, len(self.tokens))] if self.tokens else [])
        self.cached = done.cached_tokens
        if done.prompt_logprobs is not None and self.s.prompt_logprobs is not None:
            self.prompt_scores = (done.prompt_logprobs, done.prompt_top_logprobs)
        if self.stream is not None:
            self.stream.add(self.tokens)  # the text so far is the caller's already

    def take_prompt_scores(self, chunk: Chunk) -> None:
        if self.prompt_scores is None:
            self.prompt_scores = (chunk.prompt_logprobs, chunk.prompt_top_logprobs)

    def scored(self, prompt_len: int) -> bool:
        """The engine gave the prompt's scores, as many as asked."""
        if self.prompt_scores is None:
            return False
        values, tops = self.prompt_scores
        return len(values) >= prompt_len and (not self.s.prompt_logprobs or (
            tops is not None and len(tops) >= prompt_len))

    def check_room(self) -> None:
        if not self.finish and len(self.tokens) >= self.s.max_tokens:
            self.finish = "length"  # stopped right at its last token

    def begin_segment(self) -> None:
        self.before = len(self.tokens)

    def rest_of(self, request: Request) -> Request:
        """The request that goes on from this sample's tokens (they join the prompt)."""
        s, made = self.s, len(self.tokens)
        trace = s.trace_decode_token_ids
        return attrs.evolve(request, continue_from=None, sampling=attrs.evolve(
            s, n=1, max_tokens=s.max_tokens - made, min_tokens=max(0, s.min_tokens - made),
            trace_decode_token_ids=None if trace is None else trace[made:]))

    def add(self, chunk: Chunk, version: int | None) -> Chunk | None:
        """Take an engine chunk; returns it as a streaming caller sees it (our index, its
        text, the version of its weights), None where the caller does not stream."""
        if self.before and self.s.stop:
            chunk = self._cut_at_stop(chunk)
        start = len(self.tokens)
        self.tokens += chunk.token_ids
        if chunk.token_ids:
            add_span(self.spans, version, start, len(self.tokens))
        if self.logprobs is not None:
            self.logprobs += chunk.logprobs or ()
        if self.top is not None:
            self.top += chunk.top_logprobs or ()
        if self.masks is not None:
            self.masks += chunk.sampling_mask or ()
        if chunk.routed_experts is not None:
            self.routed = chunk.routed_experts
        self.finish = chunk.finish_reason
        if chunk.cached_tokens is not None and not self.before:  # the first call's prompt
            self.cached = chunk.cached_tokens
        if self.stream is None:
            return None
        text = self.stream.add(chunk.token_ids)
        if self.finish:
            self.streamed_end = True
            text += self.stream.finish()
        first, self.prompt_tokens = self.prompt_tokens, None
        return attrs.evolve(chunk, index=self.index, text=text, weight_version=version,
                            weight_update=None, prompt_tokens=first)

    def _cut_at_stop(self, chunk: Chunk) -> Chunk:
        """A continued engine call sees the earlier tokens as prompt: a stop string that
        starts in them is the core's to find. The chunk ends at the token that completes
        it."""
        tokens, new = self.tokens, list(chunk.token_ids)
        held = len(self.decode(tokens[: self.s.min_tokens])) if self.s.min_tokens else 0
        for k in range(1, len(new) + 1):
            if cut(self.decode(tokens + new[:k]), self.s, held)[1]:
                return attrs.evolve(
                    chunk, token_ids=new[:k], finish_reason="stop",
                    logprobs=None if chunk.logprobs is None else chunk.logprobs[:k],
                    top_logprobs=None if chunk.top_logprobs is None else chunk.top_logprobs[:k],
                    sampling_mask=None if chunk.sampling_mask is None
                    else chunk.sampling_mask[:k],
                    routed_experts=None if chunk.routed_experts is None
                    else chunk.routed_experts[:len(chunk.routed_experts) - len(new) + k])
        return chunk

    def result(self, request: Request, prompt: list[int], weight_version: int | None,
               adapter_version: int | None = None) -> Result:
        streamed = self.stream.final if self.streamed_end else None  # decoded once only
        return Result(
            request_id=request.id, index=self.index, token_ids=tuple(self.tokens),
            text=final_text(self.decode, self.tokens, self.s) if streamed is None else streamed,
            finish_reason=self.finish or "abort", prompt_tokens=len(prompt),
            prompt_token_ids=tuple(prompt), cached_tokens=self.cached,
            weight_version=self.spans[-1].version if self.spans else weight_version,
            weight_versions=tuple(self.spans),
            logprobs=None if self.logprobs is None else tuple(self.logprobs),
            top_logprobs=None if self.top is None else tuple(self.top),
            sampling_mask=None if self.masks is None else tuple(self.masks),
            routed_experts=self.routed, adapter=request.adapter, adapter_version=adapter_version,
            **self._prompt_scores(len(prompt)))

    def _prompt_scores(self, prompt_len: int) -> dict:
        if self.s.prompt_logprobs is None or not self.scored(prompt_len):
            return {}
        values, tops = self.prompt_scores  # (a continued call's prompt is longer)
        return {"prompt_logprobs": values[:prompt_len],
                "prompt_top_logprobs": tuple(tops[:prompt_len]) if self.s.prompt_logprobs
                else None}
