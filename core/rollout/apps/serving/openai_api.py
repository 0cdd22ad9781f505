"""The OpenAI HTTP API in rollout's terms: request bodies of `/v1/completions` and
`/v1/chat/completions` become rollout `Request`s, and `Completion`s become OpenAI responses
and stream chunks.

Strict like the rest of rollout: an unknown field, or a known OpenAI field that rollout
cannot honour given a value other than its default, is a 400 naming the field; it is never
silently ignored. Token ids in logprobs are written as "token_id:N": the server may front
remote replicas and has no tokenizer of its own, and ids are exact where decoded pieces of
one character are not.
"""

from __future__ import annotations

import base64
import json
import math
import re
import struct
import time
import uuid
from collections.abc import Collection
from typing import Any

import attrs

from rollout.contract import convert
from rollout.contract.errors import (
    EngineDeadError,
    InvalidRequestError,
    NoReplicaError,
    OverloadedError,
    RolloutError,
    RolloutTimeoutError,
    UnsupportedError,
    WeightsDirtyError,
)
from rollout.contract.schemas import Chunk, Completion, Message, Request, Result, Tool, ToolCall
from rollout.apps.tool_parsers import DEFAULT_PARSER, ToolCallError, forced, load_tool_parser
from rollout.apps.tool_parsers import strict as strict_schemas

# Fields that change sampling, under their OpenAI names, with vLLM's and SGLang's
# extensions; rollout's sampling fields carry the same names.
SAMPLING_FIELDS = ("temperature", "top_p", "n", "stop", "seed", "top_k", "ignore_eos",
                   "stop_token_ids", "repetition_penalty", "presence_penalty",
                   "frequency_penalty", "min_p", "min_tokens", "logit_bias",
                   "include_stop_str_in_output", "logprobs_mode", "return_sampling_mask",
                   "return_routed_experts", "trace_decode_token_ids", "batch_invariant")
COMMON_FIELDS = ("model", "stream", "stream_options", "return_token_ids",
                 "return_tokens_as_token_ids", "max_tokens",
                 "max_completion_tokens", "response_format", "structured_outputs",
                 *SAMPLING_FIELDS)
COMPLETIONS_FIELDS = ("prompt", "logprobs", "prompt_logprobs", *COMMON_FIELDS)
CHAT_FIELDS = ("messages", "logprobs", "top_logprobs", "tools", "tool_choice",
               "parallel_tool_calls", "prompt_logprobs", *COMMON_FIELDS)

# Accepted and ignored: they only label or route the call at OpenAI.
IGNORED_FIELDS = ("user", "safety_identifier", "prompt_cache_key", "prompt_cache_retention",
                  "prompt_cache_options", "service_tier", "metadata")

_OLD_FUNCTIONS = "the deprecated functions API is not supported; use tools and tool_choice"
# OpenAI fields rollout cannot honour: accepted only with one of their default values.
UNSUPPORTED_FIELDS: dict[str, tuple[tuple, str]] = {
    "best_of": ((None, 1), "best_of is not supported; ask for n samples and pick"),
    "echo": ((None, False), "echoing the prompt is not supported"),
    "suffix": ((None, ""), "insertion (suffix) is not supported"),
    "functions": ((None, []), _OLD_FUNCTIONS),
    "function_call": ((None, "none"), _OLD_FUNCTIONS),
    "modalities": ((None, ["text"]), "only text output is supported"),
    "audio": ((None,), "only text output is supported"),
    "prediction": ((None,), "predicted outputs are not supported"),
    "reasoning_effort": ((None,), "not supported"),
    "verbosity": ((None,), "not supported"),
    "web_search_options": ((None,), "web search is not supported"),
    "moderation": ((None,), "moderation is not supported"),
    "store": ((None, False), "completions are not stored"),
    # vLLM's extension; rollout's text never holds special tokens.
    "skip_special_tokens": ((None, True), "the text always leaves special tokens out "
                                          "(token_ids has them)"),
}
# vLLM's `structured_outputs` object: what rollout takes of it.
STRUCTURED_FIELDS = ("regex", "json", "choice", "grammar", "structural_tag", "json_object")

MESSAGE_FIELDS = ("role", "content", "name", "tool_calls", "tool_call_id")
# A function tool's keys: `return` (the result's schema) goes to the chat template.
FUNCTION_FIELDS = ("name", "description", "parameters", "strict", "return")
# What the openai client puts in a returned message: fine to send back while empty.
EMPTY_MESSAGE_FIELDS = ("refusal", "function_call", "audio", "annotations")
LOGPROB_FLOOR = -9999.0  # -inf is not JSON


class ApiError(Exception):
    """An error answered with an OpenAI error body."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status, message, type, param, code)
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad_field(param: str, message: str, allowed: str | None = None) -> ApiError:
    """A 400 for one field, worded like rollout's InvalidRequestError."""
    return api_error(InvalidRequestError(param, message, allowed))


