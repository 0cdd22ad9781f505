"""The request and result schemas: frozen attrs classes that validate themselves.

Message content is a string or a tuple of parts (text, image) so that multimodal prompts
and tool-calling turns fit without a schema change.
"""

from __future__ import annotations

import sys
import uuid
from typing import Literal, NewType, Union

import attrs

from rollout.contract.errors import InvalidRequestError, RolloutError

FinishReason = Literal["stop", "length", "abort"]
Role = Literal["system", "user", "assistant", "tool"]
ROLES = ("system", "user", "assistant", "tool")


def _check(field: str, ok: bool, message: str, allowed: str | None = None) -> None:
    if not ok:
        raise InvalidRequestError(field, message, allowed)


def _valid(field: str, ok: bool, value, allowed: str | None = None) -> None:
    """`_check` with the message "got <value>", made only when the check fails (requests
    are checked on the hot path)."""
    if not ok:
        raise InvalidRequestError(field, f"got {value!r}", allowed)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _are_token_ids(values: tuple) -> bool:
    """Integers >= 0 (not bools); plain ints are checked at C speed (prompts are long)."""
    if set(map(type, values)) <= {int}:
        return not values or min(values) >= 0
    return all(_is_int(t) and t >= 0 for t in values)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _tuple(value):
    return tuple(value) if isinstance(value, (list, tuple)) else value


def _frozen_dict(value):
    return dict(value) if isinstance(value, dict) else value


# --- structured outputs -------------------------------------------------------------------

STRUCTURED_KINDS = ("regex", "json", "choice", "grammar", "structural_tag")


@attrs.frozen
class StructuredOutputs:
    """Constrains a sample's text: exactly one of `regex`, `json` (a JSON schema), `choice`
    (one of these strings), `grammar` (EBNF in the GBNF dialect that xgrammar reads, which
    every built-in backend uses) or `structural_tag` (xgrammar's structural tag, as vLLM's
    `structured_outputs.structural_tag` holds it: free text where only tagged parts are
    constrained, for example a tool call's arguments after its opening tag). JSON is
    compact: no whitespace between tokens, in a structural tag's JSON schemas too."""

    regex: str | None = None
    json: dict | None = attrs.field(default=None, converter=_frozen_dict)
    choice: tuple[str, ...] | None = attrs.field(default=None, converter=_tuple)
    grammar: str | None = None
    structural_tag: dict | None = attrs.field(default=None, converter=_frozen_dict)

    def __attrs_post_init__(self):
        given = [k for k in STRUCTURED_KINDS if getattr(self, k) is not None]
        _check("structured_outputs", len(given) == 1, f"got {', '.join(given) or 'none'}",
               "exactly one of " + ", ".join(STRUCTURED_KINDS))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            _valid(name, value is None or (isinstance(value, str) and value != ""),
                   value, "a non-empty string")
        _valid("json", self.json is None or isinstance(self.json, dict), self.json,
               "a JSON schema (an object)")
        _valid("structural_tag", self.structural_tag is None or (
            isinstance(self.structural_tag, dict)
            and self.structural_tag.get("type") == "structural_tag"),
            self.structural_tag,
            'an object {"type": "structural_tag", "format": {...}} (xgrammar\'s format)')
        _valid("choice", self.choice is None or (
            isinstance(self.choice, tuple) and len(self.choice) > 0
            and all(isinstance(c, str) and c for c in self.choice)),
            self.choice, "a non-empty list of non-empty strings")

    @property
    def kind(self) -> str:
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) is not None)


# --- sampling -----------------------------------------------------------------------------

PENALTY_RANGE = 2.0
BIAS_RANGE = 100.0
# The most alternatives `prompt_logprobs` may ask per prompt position (TRL's scoring client
# asks 100 by default).
PROMPT_LOGPROBS_MAX = 100
# What the checks below allow, made once (every request is checked).
_PROMPT_LOGPROBS = f"None, or an integer from 0 to {PROMPT_LOGPROBS_MAX}"
_REPETITION = f"a number in (0, {PENALTY_RANGE}]; 1 means none"
_PENALTY = f"a number from {-PENALTY_RANGE} to {PENALTY_RANGE}"
_STRUCTURED = "an object with one of " + ", ".join(STRUCTURED_KINDS)
# What `logprobs` measure: the model's own distribution, or the one a token was drawn from.
LOGPROBS_MODES = ("raw", "processed")


@attrs.frozen
class SamplingParams:
    """How to sample. `logprobs` is the number of top alternatives to return per token
    (0 returns only the chosen token's logprob; None returns none).

    Penalties and bias (the same on every backend; docs/sampling.md has the formulas):
    `repetition_penalty` divides a positive logit, and multiplies a negative one, of every
    token seen in the prompt or the output; `presence_penalty` is subtracted once, and
    `frequency_penalty` once per occurrence, from the logit of every token in the output;
    `logit_bias` adds to a token's logit; `min_p` drops tokens less likely than `min_p`
    times the most likely one; `min_tokens` keeps EOS, stop tokens and stop strings from
    ending a sample before it has that many tokens.

    `prompt_logprobs` scores the prompt: None returns nothing; k >= 0 returns the logprob
    of every prompt token given the tokens before it (`Result.prompt_logprobs`, raw model,
    as `logprobs`), and for k > 0 the k most likely tokens at each prompt position. With
    `max_tokens=1` this scores given token sequences (reference or recomputed logprobs).

    `logprobs_mode` says what `logprobs` and `top_logprobs` measure (docs/sampling.md):
    "raw", the model's distribution (log_softmax of the logits after a structured-output
    mask); "processed", the distribution the token was drawn from (after logit bias, the
    min_tokens ban, penalties, temperature, min_p, top-k and top-p, renormalised; at
    temperature 0 the processed logits unscaled and untruncated, as vLLM's
    `processed_logprobs`). None takes the backend's (`Capabilities.logprobs_mode`). Prompt
    logprobs are raw in both. `return_sampling_mask` returns, per generated token, the set
    it was drawn from (`Result.sampling_mask`); `return_routed_experts`, for a
    mixture-of-experts model, the experts each token was routed to (`Result.routed_experts`).
    `trace_decode_token_ids` (vLLM's trace replay) gives the tokens to generate: each is
    taken in place of the engine's draw and scored as if drawn, under every transform of the
    request (its logprobs in `logprobs_mode`, its sampling mask the set the engine would
    have drawn from), so given tokens are scored as the engine would have sampled them. The
    trace ends the sample (an EOS in it does not); it takes no stop, stop token, min_tokens,
    structured output or n > 1, and max_tokens null or at least its length.
    `batch_invariant` asks for tokens and logprobs that do not depend on what else the engine
    runs beside the request (other requests, their lengths, padding): the same as the
    request alone. A backend that cannot promise it refuses the request naming the field
    (`Capabilities`, "batch_invariant").
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    max_tokens: int | None = 16  # None: the room left in the model's context
    n: int = 1
    stop: tuple[str, ...] = attrs.field(default=(), converter=_tuple)
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=_tuple)
    seed: int | None = None
    logprobs: int | None = None
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: dict[int, float] = attrs.field(factory=dict, converter=_frozen_dict)
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputs | None = None
    prompt_logprobs: int | None = None
    logprobs_mode: str | None = None
    return_sampling_mask: bool = False
    return_routed_experts: bool = False
    trace_decode_token_ids: tuple[int, ...] | None = attrs.field(default=None,
                                                                 converter=_tuple)
    batch_invariant: bool = False

    def __attrs_post_init__(self):
        _valid("temperature", _is_number(self.temperature) and self.temperature >= 0,
               self.temperature, "a number >= 0; 0 means greedy")
        _valid("top_p", _is_number(self.top_p) and 0 < self.top_p <= 1,
               self.top_p, "a number in (0, 1]")
        _valid("top_k", self.top_k is None or (_is_int(self.top_k) and self.top_k >= 1),
               self.top_k, "None (no limit) or an integer >= 1")
        _valid("max_tokens", self.max_tokens is None
               or (_is_int(self.max_tokens) and self.max_tokens >= 1),
               self.max_tokens, "an integer >= 1, or null for the room left in "
               "the context")
        _valid("n", _is_int(self.n) and self.n >= 1, self.n, "an integer >= 1")
        _check("n", self.n == 1 or self.temperature > 0,
               f"n={self.n} samples with temperature 0 would all be identical",
               "n=1 with temperature 0, or temperature > 0")
        _valid("stop", isinstance(self.stop, tuple)
               and all(isinstance(s, str) and s for s in self.stop),
               self.stop, "a list of non-empty strings")
        _valid("stop_token_ids", isinstance(self.stop_token_ids, tuple)
               and _are_token_ids(self.stop_token_ids),
               self.stop_token_ids, "a list of integers >= 0")
        _valid("seed", self.seed is None or _is_int(self.seed),
               self.seed, "None or an integer")
        _valid("logprobs", self.logprobs is None
               or (_is_int(self.logprobs) and 0 <= self.logprobs <= 20),
               self.logprobs, "None, or an integer from 0 to 20")
        _valid("prompt_logprobs", self.prompt_logprobs is None
               or (_is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs
                   <= PROMPT_LOGPROBS_MAX),
               self.prompt_logprobs, _PROMPT_LOGPROBS)
        _valid("logprobs_mode", self.logprobs_mode is None
               or self.logprobs_mode in LOGPROBS_MODES, self.logprobs_mode,
               "None (the backend's), " + ", ".join(LOGPROBS_MODES))
        _valid("ignore_eos", isinstance(self.ignore_eos, bool),
               self.ignore_eos, "true or false")
        for name in ("return_sampling_mask", "return_routed_experts", "batch_invariant"):
            _valid(name, isinstance(getattr(self, name), bool), getattr(self, name),
                   "true or false")
        _valid("min_p", _is_number(self.min_p) and 0 <= self.min_p <= 1,
               self.min_p, "a number in [0, 1]; 0 means none")
        _valid("min_tokens", _is_int(self.min_tokens) and 0 <= self.min_tokens
               and (self.max_tokens is None or self.min_tokens <= self.max_tokens),
               self.min_tokens, f"an integer from 0 to max_tokens ({self.max_tokens})")
        _valid("include_stop_str_in_output", isinstance(self.include_stop_str_in_output, bool),
               self.include_stop_str_in_output, "true or false")
        _valid("structured_outputs", self.structured_outputs is None
               or isinstance(self.structured_outputs, StructuredOutputs),
               self.structured_outputs, _STRUCTURED)
        self._check_penalties()
        if self.trace_decode_token_ids is not None:
            self._check_trace()

    def _check_penalties(self) -> None:
        _valid("repetition_penalty", _is_number(self.repetition_penalty)
               and 0 < self.repetition_penalty <= PENALTY_RANGE,
               self.repetition_penalty, _REPETITION)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _valid(name, _is_number(value) and -PENALTY_RANGE <= value <= PENALTY_RANGE,
                   value, _PENALTY)
        _valid("logit_bias", isinstance(self.logit_bias, dict), self.logit_bias,
               "a mapping of token id to bias")
        for token, bias in self.logit_bias.items():
            _check(f"logit_bias.{token}", _is_int(token) and token >= 0,
                   "not a token id", "integers >= 0 as keys")
            _valid(f"logit_bias.{token}", _is_number(bias) and -BIAS_RANGE <= bias <= BIAS_RANGE,
                   bias, f"a number from {-BIAS_RANGE} to {BIAS_RANGE}")

    def _check_trace(self) -> None:
        trace = self.trace_decode_token_ids
        _valid("trace_decode_token_ids", isinstance(trace, tuple) and trace
               and _are_token_ids(trace), trace, "a non-empty list of token ids")
        for name, value, default in (("n", self.n, 1), ("stop", self.stop, ()),
                                     ("stop_token_ids", self.stop_token_ids, ()),
                                     ("min_tokens", self.min_tokens, 0),
                                     ("structured_outputs", self.structured_outputs, None)):
            _check(name, value == default, f"{value!r} with trace_decode_token_ids "
                   "(the trace alone ends the sample)", f"{default!r}")
        _check("max_tokens", self.max_tokens is None or self.max_tokens >= len(trace),
               f"{self.max_tokens} is shorter than trace_decode_token_ids ({len(trace)} "
               "tokens)", f"null or at least {len(trace)}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


# --- messages -----------------------------------------------------------------------------


@attrs.frozen
class TextPart:
    text: str
    type: Literal["text"] = "text"


# An image as the caller gives it: a file path, a `data:` URL (base64), its encoded bytes
# (PNG, JPEG, ...) or a PIL image. Other URLs are refused: nothing is fetched.
# `rollout.kit.images` loads it when a request runs.
ImageSource = NewType("ImageSource", object)
IMAGE_SOURCES = "a file path, a data: URL (base64), the image's bytes, or a PIL image"


IMAGE_UUIDS = ("a non-empty string naming the image (as vLLM's uuid); alone, without the "
               "image, only for an image sent before with it")


def is_image_source(value) -> bool:
    pil = sys.modules.get("PIL.Image")  # a PIL image implies PIL is imported already
    return (isinstance(value, (bytes, bytearray)) or (isinstance(value, str) and value != "")
            or (pil is not None and isinstance(value, pil.Image)))


@attrs.frozen
class ImagePart:
    """An image in a message (see `ImageSource`). `uuid` names it for the engines' caches
    (by default its content hash); given alone (`image` None), it stands for the image sent
    before under that uuid."""

    image: ImageSource | None
    type: Literal["image"] = "image"
    uuid: str | None = None

    def __attrs_post_init__(self):
        _valid("uuid", self.uuid is None or (isinstance(self.uuid, str) and self.uuid != ""),
               self.uuid, IMAGE_UUIDS)
        if not (self.image is None and self.uuid is not None):
            _check("image", is_image_source(self.image), f"got {type(self.image).__name__}",
                   IMAGE_SOURCES + ", or null with the uuid of an image sent before")


ContentPart = Union[TextPart, ImagePart]
PART_TYPES = {"text": TextPart, "image": ImagePart}
Content = Union[str, tuple[ContentPart, ...]]


@attrs.frozen
class ToolCall:
    """A call the assistant made; `arguments` is a JSON object as text, as OpenAI sends it."""

    id: str
    name: str
    arguments: str = "{}"


@attrs.frozen
class Tool:
    """A function the model may call, as OpenAI's `function` object: `parameters` is the
    JSON schema of its arguments. The chat template renders it. `returns` describes what
    the function gives back (the `return` key that transformers' `get_json_schema` writes,
    and TRL sends): it only goes to the chat template, as the function's `return`. `strict`
    goes to the chat template as given (vLLM's server renders it too); holding calls to
    `parameters` is a constraint of the request (`structured_outputs`), which the OpenAI
    server sets for a strict tool."""

    name: str
    description: str | None = None
    parameters: dict = attrs.field(factory=lambda: {"type": "object", "properties": {}},
                                   converter=_frozen_dict)
    returns: dict | None = attrs.field(default=None, converter=_frozen_dict)
    strict: bool | None = None

    def __attrs_post_init__(self):
        _valid("name", isinstance(self.name, str) and self.name != "", self.name,
               "a non-empty string")
        _valid("strict", self.strict is None or isinstance(self.strict, bool),
               self.strict, "true, false or null")
        _valid("parameters", isinstance(self.parameters, dict), self.parameters,
               "a JSON schema (an object)")
        _valid("returns", self.returns is None or isinstance(self.returns, dict),
               self.returns, "a JSON schema (an object) of the result, or null")

    def as_openai(self) -> dict:
        """The tool as chat templates get it: the fields in vLLM's server's order, a missing
        description as null, so that a template renders the prompt vLLM's server does."""
        function = {"name": self.name, "description": self.description,
                    "parameters": self.parameters}
        if self.strict is not None:
            function["strict"] = self.strict
        if self.returns is not None:
            function["return"] = self.returns
        return {"type": "function", "function": function}


@attrs.frozen
class Message:
    role: Role
    content: Content = attrs.field(converter=_tuple)
    tool_calls: tuple[ToolCall, ...] = attrs.field(default=(), converter=_tuple)
    tool_call_id: str | None = None
    name: str | None = None

    def __attrs_post_init__(self):
        _valid("role", self.role in ROLES, self.role, ", ".join(ROLES))
        _check("content", isinstance(self.content, str)
               or all(isinstance(p, tuple(PART_TYPES.values())) for p in self.content),
               "must be text or a list of parts", "text, or parts of type " + ", ".join(PART_TYPES))

    @property
    def images(self) -> tuple[ImagePart, ...]:
        if isinstance(self.content, str):
            return ()
        return tuple(p for p in self.content if isinstance(p, ImagePart))

    @property
    def text(self) -> str:
        """The content's text parts joined (what a text-only chat template renders)."""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content if isinstance(p, TextPart))