def api_error(exc: RolloutError, param: str | None = None) -> ApiError:
    """The HTTP status and OpenAI error for a rollout error; `param` renames its field."""
    if isinstance(exc, InvalidRequestError):
        param = param or exc.field
        message = exc.message.removeprefix(f"{exc.field}: ")
        code = None if type(exc) is InvalidRequestError else exc.kind  # a narrower kind
        return ApiError(400, f"{param}: {message}", param=param, code=code)
    if isinstance(exc, OverloadedError):  # as OpenAI's own: clients back off and retry
        return ApiError(429, exc.message, type="rate_limit_exceeded", code=exc.kind,
                        headers={"Retry-After": str(max(1, math.ceil(exc.retry_after)))})
    if isinstance(exc, (NoReplicaError, EngineDeadError, WeightsDirtyError)):
        status = 503
    elif isinstance(exc, RolloutTimeoutError):
        status = 504
    elif isinstance(exc, UnsupportedError):  # what this server cannot do here, and why
        status = 501
    else:
        status = 500
    # `code` is the rollout error kind, so a rollout client can rebuild the typed error.
    return ApiError(status, exc.message, type="server_error", code=exc.kind)


def model_not_found(model: Any, served: str, adapters: Collection[str] = ()) -> ApiError:
    also = f" and the LoRA adapters {', '.join(map(repr, adapters))}" if adapters else ""
    return ApiError(404, f"model {model!r} is not served here (this server serves "
                    f"{served!r}{also})", param="model", code="model_not_found")


def chosen_adapter(body: dict, model_name: str, adapters: Collection[str]) -> str | None:
    """The LoRA adapter the body's `model` names, as on vLLM's server; None for the base
    model (also when `model` is left out)."""
    model = body.get("model")
    if model in (None, model_name):
        return None
    if isinstance(model, str) and model in adapters:
        return model
    raise model_not_found(model, model_name, adapters)


# --- request bodies -----------------------------------------------------------------------


class Call:
    """One OpenAI call: its rollout requests, and how to write their completions back."""

    object = ""
    chunk_object = ""
    id_prefix = ""

    def __init__(self, body: Any, model_name: str, fields: tuple[str, ...],
                 adapters: Collection[str] = ()):
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object")
        _check_fields(body, fields)
        self.adapter = chosen_adapter(body, model_name, adapters)
        self.body = body
        self.model = self.adapter or model_name
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.stream = _flag(body, "stream")
        self.return_token_ids = _flag(body, "return_token_ids")
        options = body.get("stream_options") or {}
        if not isinstance(options, dict) or set(options) - {"include_usage",
                                                            "include_obfuscation"}:
            raise bad_field("stream_options", f"got {_short(options)}",
                            "an object with include_usage")
        include_usage = _flag(options, "include_usage", "stream_options.")
        self.include_usage = self.stream and include_usage
        if body.get("return_tokens_as_token_ids") is False:
            raise bad_field("return_tokens_as_token_ids", "got false: this server writes every "
                            "token in logprobs as token_id:N", "true, or leave it out")
        _flag(body, "return_tokens_as_token_ids")
        self.sampling = {name: body[name] for name in SAMPLING_FIELDS
                         if body.get(name) is not None}
        if self.sampling.get("top_k") in (0, -1) and not isinstance(body["top_k"], bool):
            del self.sampling["top_k"]  # vLLM's and SGLang's "no limit"
        if isinstance(self.sampling.get("stop"), str):
            self.sampling["stop"] = [self.sampling["stop"]]
        # Rollout's sampling field -> the OpenAI field it came from, for error messages.
        self.names: dict[str, str] = {}
        self.n = body.get("n") or 1
        self.requests: list[Request] = []
        if body.get("max_tokens") is not None and body.get("max_completion_tokens") is not None:
            raise bad_field("max_completion_tokens", "given together with max_tokens",
                            "one of max_tokens, max_completion_tokens")
        self._set("max_tokens", "max_tokens")
        self._set("max_tokens", "max_completion_tokens")
        # vLLM's extension: the prompt's scores, in the response only (as vLLM's server).
        self._set("prompt_logprobs", "prompt_logprobs")
        if self.stream and body.get("prompt_logprobs") is not None:
            raise bad_field("prompt_logprobs", "not available when stream is true",
                            "stream false, or no prompt_logprobs")
        self.answer_schema = None  # what a JSON answer must validate against, if anything
        constraint = _structured_outputs(body)
        if constraint is not None:
            (self.sampling["structured_outputs"], self.names["structured_outputs"],
             self.answer_schema) = constraint

    def _set(self, field: str, param: str) -> None:
        """Sampling `field` from the body's `param`, if given."""
        if self.body.get(param) is not None:
            self.sampling[field] = self.body[param]
            self.names[field] = param

    def _structure(self, items: list[dict]) -> list[Request]:
        requests = []
        for i, item in enumerate(items):
            try:
                requests.append(convert.structure(
                    {**item, "sampling": self.sampling, "adapter": self.adapter}, Request))
            except InvalidRequestError as exc:
                raise api_error(exc, self.param(exc.field, i, len(items))) from None
        return requests

    def param(self, field: str, index: int = 0, count: int = 1) -> str:
        """The OpenAI name of the field of request `index` (of `count`) that failed."""
        if field.startswith("sampling."):
            name = field.removeprefix("sampling.")
            base = re.match(r"\w*", name).group()
            return self.names.get(base, base) + name[len(base):]
        return field

    # --- completions back to OpenAI -------------------------------------------------------

    def check(self, completion: Completion, index: int) -> None:
        """Any failed prompt fails the whole OpenAI call."""
        if completion.error is not None:
            error = completion.error
            field = getattr(error, "field", None)
            raise api_error(error, field and self.param(field, index, len(self.requests)))
        for result in completion.results:
            self._hold_to_schema(result)

    def _hold_to_schema(self, result: Result) -> None:
        """A JSON answer (response_format, structured_outputs.json) that the grammar ended
        and that does not validate never reaches the client, as a strict tool's call: the
        whole call fails (a server error, since the grammar should have made it
        impossible). An answer a limit or a stop string cut is returned as it is."""
        if self.answer_schema is None or result.finish_reason != "stop" or any(
                self.sampling.get(k) for k in ("stop", "stop_token_ids", "ignore_eos",
                                               "min_tokens")):
            return
        try:
            why = strict_schemas.validate(strict_schemas.loads(result.text), self.answer_schema)
        except ValueError as exc:
            why = f"not valid JSON: {exc}"
        if why is not None:
            raise strict_violation(f"an answer held to {self.names['structured_outputs']}",
                                   why)

    def response(self, completions: list[Completion]) -> dict:
        for i, completion in enumerate(completions):
            self.check(completion, i)
        choices = [self.choice(i, r) for i, c in enumerate(completions) for r in c.results]
        return {"id": self.id, "object": self.object, "created": self.created,
                "model": self.model, "choices": choices, "usage": usage(completions)}

    def choice(self, i: int, result: Result) -> dict:
        raise NotImplementedError

    def chunk(self, choices: list[dict], **extra) -> dict:
        return {"id": self.id, "object": self.chunk_object, "created": self.created,
                "model": self.model, "choices": choices, **extra}

    def opening_chunks(self) -> list[dict]:
        """What a stream sends before any sample is done."""
        return []

    def delta_chunk(self, i: int, chunk: Chunk) -> dict | None:
        """What a stream sends for a chunk of prompt `i`'s engine output (None: nothing
        before the prompt is done)."""
        raise NotImplementedError

    def closing_chunks(self, i: int, completion: Completion) -> list[dict]:
        """What a stream sends when prompt `i` is done."""
        return []

    def usage_chunk(self, completions: list[Completion]) -> dict:
        return self.chunk([], usage=usage(completions))

    def index(self, i: int, result: Result | Chunk) -> int:
        return i * self.n + result.index  # OpenAI numbers choices prompt after prompt

    def token_ids(self, i: int, result: Result) -> dict:
        if not self.return_token_ids:
            return {}
        return {"token_ids": list(result.token_ids),
                "prompt_token_ids": list(result.prompt_token_ids)}

    def chunk_tokens(self, chunk: Chunk) -> dict:
        """A streamed piece's extensions: its `token_ids` (if asked for) and the version of
        the weights that made them, where it has tokens."""
        extra = {"token_ids": list(chunk.token_ids)} if self.return_token_ids else {}
        extra.update(on_policy(chunk))
        if chunk.token_ids:
            extra["weight_version"] = chunk.weight_version
        return extra