# --- requests and results -----------------------------------------------------------------


def _new_id() -> str:
    return uuid.uuid4().hex


@attrs.frozen
class Request:
    """One prompt: exactly one of `prompt` (text), `prompt_token_ids` or `messages`.
    `tools` go to the chat template with the messages. `images` go with `prompt_token_ids`
    (a later turn sent as tokens): one image per image placeholder token, in order
    (messages carry theirs in their content). `image_uuids`, if given, names each of them
    (vLLM's `multi_modal_uuids`); an image may then be None where it was sent before under
    its uuid, so that a later turn sends only its new images' pixels."""

    id: str = attrs.field(factory=_new_id)
    prompt: str | None = None
    prompt_token_ids: tuple[int, ...] | None = attrs.field(default=None, converter=_tuple)
    messages: tuple[Message, ...] | None = attrs.field(default=None, converter=_tuple)
    tools: tuple[Tool, ...] | None = attrs.field(default=None, converter=_tuple)
    images: tuple[ImageSource | None, ...] = attrs.field(default=(), converter=_tuple)
    image_uuids: tuple[str | None, ...] = attrs.field(default=(), converter=_tuple)
    sampling: SamplingParams = attrs.field(factory=SamplingParams)
    metadata: dict = attrs.field(factory=dict)
    # Requests of one session (the turns of one trajectory) go to the same replica while
    # it is healthy, so later turns reuse its prefix cache.
    session_id: str | None = None
    # A partial rollout to go on with: an aborted Result of this same prompt and sampling
    # (n=1). Generation continues from its tokens, with the max_tokens left; the result
    # holds its tokens, logprobs and weight spans followed by the new ones.
    continue_from: Result | None = None
    # The LoRA adapter to sample with (`Rollout.load_adapter`); None: the base weights.
    adapter: str | None = None

    def __attrs_post_init__(self):
        _valid("adapter", self.adapter is None or (isinstance(self.adapter, str)
                                                   and self.adapter != ""),
               self.adapter, "the name of a loaded adapter, or null")
        _valid("id", isinstance(self.id, str) and self.id != "", self.id,
               "a non-empty string")
        _valid("session_id", self.session_id is None
               or (isinstance(self.session_id, str) and self.session_id != ""),
               self.session_id, "a non-empty string or null")
        given = [name for name in ("prompt", "prompt_token_ids", "messages")
                 if getattr(self, name) is not None]
        _check("prompt", len(given) == 1, f"got {', '.join(given) or 'none'}",
               "exactly one of prompt, prompt_token_ids, messages")
        if self.prompt is not None:
            _valid("prompt", isinstance(self.prompt, str) and self.prompt != "",
                   self.prompt, "a non-empty string")
        if self.prompt_token_ids is not None:
            _check("prompt_token_ids", isinstance(self.prompt_token_ids, tuple)
                   and len(self.prompt_token_ids) > 0
                   and _are_token_ids(self.prompt_token_ids),
                   "must be a non-empty list of integers >= 0", "token ids in the vocabulary")
        if self.messages is not None:
            _check("messages", isinstance(self.messages, tuple) and len(self.messages) > 0
                   and all(isinstance(m, Message) for m in self.messages),
                   "must be a non-empty list of messages", "objects with role and content")
        if self.tools is not None:
            _check("tools", self.messages is not None, "tools need messages",
                   "tools together with messages (the chat template renders them)")
            _check("tools", isinstance(self.tools, tuple)
                   and all(isinstance(t, Tool) for t in self.tools),
                   "must be a list of tools", "objects with name, description, parameters")
            names = [t.name for t in self.tools]
            _check("tools", len(set(names)) == len(names), f"tool names repeat: {names}",
                   "unique names")
        _check("images", isinstance(self.images, tuple), f"got {type(self.images).__name__}",
               "a list of images")
        if self.images:
            _check("images", self.prompt_token_ids is not None, "images need prompt_token_ids",
                   "images with prompt_token_ids; messages carry theirs in their content")
        if not (isinstance(self.image_uuids, tuple) and (
                not self.image_uuids or len(self.image_uuids) == len(self.images))):
            count = len(self.image_uuids) if isinstance(self.image_uuids, tuple) else "no"
            raise InvalidRequestError("image_uuids", f"got {count} uuids for "
                                      f"{len(self.images)} images",
                                      "one uuid (or null) per image, or none")
        for k, name in enumerate(self.image_uuids):
            _valid(f"image_uuids[{k}]", name is None or (isinstance(name, str) and name != ""),
                   name, IMAGE_UUIDS)
        for k, image in enumerate(self.images):
            if image is None and self.image_uuids and self.image_uuids[k] is not None:
                continue  # an image sent before, named by its uuid
            _check(f"images[{k}]", is_image_source(image), f"got {type(image).__name__}",
                   IMAGE_SOURCES + ", or null where image_uuids names an image sent before")
        _check("sampling", isinstance(self.sampling, SamplingParams),
               f"got {type(self.sampling).__name__}", "a SamplingParams")
        _valid("metadata", isinstance(self.metadata, dict), self.metadata,
               "a mapping")
        if self.continue_from is not None:
            _check_continuation(self)