class CompletionsCall(Call):
    object = "text_completion"
    chunk_object = "text_completion"
    id_prefix = "cmpl"

    def __init__(self, body: Any, model_name: str, adapters: Collection[str] = ()):
        super().__init__(body, model_name, COMPLETIONS_FIELDS, adapters)
        self._set("logprobs", "logprobs")
        self.requests = self._structure(_prompts(body.get("prompt")))

    def param(self, field: str, index: int = 0, count: int = 1) -> str:
        if field.startswith("prompt"):  # prompt or prompt_token_ids: OpenAI has one field
            return "prompt" + (f"[{index}]" if count > 1 else "")
        return super().param(field, index, count)

    def choice(self, i: int, result: Result) -> dict:
        scores = {} if self.body.get("prompt_logprobs") is None else \
            {"prompt_logprobs": prompt_logprobs(result)}
        return {"index": self.index(i, result), "text": result.text,
                "logprobs": completion_logprobs(result),
                "finish_reason": result.finish_reason, **self.token_ids(i, result),
                **scores, **on_policy(result), "weight_versions": weight_spans(result)}

    def delta_chunk(self, i: int, chunk: Chunk) -> dict:
        return self.chunk([{"index": self.index(i, chunk), "text": chunk.text,
                            "logprobs": completion_logprobs(chunk),
                            "finish_reason": chunk.finish_reason,
                            **self.chunk_tokens(chunk)}])