def _check_continuation(request: Request) -> None:
    done, s = request.continue_from, request.sampling
    _check("continue_from", isinstance(done, Result), f"got {type(done).__name__}",
           "an aborted Result of this prompt")
    _check("continue_from", done.finish_reason == "abort",
           f"the sample finished ({done.finish_reason!r})", "a Result with finish reason abort")
    _check("continue_from", s.n == 1, f"n={s.n}", "n=1: a Result is one sample")
    _check("continue_from", s.structured_outputs is None,
           "a constrained sample cannot continue: the grammar's state is the engine's",
           "no structured_outputs")
    _check("continue_from", (done.logprobs is None) == (s.logprobs is None),
           "logprobs asked in one call and not the other", "the same sampling.logprobs")
    _check("continue_from", s.max_tokens is None or s.max_tokens > len(done.token_ids),
           f"{len(done.token_ids)} tokens made, max_tokens={s.max_tokens}",
           "max_tokens above the tokens made so far")


@attrs.frozen
class TokenLogprob:
    token_id: int
    logprob: float


@attrs.frozen
class WeightSpan:
    """Output tokens `[start, end)` were sampled from the weights labelled `version`
    (vLLM's `WeightVersionSpan`; None: before the first versioned update)."""

    version: int | None
    start: int
    end: int