class ChatCall(Call):
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def __init__(self, body: Any, model_name: str, tool_parser: str = DEFAULT_PARSER,
                 adapters: Collection[str] = ()):
        super().__init__(body, model_name, CHAT_FIELDS, adapters)
        # As OpenAI's chat and vLLM's: no limit given is the room left in the context
        # (completions keep the legacy 16).
        self.sampling.setdefault("max_tokens", None)
        self.tools = ToolUse(body, tool_parser, "structured_outputs" in self.sampling)
        if self.tools.constraint is not None:
            self.sampling["structured_outputs"] = self.tools.constraint
            # A strict tool's constraint comes from the tools; "required" or a name's from
            # tool_choice: errors name that field.
            self.names["structured_outputs"] = "tools" if self.tools.mode == "auto" \
                else "tool_choice"
        if _flag(body, "logprobs"):
            self.sampling["logprobs"] = 0
            self._set("logprobs", "top_logprobs")
        elif body.get("top_logprobs") is not None:
            raise bad_field("top_logprobs", "needs logprobs: true")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            got = "missing" if messages is None else f"got {_short(messages)}"
            raise bad_field("messages", got, "a non-empty list of messages")
        request = {"messages": [_message(m, f"messages[{i}]") for i, m in enumerate(messages)]}
        if self.tools.tools:
            request["tools"] = [convert.unstructure(t) for t in self.tools.tools]
        self.requests = self._structure([request])

    def param(self, field: str, index: int = 0, count: int = 1) -> str:
        # rollout's ToolCall is flat; OpenAI nests name and arguments under `function`.
        field = re.sub(r"(tool_calls\[\d+\])\.(name|arguments)", r"\1.function.\2", field)
        return super().param(field, index, count)

    def response(self, completions: list[Completion]) -> dict:
        body = super().response(completions)
        if self.return_token_ids:  # where vLLM's chat response has it (TRL reads it there)
            body["prompt_token_ids"] = list(completions[0].results[0].prompt_token_ids)
        if self.body.get("prompt_logprobs") is not None:  # there too, as vLLM's
            body["prompt_logprobs"] = prompt_logprobs(completions[0].results[0])
        return body

    def choice(self, i: int, result: Result) -> dict:
        message, finish_reason = self.tools.message(result)
        return {"index": self.index(i, result), "message": message,
                "logprobs": chat_logprobs(result), "finish_reason": finish_reason,
                **self.token_ids(i, result), **on_policy(result),
                "weight_versions": weight_spans(result)}

    def answer(self, result: Result) -> Message:
        """The assistant message a client sends back for this sample in its next turn."""
        message, _ = self.tools.message(result)
        return Message("assistant", message["content"] or "", tool_calls=[
            ToolCall(c["id"], c["function"]["name"], c["function"]["arguments"])
            for c in message.get("tool_calls", ())])

    def opening_chunks(self) -> list[dict]:
        return [self.chunk([{"index": k, "delta": {"role": "assistant", "content": ""},
                             "logprobs": None, "finish_reason": None}
                            for k in range(self.n)])]

    def delta_chunk(self, i: int, chunk: Chunk) -> dict | None:
        if self.tools.mode != "none":
            return None  # tool calls are read from the whole answer: sent when it is done
        return self.chunk([{"index": self.index(i, chunk), "delta": {"content": chunk.text},
                            "logprobs": chat_logprobs(chunk),
                            "finish_reason": chunk.finish_reason,
                            **self.chunk_tokens(chunk)}])

    def closing_chunks(self, i: int, completion: Completion) -> list[dict]:
        if self.tools.mode == "none":
            return []
        contents, ends = [], []
        for r in completion.results:
            message, finish_reason = self.tools.message(r)
            delta = {k: v for k, v in message.items() if k != "role"}
            for k, call in enumerate(delta.get("tool_calls", ())):
                delta["tool_calls"][k] = {"index": k, **call}
            contents.append({"index": self.index(i, r), "delta": delta,
                             "logprobs": chat_logprobs(r), "finish_reason": None,
                             **self.token_ids(i, r), **on_policy(r),
                             "weight_versions": weight_spans(r)})
            ends.append({"index": self.index(i, r), "delta": {}, "logprobs": None,
                         "finish_reason": finish_reason})
        return [self.chunk(contents), self.chunk(ends)]


class ToolUse:
    """A chat call's `tools`, `tool_choice` and `parallel_tool_calls`: what goes to the
    chat template, the constraint on calls, and how each sample's text becomes tool calls.

    As vLLM's server does for a parser that has a call constraint (hermes): "required", a
    named tool, strict tools, and `parallel_tool_calls` false under "auto" hold calls in
    the parser's own format, so the model writes its calls as it learnt them (and as the
    chat template writes them back in the next turn). A parser without one gets "required"
    and a named tool as a JSON constraint (`forced`), and no strict tools under "auto"."""

    def __init__(self, body: dict, parser: str, constrained: bool):
        given = body.get("tools")
        if given is not None and not isinstance(given, list):
            raise bad_field("tools", f"got {_short(given)}", "a list of function tools")
        self.tools = [_tool(t, f"tools[{i}]") for i, t in enumerate(given or [])]
        self.strict = {t.name: t.parameters for t in self.tools if t.strict}
        self.parallel = _flag(body, "parallel_tool_calls") if body.get(
            "parallel_tool_calls") is not None else True
        choice = body.get("tool_choice")
        self.mode = choice if choice is not None else "auto" if self.tools else "none"
        self.constraint, self.parser = None, None
        if self.mode == "none":
            return
        if not self.tools:
            raise bad_field("tool_choice", f"got {_short(choice)} without tools",
                            '"none", or give tools')
        names = [t.name for t in self.tools]
        if isinstance(choice, dict):
            function = choice.get("function") if choice.get("type") == "function" else None
            name = function.get("name") if isinstance(function, dict) else None
            if name not in names:
                raise bad_field("tool_choice", f"got {_short(choice)}",
                                '{"type": "function", "function": {"name": N}}, N one of '
                                + ", ".join(names))
            self.mode, self.named = "named", self.tools[names.index(name)]
        elif self.mode not in ("auto", "required"):
            raise bad_field("tool_choice", f"got {_short(choice)}",
                            'none, auto, required, or {"type": "function", "function": {"name"}}')
        self.parser = load_tool_parser(parser)
        if self.mode == "auto":
            if self.strict:
                self.constraint = self._auto_constraint(parser, constrained)
            elif not self.parallel and not constrained and hasattr(self.parser, "constraint"):
                self.constraint = self._parser_constraint()  # one call: the grammar ends it
            return
        if constrained:
            raise bad_field("tool_choice", f"{self.mode} sets its own output constraint",
                            "auto or none together with response_format or structured_outputs")
        if hasattr(self.parser, "constraint"):
            self.constraint = self._parser_constraint()
            return
        self.parser = None  # the JSON of `forced`, read by `forced`
        tools = self._grammar_tools()
        constraint = forced.named_constraint(tools[names.index(self.named.name)]) \
            if self.mode == "named" else forced.required_constraint(tools, self.parallel)
        self.constraint = convert.unstructure(constraint)

    def _grammar_tools(self) -> list[Tool]:
        """The tools as the grammar engine gets them: each schema rewritten where the
        grammar would let invalid JSON through, and a strict one refused (a 400 naming the
        keyword) where the grammar cannot hold a call to it exactly."""
        try:
            return [attrs.evolve(t, parameters=strict_schemas.prepare(
                        t.parameters, f"tools[{i}].function.parameters", refuse=bool(t.strict)))
                    for i, t in enumerate(self.tools)]
        except InvalidRequestError as exc:
            raise api_error(exc) from None

    def _parser_constraint(self) -> dict:
        """The parser's call constraint. A forced call's arguments hold to its tool's
        schema, strict or not (vLLM 0.32 holds a strict tool's only)."""
        tools = self._grammar_tools()
        if self.mode == "named":
            tools = [t for t in tools if t.name == self.named.name]
        held = [self.mode != "auto" or bool(t.strict) for t in tools]
        return {"structural_tag": self.parser.constraint(tools, held, self.mode,
                                                         self.parallel)}

    def _auto_constraint(self, parser: str, constrained: bool) -> dict:
        """Strict tools under "auto": free text, and a call's arguments held to its tool's
        schema from its opening tag on (the parser's format)."""
        where = f"tools[{next(i for i, t in enumerate(self.tools) if t.strict)}].function.strict"
        if constrained:
            raise bad_field(where, "strict tools under tool_choice auto set their own output "
                            "constraint", "false together with response_format or "
                            "structured_outputs")
        if not hasattr(self.parser, "constraint"):
            raise bad_field(where, f"the {parser!r} tool-call format cannot hold calls to "
                            "their schemas in tool_choice auto", 'false, or tool_choice '
                            '"required" or a named tool')
        return self._parser_constraint()

    def message(self, result: Result) -> tuple[dict, str]:
        """The assistant message and finish reason of one sample."""
        if self.mode == "none":
            return {"role": "assistant", "content": result.text}, result.finish_reason
        if self.parser is not None:
            parsed = self.parser.parse(result.text, self.tools)
        elif self.mode == "named":
            parsed = forced.parse_named(result.text, self.named)
        else:
            parsed = forced.parse_required(result.text, self.tools)
        if self.mode != "auto" and not parsed.tool_calls and not parsed.errors:
            # A forced answer holds calls only: without one, it was cut inside the first.
            parsed = attrs.evolve(parsed, errors=(ToolCallError(
                result.text, "cut before a whole call was written"),))
        # Without parallel calls the first one is the call; "required" asked for one only.
        calls = parsed.tool_calls if self.parallel else parsed.tool_calls[:1]
        for call in calls:
            self._hold_to_schema(call)
        # As vLLM's server: calls read in "auto" with no text around them have content
        # null; a forced call's is "", and so is an empty answer's.
        content = None if calls and self.mode == "auto" and not parsed.content.strip() \
            else parsed.content
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.name, "arguments": c.arguments}} for c in calls]
        if parsed.errors:  # text, as what it is (cut: `length`), with why it is no call
            if not calls:
                message["content"] = result.text
            message["tool_call_errors"] = [{"text": e.text, "reason": e.reason}
                                           for e in parsed.errors]
        # As vLLM's server and OpenAI: calls read in "auto" end in `tool_calls` whatever
        # cut the text after them, "required" only when its calls were finished (stop); a
        # named tool's call ends as the sample did.
        if not calls or self.mode == "named" or (
                self.mode == "required" and result.finish_reason != "stop"):
            return message, result.finish_reason
        return message, "tool_calls"

    def _hold_to_schema(self, call) -> None:
        """A strict tool's call that does not validate never reaches the client, and is not
        passed off as text either: the whole call fails (a server error, since the grammar
        should have made it impossible)."""
        schema = self.strict.get(call.name)
        if schema is None:
            return
        why = strict_schemas.validate(json.loads(call.arguments), schema)
        if why is not None:
            raise strict_violation(f"a call to strict tool {call.name!r}", why)