def add_span(spans: list[WeightSpan], version: int | None, start: int, end: int) -> None:
    """Append tokens [start, end) of `version` to `spans`, as one span with the last where
    they join it."""
    last = spans[-1] if spans else None
    if last is not None and last.version == version and last.end == start:
        spans[-1] = WeightSpan(version, last.start, end)
    else:
        spans.append(WeightSpan(version, start, end))


@attrs.frozen
class Result:
    """One sample of one request.

    `token_ids` are the generated tokens, including a final EOS or stop token; `text` is
    their decoding without special tokens, cut before a matched stop string.
    `prompt_token_ids` are exactly the tokens the engine saw before them. `logprobs` are
    the chosen tokens' log-probabilities, one per token, under the model's raw distribution
    (temperature 1, no top-p or top-k) or the processed one the token was drawn from, as
    `sampling.logprobs_mode` asked; `top_logprobs` the k most likely tokens per position.
    `prompt_logprobs` (asked with `sampling.prompt_logprobs`) score the prompt the same way:
    one entry per prompt token, the logprob of `prompt_token_ids[i]` given the tokens before
    it, None for the first token (nothing comes before it); `prompt_top_logprobs` the k most
    likely tokens at each prompt position (empty at the first), for k > 0.
    `sampling_mask` (asked with `sampling.return_sampling_mask`) holds, per generated
    token, the ids of the tokens it was drawn from (after the constraint, min_p, top-k and
    top-p; the whole allowed vocabulary where nothing truncates), most likely first; a
    greedy token's is itself alone.
    `routed_experts` (asked with `sampling.return_routed_experts`, for a mixture-of-experts
    model) holds, for every token the engine ran through the model (the prompt's, then the
    generated ones but the last), per MoE layer, the ids of the experts it was routed to,
    in the router's order (vLLM's layout: [tokens, layers, top_k]). A trainer replays them
    (`rollout.apps.rl.routing.replay_routing`) so its forward pass takes the same experts.
    A sample continued across a weight update holds its last engine call's, which ran its
    earlier tokens again under the new weights.
    """

    request_id: str
    index: int
    token_ids: tuple[int, ...] = attrs.field(converter=tuple)
    text: str
    finish_reason: FinishReason
    prompt_tokens: int
    logprobs: tuple[float, ...] | None = attrs.field(default=None, converter=_tuple)
    top_logprobs: tuple[tuple[TokenLogprob, ...], ...] | None = attrs.field(
        default=None, converter=_tuple)
    completion_tokens: int = attrs.field(
        default=attrs.Factory(lambda self: len(self.token_ids), takes_self=True))
    prompt_token_ids: tuple[int, ...] = attrs.field(default=(), converter=tuple)
    # Prompt tokens the engine took from its prefix cache; None where it does not say.
    cached_tokens: int | None = None
    # The version of the weights that made its last token (`Rollout.update_weights(version=)`);
    # None until the first versioned update. A sample that ran on across an update
    # (`pause="keep"`, or continued with `continue_from`) mixes versions: `weight_versions`
    # says which weights made each token, as spans that cover `token_ids` in order.
    weight_version: int | None = None
    weight_versions: tuple[WeightSpan, ...] = attrs.field(default=(), converter=_tuple)
    prompt_logprobs: tuple[float | None, ...] | None = attrs.field(default=None,
                                                                   converter=_tuple)
    prompt_top_logprobs: tuple[tuple[TokenLogprob, ...], ...] | None = attrs.field(
        default=None, converter=_tuple)
    # The LoRA adapter that made it (`Request.adapter`), and that adapter's version
    # (`Rollout.load_adapter(version=)`); None: the base weights, or no version given.
    adapter: str | None = None
    adapter_version: int | None = None
    sampling_mask: tuple[tuple[int, ...], ...] | None = attrs.field(default=None,
                                                                    converter=_tuple)
    routed_experts: tuple[tuple[tuple[int, ...], ...], ...] | None = attrs.field(
        default=None, converter=_tuple)

    def __attrs_post_init__(self):
        # (Messages are made only on failure: every result passes here.)
        for name in ("prompt_logprobs", "prompt_top_logprobs"):
            value = getattr(self, name)
            if value is not None and len(value) != self.prompt_tokens:
                raise InvalidRequestError(
                    name, f"{len(value)} entries but prompt_tokens={self.prompt_tokens}",
                    "one entry per prompt token")
        if self.prompt_token_ids and len(self.prompt_token_ids) != self.prompt_tokens:
            raise InvalidRequestError(
                "prompt_token_ids",
                f"{len(self.prompt_token_ids)} ids but prompt_tokens={self.prompt_tokens}",
                "as many ids as prompt_tokens")
        if self.completion_tokens != len(self.token_ids):
            raise InvalidRequestError(
                "completion_tokens", f"{self.completion_tokens} but {len(self.token_ids)} "
                "token ids", "the number of token ids")
        spans = self.weight_versions
        if not (isinstance(spans, tuple) and all(
                isinstance(x, WeightSpan) for x in spans) and (not spans or (
                    spans[0].start == 0 and spans[-1].end == len(self.token_ids) and all(
                        a.end == b.start for a, b in zip(spans, spans[1:]))
                    and all(x.start < x.end for x in spans)))):
            raise InvalidRequestError(
                "weight_versions", f"got {spans!r:.200}", "spans (version, start, end) "
                "covering the output tokens in order, or none")