class OverChat:
    """A call of another API (Responses, Anthropic's Messages) that runs as a chat call;
    errors come back in its own field names (`renames`: regex, replacement)."""

    renames: tuple[tuple[str, str], ...] = ()

    def run_as(self, chat: dict, model_name: str, tool_parser: str,
               adapters: Collection[str]) -> None:
        try:
            self.chat = ChatCall(chat, model_name, tool_parser, adapters)
        except ApiError as exc:
            raise renamed(exc, self.renames) from None
        self.requests = self.chat.requests

    def check(self, completion: Completion) -> None:
        try:
            self.chat.check(completion, 0)
        except ApiError as exc:
            raise renamed(exc, self.renames) from None

    def answer(self, result: Result) -> Message:
        return self.chat.answer(result)


def renamed(exc: ApiError, renames: tuple[tuple[str, str], ...]) -> ApiError:
    """A chat call's error in the field names of the API it was made from (`renames`:
    regex, replacement)."""
    param = exc.param
    if param:
        for pattern, name in renames:
            param = re.sub(pattern, name, param)
        exc.message = exc.message.replace(exc.param, param, 1)
        exc.param = param
    return exc


def strict_violation(what: str, why: str) -> ApiError:
    """The 500 of an output that its grammar should have held to its schema and did not."""
    return ApiError(500, f"{what} does not validate against its schema ({why}); it was not "
                    "returned", type="server_error", code="strict_violation")


def _tool(tool: Any, where: str) -> Tool:
    """An OpenAI function tool as rollout's Tool."""
    function = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(function, dict) or tool.get("type", "function") != "function" or \
            set(tool) - {"type", "function"}:
        raise bad_field(where, f"got {_short(tool)}",
                        '{"type": "function", "function": {"name", "description", "parameters"}}')
    unknown = sorted(set(function) - set(FUNCTION_FIELDS))
    if unknown:
        raise bad_field(f"{where}.function.{unknown[0]}", "unknown field",
                        ", ".join(FUNCTION_FIELDS))
    # `return` (what transformers' get_json_schema writes) describes the result for the
    # chat template only; rollout's Tool calls it `returns`.
    fields = {("returns" if k == "return" else k): v for k, v in function.items()
              if v is not None}
    try:
        return convert.structure(fields, Tool)
    except InvalidRequestError as exc:
        field = "return" if exc.field == "returns" else exc.field
        raise api_error(exc, f"{where}.function.{field}") from None


def _structured_outputs(body: dict) -> tuple[dict, str, dict | None] | None:
    """(rollout's structured_outputs, the OpenAI field it came from, the JSON schema as
    given, if it is one) from OpenAI's `response_format` or vLLM's `structured_outputs`."""
    fmt = body.get("response_format")
    ours = body.get("structured_outputs")
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "text" and set(fmt) == {"type"}:
            fmt = None
        elif kind == "json_object" and set(fmt) == {"type"}:
            fmt = {"json": {"type": "object"}}
        elif kind == "json_schema" and set(fmt) == {"type", "json_schema"} and isinstance(
                fmt["json_schema"], dict) and isinstance(fmt["json_schema"].get("schema"), dict):
            fmt = {"json": fmt["json_schema"]["schema"]}
        else:
            raise bad_field("response_format", f"got {_short(fmt)}",
                            '{"type": "text"}, {"type": "json_object"}, or {"type": '
                            '"json_schema", "json_schema": {"name", "schema"}}')
    if ours is not None:
        if fmt is not None:
            raise bad_field("structured_outputs", "given together with response_format",
                            "one of response_format, structured_outputs")
        if not isinstance(ours, dict):
            raise bad_field("structured_outputs", f"got {_short(ours)}",
                            "an object with one of " + ", ".join(STRUCTURED_FIELDS))
        extra = sorted(set(ours) - set(STRUCTURED_FIELDS))
        if extra:
            raise bad_field(f"structured_outputs.{extra[0]}", "not supported",
                            ", ".join(STRUCTURED_FIELDS))
        ours = {k: v for k, v in ours.items() if v is not None and v is not False}
        if ours.pop("json_object", None):  # any JSON object: a schema that says just that
            if "json" in ours:
                raise bad_field("structured_outputs.json_object", "given together with json",
                                "one of " + ", ".join(STRUCTURED_FIELDS))
            ours["json"] = {"type": "object"}
        for key, allowed in (("json", "a JSON schema"),
                             ("structural_tag", "xgrammar's structural tag")):
            if isinstance(ours.get(key), str):  # vLLM takes both as JSON text
                try:
                    ours[key] = json.loads(ours[key])
                except ValueError as exc:
                    raise bad_field(f"structured_outputs.{key}", f"not valid JSON: {exc}",
                                    allowed) from None
        given = ours.get("json")
        if isinstance(given, dict):
            ours["json"] = _json_schema(given, "structured_outputs.json")
        return ours, "structured_outputs", given if isinstance(given, dict) else None
    if fmt is not None:
        given = fmt["json"]
        fmt = {"json": _json_schema(given, "response_format.json_schema.schema")}
        return fmt, "response_format", given
    return None


def _json_schema(schema: dict, where: str) -> dict:
    """A JSON constraint's schema as the grammar engine gets it: what comes back validates
    against it, or the schema is refused here naming the keyword (see
    rollout.apps.tool_parsers.strict)."""
    try:
        return strict_schemas.prepare(schema, where)
    except InvalidRequestError as exc:
        raise api_error(exc) from None


def _check_fields(body: dict, fields: tuple[str, ...],
                  unsupported: dict[str, tuple[tuple, str]] = UNSUPPORTED_FIELDS) -> None:
    """Every field known: taken (`fields`), ignored, or, if `unsupported`, only at one of
    its default values."""
    for name, value in body.items():
        if name in fields or name in IGNORED_FIELDS:
            continue
        if name in unsupported:
            defaults, why = unsupported[name]
            if value not in defaults:
                allowed = [json.dumps(v) for v in defaults if v is not None]
                raise bad_field(name, why, " or ".join(["left out", *allowed]))
            continue
        raise bad_field(name, "unknown field", ", ".join(sorted(fields)))


def _flag(body: dict, name: str, prefix: str = "") -> bool:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise bad_field(prefix + name, f"got {value!r}", "true or false")
    return bool(value)


def _prompts(prompt: Any) -> list[dict]:
    """OpenAI's four prompt forms, one request each."""
    if isinstance(prompt, str):
        return [{"prompt": prompt}]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return [{"prompt": p} for p in prompt]
        if all(isinstance(t, int) for t in prompt):
            return [{"prompt_token_ids": prompt}]
        if all(isinstance(p, list) for p in prompt):
            return [{"prompt_token_ids": p} for p in prompt]
    raise bad_field("prompt", "missing" if prompt is None else f"got {_short(prompt)}",
                    "a string, a list of strings, a list of token ids, or a list of "
                    "token-id lists")


def _message(message: Any, where: str) -> dict:
    """An OpenAI chat message as rollout's Message fields."""
    if not isinstance(message, dict):
        raise bad_field(where, f"got {_short(message)}", "an object with role and content")
    for name, value in message.items():
        if name in EMPTY_MESSAGE_FIELDS and value in (None, [], ""):
            continue
        if name not in MESSAGE_FIELDS:
            raise bad_field(f"{where}.{name}", "unknown or unsupported field",
                            ", ".join(MESSAGE_FIELDS))
    out = {k: v for k, v in message.items() if k in MESSAGE_FIELDS and v is not None}
    if out.get("role") == "developer":  # OpenAI's newer name for system (as /v1/responses)
        out["role"] = "system"
    content = message.get("content")
    # An assistant turn that only calls tools has no content.
    out["content"] = "" if content is None else content
    if isinstance(content, list):
        out["content"] = [_part(p, f"{where}.content[{j}]") for j, p in enumerate(content)]
        if out["content"] and all(p["type"] == "text" for p in out["content"]):
            # Text parts alone are one text, joined by newlines, as vLLM's server joins
            # them for a chat template that takes text.
            out["content"] = "\n".join(str(p.get("text", "")) for p in out["content"])
    if isinstance(out.get("tool_calls"), list):
        out["tool_calls"] = [_tool_call(c, f"{where}.tool_calls[{k}]")
                             for k, c in enumerate(out["tool_calls"])]
    return out


def _part(part: Any, where: str) -> Any:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text":
        return part
    if kind == "image_url":
        # vLLM's form: `uuid` names the image; given alone, an image sent before.
        unknown = set(part) - {"type", "image_url", "uuid"}
        if unknown:
            raise bad_field(f"{where}.{sorted(unknown)[0]}", "unknown field",
                            "type, image_url, uuid")
        image, uuid = part.get("image_url"), part.get("uuid")
        if uuid is not None and not (isinstance(uuid, str) and uuid):
            raise bad_field(f"{where}.uuid", f"got {_short(uuid)}", "a non-empty string")
        if image is None and uuid is not None:
            return {"type": "image", "image": None, "uuid": uuid}
        url = image.get("url") if isinstance(image, dict) else image
        if not isinstance(url, str):
            raise bad_field(f"{where}.image_url", f"got {_short(image)}",
                            'a URL, or {"url": URL}; or null with the uuid of an image sent '
                            "before")
        # A server neither fetches URLs nor reads its own files for a client.
        if not url.startswith("data:"):
            raise bad_field(f"{where}.image_url", f"got {_short(url)}",
                            "a data: URL (base64); images are not fetched")
        return {"type": "image", "image": url, "uuid": uuid}
    raise bad_field(f"{where}.type", f"got {_short(kind)}", "text, image_url")