@attrs.frozen
class Chunk:
    """New output of one sample of a request, as a stream yields it.

    A backend yields these from `generate` with the new `token_ids` (and, when the request
    asks for logprobs, one `logprobs` entry and, for k > 0, one `top_logprobs` entry per
    token), and `finish_reason` on the sample's last chunk; it leaves `text` empty. The core
    fills `text` with the new text of the sample before handing chunks to the caller
    (stop strings are held back until they can no longer match)."""

    index: int
    token_ids: tuple[int, ...] = attrs.field(default=(), converter=tuple)
    logprobs: tuple[float, ...] | None = attrs.field(default=None, converter=_tuple)
    top_logprobs: tuple[tuple[TokenLogprob, ...], ...] | None = attrs.field(
        default=None, converter=_tuple)
    finish_reason: FinishReason | None = None
    text: str = ""
    # Prompt tokens the engine took from its prefix cache, on any chunk of the request
    # where the engine says (the core keeps the last it saw); None elsewhere.
    cached_tokens: int | None = None
    # The version of the weights that made its tokens; the core sets it.
    weight_version: int | None = None
    # Set by a backend that offers `keep_kv`: how many weight updates had succeeded when
    # it made these tokens (the core turns it into `weight_version`).
    weight_update: int | None = None
    # The prompt's length in tokens, on the first chunk a caller gets of each sample (the
    # core sets it: a stream can report its usage before the end).
    prompt_tokens: int | None = None
    # The prompt's scores (`sampling.prompt_logprobs`), as `Result.prompt_logprobs` and
    # `prompt_top_logprobs` hold them, for the prompt the engine was given: on any one
    # chunk of the request (a chunk may carry them and no token); None elsewhere.
    prompt_logprobs: tuple[float | None, ...] | None = attrs.field(default=None,
                                                                   converter=_tuple)
    prompt_top_logprobs: tuple[tuple[TokenLogprob, ...], ...] | None = attrs.field(
        default=None, converter=_tuple)
    # Per new token, the ids it was drawn from (`sampling.return_sampling_mask`).
    sampling_mask: tuple[tuple[int, ...], ...] | None = attrs.field(default=None,
                                                                    converter=_tuple)
    # The experts every token of the engine call was routed to, as `Result.routed_experts`
    # (`sampling.return_routed_experts`): on the chunk that ends the sample.
    routed_experts: tuple[tuple[tuple[int, ...], ...], ...] | None = attrs.field(
        default=None, converter=_tuple)


@attrs.frozen
class Timing:
    """When the engine made a request's output, in seconds from the moment it started
    the request: its first token (None if it made none) and its end."""

    first_token_s: float | None
    total_s: float


@attrs.frozen
class Completion:
    """What one request produced: its `n` results in index order, or the error that
    stopped it (the other requests of its batch are unaffected). `timing` is the
    engine's, where it ran (not part of equality: two runs of a request are equal)."""

    request_id: str
    results: tuple[Result, ...] = ()
    error: RolloutError | None = None
    timing: Timing | None = attrs.field(default=None, eq=False)

    @property
    def ok(self) -> bool:
        return self.error is None

    def unwrap(self) -> tuple[Result, ...]:
        """The results, or raise the request's error."""
        if self.error is not None:
            raise self.error
        return self.results


# --- what a backend offers ----------------------------------------------------------------

CAPABILITIES = {
    "release": "free weights and KV cache with release() and bring them back with resume()",
    "update_weights": "replace the weights in place with update_weights()",
    "logprobs": "return per-token logprobs",
    "prompt_logprobs": "score the prompt's tokens (sampling.prompt_logprobs)",
    **{f"logprobs_mode.{mode}": f"logprobs of the {what} distribution on request"
       for mode, what in (("raw", "model's"), ("processed", "sampled-from"))},
    "sampling_mask": "the set each token was drawn from (sampling.return_sampling_mask)",
    # Sampling masks and processed logprobs of some requests (the set drawn from):
    "drawn_set.penalties": "the set drawn from, with penalties",
    "drawn_set.top_p_after_truncation": "the set drawn from, with top_p < 1 after top_k or "
                                        "min_p (top_p of the mass they kept)",
    "routed_experts": "the experts each token was routed to, for a mixture-of-experts model "
                      "(sampling.return_routed_experts)",
    "trace_replay": "generate given tokens, each scored as if drawn "
                    "(sampling.trace_decode_token_ids)",
    "seed": "reproduce a sample from a per-request seed",
    "batch_invariant": "a request's tokens and logprobs independent of the requests the "
                       "engine runs beside it (sampling.batch_invariant)",
    "keep_kv": "update weights while requests run in the engine, their KV cache as the "
               "old weights made it (update_weights(pause=\"keep_kv\"))",
    "chat": "render chat messages with the model's chat template",
    "images": "image parts in messages",
    "tools": "render tool definitions and tool calls with the chat template",
    "adapters": "load LoRA adapters (load_adapter) and sample with one per request",
    **{f"structured_outputs.{kind}": f"constrain the output by {what}" for kind, what in (
        ("regex", "a regular expression"), ("json", "a JSON schema"),
        ("choice", "a choice among strings"), ("grammar", "an EBNF grammar"),
        ("structural_tag", "constrained parts after trigger strings in free text"))},
}
TAGS = ("weights", "kv_cache")