def _tool_call(call: Any, where: str) -> Any:
    if not isinstance(call, dict) or call.get("type", "function") != "function" or \
            not isinstance(call.get("function"), dict) or set(call) - {"id", "type", "function"}:
        raise bad_field(where, f"got {_short(call)}",
                        '{"id", "type": "function", "function": {"name", "arguments"}}')
    return {"id": call.get("id"), **call["function"]}


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


# --- responses ----------------------------------------------------------------------------


def usage(completions: list[Completion]) -> dict:
    prompt = sum(c.results[0].prompt_tokens for c in completions if c.results)
    generated = sum(r.completion_tokens for c in completions for r in c.results)
    return {"prompt_tokens": prompt, "completion_tokens": generated,
            "total_tokens": prompt + generated}


def weight_spans(result: Result) -> list[dict]:
    """Which weights made which output tokens (an extension: `Result.weight_versions`)."""
    return [{"version": s.version, "start": s.start, "end": s.end}
            for s in result.weight_versions]


def on_policy(result: Result | Chunk) -> dict:
    """What a trainer replays, where the request asked, under the names vLLM's server
    writes: `sampling_mask`, the ids each token was drawn from, and `routed_experts`, the
    experts each token ran through (base64 `.npy`, [tokens, layers, top_k])."""
    extra = {}
    if result.sampling_mask is not None:
        extra["sampling_mask"] = [list(ids) for ids in result.sampling_mask]
    if result.routed_experts is not None:
        extra["routed_experts"] = npy_base64(result.routed_experts)
    return extra


def npy_base64(experts: tuple[tuple[tuple[int, ...], ...], ...]) -> str:
    """Expert ids as base64 `.npy` bytes of int32 (NumPy's format 1.0, written here so
    the server needs no NumPy): `np.load(io.BytesIO(base64.b64decode(s)))` reads them."""
    tokens = len(experts)
    layers = len(experts[0]) if tokens else 0
    top_k = len(experts[0][0]) if layers else 0
    flat = [e for token in experts for layer in token for e in layer]
    header = f"{{'descr': '<i4', 'fortran_order': False, 'shape': {(tokens, layers, top_k)}, }}"
    header += " " * (-(10 + len(header) + 1) % 64) + "\n"  # 64-byte aligned, as NumPy's
    data = (b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header.encode("latin1")
            + struct.pack(f"<{len(flat)}i", *flat))
    return base64.b64encode(data).decode("ascii")


def token_label(token_id: int) -> str:
    return f"token_id:{token_id}"


def _logprob(value: float) -> float:
    return max(value, LOGPROB_FLOOR)


def completion_logprobs(result: Result) -> dict | None:
    if result.logprobs is None:
        return None
    tops = result.top_logprobs or [()] * len(result.logprobs)
    # As vLLM writes them: each position's chosen token, then the most likely ones (so
    # logprobs=0 gives the chosen token alone, logprobs=k at most k + 1 tokens).
    top = [{token_label(chosen): _logprob(value),
            **{token_label(t.token_id): _logprob(t.logprob) for t in position}}
           for chosen, value, position in zip(result.token_ids, result.logprobs, tops)]
    # text_offset needs each token's text, which the server cannot know without a tokenizer.
    return {"tokens": [token_label(t) for t in result.token_ids],
            "token_logprobs": [_logprob(v) for v in result.logprobs],
            "top_logprobs": top, "text_offset": None}


def prompt_logprobs(result: Result) -> list[dict | None] | None:
    """vLLM's `prompt_logprobs`: per prompt position, None at the first, then token id ->
    {logprob, rank, decoded_token} for the prompt's token and the k most likely. Ranks are
    places among those k; the prompt's token, when not among them, gets k + 1 (rollout
    keeps no rank beyond the top k)."""
    if result.prompt_logprobs is None:
        return None
    tops = result.prompt_top_logprobs or [()] * len(result.prompt_logprobs)
    out: list[dict | None] = []
    for token, value, top in zip(result.prompt_token_ids, result.prompt_logprobs, tops):
        if value is None:
            out.append(None)
            continue
        ids = [t.token_id for t in top]
        entries = {str(token): {"logprob": _logprob(value),
                                "rank": ids.index(token) + 1 if token in ids else len(ids) + 1,
                                "decoded_token": token_label(token)}}
        for rank, t in enumerate(top, 1):
            entries.setdefault(str(t.token_id), {"logprob": _logprob(t.logprob), "rank": rank,
                                                 "decoded_token": token_label(t.token_id)})
        out.append(entries)
    return out


def chat_logprobs(result: Result) -> dict | None:
    if result.logprobs is None:
        return None
    tops = result.top_logprobs or [()] * len(result.logprobs)
    content = [{"token": token_label(token), "logprob": _logprob(value), "bytes": None,
                "top_logprobs": [{"token": token_label(t.token_id),
                                  "logprob": _logprob(t.logprob), "bytes": None} for t in top]}
               for token, value, top in zip(result.token_ids, result.logprobs, tops)]
    return {"content": content, "refusal": None}