KEEPS = {
    "continue": "the core stops each running request at a step boundary and continues it "
                "from its prompt and tokens so far under the new weights (KV recomputed)",
}


@attrs.frozen
class Capabilities:
    """What a backend supports. `unsupported` maps a capability name to the reason it is
    missing here; `auto_resume` means generate() on a released backend resumes it instead
    of raising; `keep` says how `update_weights(pause="keep")` holds running requests
    (`KEEPS`); `logprobs_mode` is what a request that names none gets
    (`SamplingParams.logprobs_mode`)."""

    unsupported: dict[str, str] = attrs.field(factory=dict)
    auto_resume: bool = False
    keep: str = "continue"
    logprobs_mode: str = "raw"

    def __attrs_post_init__(self):
        for name in self.unsupported:
            _check("unsupported", name in CAPABILITIES, f"unknown capability {name!r}",
                   ", ".join(CAPABILITIES))
        _valid("keep", self.keep in KEEPS, self.keep, ", ".join(KEEPS))
        _valid("logprobs_mode", self.logprobs_mode in LOGPROBS_MODES
               and self.supports(f"logprobs_mode.{self.logprobs_mode}"),
               self.logprobs_mode,
               " or ".join(LOGPROBS_MODES) + ", not among the unsupported")

    def supports(self, name: str) -> bool:
        return name not in self.unsupported

    def require(self, name: str) -> None:
        from rollout.contract.errors import UnsupportedError

        if name in self.unsupported:
            raise UnsupportedError(name, self.unsupported[name])


for _cls in (StructuredOutputs, SamplingParams, TextPart, ImagePart, ToolCall, Tool, Message,
             WeightSpan, Request, TokenLogprob, Result, Chunk, Completion, Capabilities):
    attrs.resolve_types(_cls)
