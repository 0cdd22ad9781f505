"""Differential conformance against vLLM's own OpenAI server: the same requests to vLLM's
server and to `rollout serve`, and a field-by-field comparison of what comes back.

The pieces, used by plugins/vllm_backend/tests/test_differential.py and
bench/bench_differential.py:

- `Case`: one request (route and JSON body), from a recording of real clients
  (`load_recording`, written by bench/record_client_requests.py) or drawn by Hypothesis
  from the OpenAI schemas with vLLM's extension fields (`cases`, `draw_cases`).
- `exchange`: send a case to a server and read the answer, a stream assembled into the
  shape of the plain answer (`assemble`).
- `compare`: the differences between vLLM's answer (the reference) and rollout's. What is
  left out of the comparison by rule is in `IGNORED` and the `_normalize_*` functions, each
  with why. `classify` then sorts every difference into one of: `DOCUMENTED` (a deliberate
  difference, listed with its reason in docs/serving.md, "Differences from vLLM's server"),
  `OPEN` (a known defect not fixed yet, named so that a new difference stands out) or
  unexplained.
"""

from __future__ import annotations

import asyncio
import copy
import fnmatch
import json
import math
import string
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

ROUTES = {"/v1/completions": "completions", "/v1/chat/completions": "chat",
          "/v1/responses": "responses", "/v1/messages": "messages"}
# The routes of OpenAI's APIs (`draw_cases(api="openai")`, the recording); /v1/messages is
# Anthropic's (`draw_cases(api="messages")`, the harnesses' recorded calls).
OPENAI_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/responses")
VOCAB = 512           # the tiny model's vocabulary (rollout.kit.tiny_model)
LOGPROB_TOL = 2e-3    # float32 on one engine build; batches of other sizes move the last bits


# --- the corpus ---------------------------------------------------------------------------


@dataclass
class Case:
    path: str
    body: dict
    source: str = "hypothesis"   # the client that sent it, for recorded cases

    @property
    def kind(self) -> str:
        stream = "+stream" if self.body.get("stream") else ""
        return ROUTES[self.path] + stream

    def to_json(self) -> str:
        return json.dumps({"source": self.source, "path": self.path, "body": self.body},
                          sort_keys=True)


def load_recording(path: str | Path, model: str = "tiny") -> list[Case]:
    """The recorded requests of a JSON-lines file, `model` set to the served name."""
    cases = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            item = json.loads(line)
            body = item["body"]
            if "model" in body:
                body["model"] = model
            cases.append(Case(item["path"], body, item.get("source", "recorded")))
    return cases


# A recorded harness call's own token limit (Claude Code asks for 32,000) lowered, and its
# sample made greedy, so that it runs fast and is compared exactly.
HARNESS_MAX_TOKENS = 12


def load_harness(paths, model: str = "tiny", max_tokens: int = HARNESS_MAX_TOKENS,
                 plain_too: bool = True) -> list[Case]:
    """The recorded calls of agent harnesses (tests/data/harnesses/*.json: method, path,
    query, headers, body) as cases: the body, `model` set to the served name, `max_tokens`
    lowered and `temperature` 0. A streamed call is also sent plain (`plain_too`). The
    source is the file's name up to its first "-" (`claude_code`)."""
    cases = []
    for path in sorted(map(Path, paths)):
        record = json.loads(path.read_text())
        body = {**record["body"], "model": model, "max_tokens": max_tokens,
                "temperature": 0.0}
        source = path.name.split("-", 1)[0]
        cases.append(Case(record["path"], body, source))
        if plain_too and body.get("stream"):
            cases.append(Case(record["path"], {**body, "stream": False}, source))
    return cases


def pinned_messages(model: str = "tiny") -> list[Case]:
    """/v1/messages calls written out, each the smallest of a kind the drawn corpus may
    miss on a seed: an assistant turn of two text blocks (joined by a newline, as vLLM's
    server joins them), greedy, plain and streamed."""
    body = {"model": model, "max_tokens": 4, "temperature": 0.0, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "text", "text": "a"},
                                          {"type": "text", "text": "b"}]},
        {"role": "user", "content": "c"}]}
    return [Case("/v1/messages", body, "pinned"),
            Case("/v1/messages", {**body, "stream": True}, "pinned")]


def _strategies():
    """The Hypothesis strategies, built on first use (hypothesis is a test dependency)."""
    from hypothesis import strategies as st

    text = st.text(alphabet=string.ascii_letters + string.digits + " .,:!?<>{}\"'\n",
                   min_size=1, max_size=30)
    token_ids = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12)

    # JSON-schema features a client puts in tool parameters or response formats.
    leaf = st.one_of(
        st.just({"type": "string"}), st.just({"type": "integer"}),
        st.just({"type": "number"}), st.just({"type": "boolean"}),
        st.builds(lambda values: {"type": "string", "enum": values},
                  st.lists(st.sampled_from(["a", "b", "red", "blue", "x y"]), min_size=1,
                           max_size=3, unique=True)),
        st.just({"type": "integer", "minimum": 0, "maximum": 9}),
        st.just({"type": "string", "description": "a name", "maxLength": 5}),
        st.just({"type": ["string", "null"]}),
        st.just({"anyOf": [{"type": "integer"}, {"type": "string"}]}),
    )

    def object_of(values):
        return st.dictionaries(st.sampled_from(["a", "b", "city", "n", "items"]), values,
                               min_size=1, max_size=3).flatmap(
            lambda props: st.builds(
                lambda required, extra: {"type": "object", "properties": props,
                                         "required": required, **extra},
                st.lists(st.sampled_from(sorted(props)), unique=True),
                st.sampled_from([{}, {"additionalProperties": False}])))

    schema = st.recursive(leaf, lambda inner: st.one_of(
        object_of(inner), st.builds(lambda item: {"type": "array", "items": item,
                                                  "maxItems": 2}, inner)), max_leaves=4)
    object_schema = object_of(schema)

    tool = st.builds(
        lambda name, description, parameters, strict: {
            "type": "function", "function": {
                "name": name, **({"description": description} if description else {}),
                "parameters": parameters, **({"strict": strict} if strict is not None else {})}},
        st.sampled_from(["get_weather", "add", "lookup", "f"]), st.none() | text,
        object_schema, st.sampled_from([None, None, False, True]))
    tools = st.lists(tool, min_size=1, max_size=2, unique_by=lambda t: t["function"]["name"])

    def tool_choice(tools_):
        names = [t["function"]["name"] for t in tools_]
        return st.sampled_from(["none", "auto", "required", None,
                                *({"type": "function", "function": {"name": n}}
                                  for n in names)])

    part = st.builds(lambda t: {"type": "text", "text": t}, text)
    content = text | st.lists(part, min_size=1, max_size=2)
    plain = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant",
                                                            "developer"]),
                                   "content": content})
    call_turns = st.builds(lambda name, args: [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": name, "arguments": json.dumps(args)}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": json.dumps(args)}],
        st.sampled_from(["get_weather", "add"]),
        st.dictionaries(st.sampled_from(["a", "b"]), st.integers(0, 9), max_size=2))
    history = st.lists(plain.map(lambda m: [m]) | call_turns, max_size=2).map(
        lambda turns: [m for t in turns for m in t])
    messages = st.builds(lambda h, last: h + [{"role": "user", "content": last}], history,
                         content)

    # Properties out of alphabetical order, all required: the JSON keys come in the
    # schema's order.
    ordered = {"type": "object", "properties": {"zone": {"type": "integer"},
                                                "age": {"type": "integer"}},
               "required": ["zone", "age"]}
    formats = st.one_of(
        st.just({"type": "text"}), st.just({"type": "json_object"}),
        st.builds(lambda s: {"type": "json_schema", "json_schema": {"name": "answer",
                                                                     "schema": s}},
                  object_schema | st.just(ordered)))
    structured = st.one_of(
        st.builds(lambda c: {"choice": c}, st.lists(st.sampled_from(
            ["yes", "no", "maybe", "42"]), min_size=1, max_size=3, unique=True)),
        st.sampled_from([{"regex": "[0-9]{1,3}"}, {"regex": "(ab|cd)+"},
                         {"json": {"type": "object", "properties": {"n": {"type": "integer"}},
                                   "required": ["n"]}},
                         {"json": ordered}]))

    @st.composite
    def sampling(draw, chat: bool) -> dict:
        """Sampling fields and vLLM's extensions; greedy, or seeded so that a sample is
        reproducible on both servers."""
        body: dict = {}
        if draw(st.booleans()):
            body["temperature"] = 0.0
        else:
            body["temperature"] = draw(st.sampled_from([0.5, 1.0]))
            body["seed"] = draw(st.integers(0, 2**31 - 1))
            if draw(st.booleans()):
                body["n"] = draw(st.integers(1, 3))
        # Rare ones on a middle value: Hypothesis favours the ends of a range.
        if draw(st.integers(0, 40)) == 17:  # both servers refuse n > 1 with greedy decoding
            body.update(temperature=0.0, n=2)
        if draw(st.integers(0, 40)) == 23:  # a field neither knows (a typo)
            body[draw(st.sampled_from(["temprature", "max_new_tokens"]))] = 1
        optional = {
            "top_p": st.sampled_from([1.0, 0.9, 0.5]),
            "top_k": st.sampled_from([-1, 0, 1, 5, 40]),
            "min_p": st.sampled_from([0.0, 0.05]),
            "stop": st.sampled_from(["a", ["e", " "], ["xyz"], []]),
            "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=3),
            "min_tokens": st.integers(0, 4),
            "ignore_eos": st.booleans(),
            "skip_special_tokens": st.booleans(),
            "presence_penalty": st.sampled_from([0.0, 0.5, -0.5]),
            "frequency_penalty": st.sampled_from([0.0, 0.4]),
            "repetition_penalty": st.sampled_from([1.0, 1.2, 0.9]),
            "logit_bias": st.dictionaries(st.integers(0, VOCAB - 1).map(str),
                                          st.sampled_from([-100.0, 5.0]), max_size=2),
            "include_stop_str_in_output": st.booleans(),
            "return_token_ids": st.booleans(),
            "return_tokens_as_token_ids": st.just(True),
            "user": st.just("someone"),
        }
        for name, strategy in optional.items():
            if draw(st.integers(0, 3)) == 0:
                body[name] = draw(strategy)
        if chat and draw(st.booleans()):
            body["max_completion_tokens"] = draw(st.integers(1, 10))
        else:
            body["max_tokens"] = draw(st.integers(1, 10))
        if body.get("min_tokens") and body["min_tokens"] > body.get(
                "max_tokens", body.get("max_completion_tokens", 16)):
            body["min_tokens"] = 0
        if draw(st.integers(0, 3)) == 0:
            body["stream"] = True
            if draw(st.booleans()):
                body["stream_options"] = {"include_usage": draw(st.booleans())}
        constraint = draw(st.sampled_from([None, None, None, "response_format",
                                           "structured_outputs"]))
        if constraint == "response_format":
            body["response_format"] = draw(formats)
        elif constraint == "structured_outputs":
            body["structured_outputs"] = draw(structured)
        return body

    @st.composite
    def completions(draw) -> Case:
        prompt = draw(st.one_of(text, st.lists(text, min_size=1, max_size=2), token_ids,
                                st.lists(token_ids, min_size=1, max_size=2)))
        body = {"model": "tiny", "prompt": prompt, **draw(sampling(False))}
        if draw(st.integers(0, 2)) == 0:
            body["logprobs"] = draw(st.integers(0, 5))
        if draw(st.integers(0, 5)) == 3:
            body["prompt_logprobs"] = draw(st.integers(0, 3))
        return Case("/v1/completions", body)

    @st.composite
    def chat(draw) -> Case:
        body = {"model": "tiny", "messages": draw(messages), **draw(sampling(True))}
        if draw(st.integers(0, 2)) == 0:
            body["logprobs"] = True
            if draw(st.booleans()):
                body["top_logprobs"] = draw(st.integers(0, 5))
        if draw(st.integers(0, 7)) == 3:
            body["prompt_logprobs"] = draw(st.integers(0, 3))
        if draw(st.integers(0, 3)) == 0:
            body["tools"] = draw(tools)
            choice = draw(tool_choice(body["tools"]))
            if choice is not None:
                body["tool_choice"] = choice
            if draw(st.integers(0, 3)) == 0:
                body["parallel_tool_calls"] = draw(st.booleans())
            if choice not in (None, "none", "auto"):  # a forced call sets its own constraint
                body.pop("response_format", None)
                body.pop("structured_outputs", None)
        return Case("/v1/chat/completions", body)

    @st.composite
    def responses(draw) -> Case:
        item = st.builds(lambda role, t: {"role": role, "content": t},
                         st.sampled_from(["user", "system", "developer"]), text)
        input_ = draw(text | st.lists(item, min_size=1, max_size=2).map(
            lambda items: items + [{"role": "user", "content": "hi"}]))
        body = {"model": "tiny", "input": input_,
                "max_output_tokens": draw(st.integers(1, 10)),
                "temperature": 0.0}
        if draw(st.booleans()):
            body["instructions"] = draw(text)
        if draw(st.integers(0, 3)) == 0:
            body["stream"] = True
        if draw(st.integers(0, 3)) == 0:
            body["text"] = {"format": draw(st.sampled_from([
                {"type": "text"}, {"type": "json_object"},
                {"type": "json_schema", "name": "answer",
                 "schema": {"type": "object", "properties": {"n": {"type": "integer"}}}},
                {"type": "json_schema", "name": "person", "schema": ordered}]))}
        if draw(st.integers(0, 4)) == 0:
            body["tools"] = [{"type": "function", "name": t["function"]["name"],
                              "parameters": t["function"]["parameters"]}
                             for t in draw(tools)]
            body["tool_choice"] = draw(st.sampled_from(["auto", "none"]))
        if draw(st.integers(0, 4)) == 0:
            body["top_p"] = draw(st.sampled_from([1.0, 0.5]))
        return Case("/v1/responses", body)

    # --- Anthropic's Messages API (/v1/messages) ---------------------------------------
    # No `seed` there (on either server): a sample is compared exactly only when greedy
    # (temperature 0), and otherwise by its shape (`_normalize_messages`).
    block = st.builds(lambda t: {"type": "text", "text": t}, text)
    blocks = st.lists(block, min_size=1, max_size=2)
    said = text | blocks
    system = st.one_of(text, blocks, st.builds(
        lambda b: [{**b[0], "cache_control": {"type": "ephemeral"}}, *b[1:]], blocks))
    plain_turn = st.builds(lambda role, c: [{"role": role, "content": c}],
                           st.sampled_from(["user", "assistant"]), said)
    result_content = st.one_of(text, blocks, st.just(""))

    def exchange_turns(name, args, before, result, error, after):
        use = {"type": "tool_use", "id": "toolu_1", "name": name, "input": args}
        answer = {"type": "tool_result", "tool_use_id": "toolu_1", "content": result}
        if error is not None:
            answer["is_error"] = error
        return [{"role": "assistant", "content": before + [use]},
                {"role": "user", "content": [answer] + after}]

    tool_exchange = st.builds(
        exchange_turns, st.sampled_from(["get_weather", "add"]),
        st.dictionaries(st.sampled_from(["a", "b"]), st.integers(0, 9), max_size=2),
        st.lists(block, max_size=1), result_content, st.sampled_from([None, None, True]),
        st.lists(block, max_size=1))
    anthropic_history = st.lists(plain_turn | tool_exchange, max_size=2).map(
        lambda turns: [m for t in turns for m in t])
    anthropic_tool = st.builds(
        lambda name, description, schema, strict: {
            "name": name, **({"description": description} if description else {}),
            "input_schema": schema, **({"strict": strict} if strict is not None else {})},
        st.sampled_from(["get_weather", "add", "lookup", "f"]), st.none() | text,
        object_schema, st.sampled_from([None, None, None, False, True]))
    anthropic_tools = st.lists(anthropic_tool, min_size=1, max_size=2,
                               unique_by=lambda t: t["name"])

    def anthropic_choice(tools_):
        return st.builds(
            lambda kind, name, parallel: {
                "type": kind, **({"name": name} if kind == "tool" else {}),
                **({"disable_parallel_tool_use": parallel} if parallel is not None else {})},
            st.integers(0, 3).map(lambda i: ("none", "auto", "any", "tool")[i]),
            st.sampled_from([t["name"] for t in tools_]),
            st.sampled_from([None, None, None, False, True]))

    @st.composite
    def messages_call(draw) -> Case:
        body: dict = {"model": "tiny", "max_tokens": draw(st.integers(1, 10)),
                      "messages": draw(anthropic_history) + [
                          {"role": "user", "content": draw(said)}]}
        if draw(st.booleans()):
            body["system"] = draw(system)
        # Greedy most of the time (compared exactly); else a free sample, at the default
        # temperature (1) or a given one.
        greedy = draw(st.sampled_from([True, True, True, False]))
        if greedy:
            body["temperature"] = 0.0
        elif draw(st.booleans()):
            body["temperature"] = draw(st.sampled_from([0.5, 1.0]))
        optional = {
            "top_p": st.sampled_from([1.0, 0.9, 0.5]),
            "top_k": st.sampled_from([1, 5, 40]),
            "stop_sequences": st.sampled_from([["a"], ["e", " "], ["xyz"], [], ["\n"]]),
            "metadata": st.just({"user_id": "someone"}),
        }
        for name, strategy in optional.items():
            if draw(st.integers(0, 3)) == 0:
                body[name] = draw(strategy)
        if draw(st.integers(0, 3)) == 0:
            body["tools"] = draw(anthropic_tools)
            if draw(st.integers(0, 3)) > 0:
                body["tool_choice"] = draw(anthropic_choice(body["tools"]))
        if draw(st.integers(0, 2)) == 0:
            body["stream"] = True
        # Rare ones on a middle value: Hypothesis favours the ends of a range.
        rare = draw(st.integers(0, 40))
        if rare == 17:  # a field neither knows (a typo, or OpenAI's)
            body[draw(st.sampled_from(["temprature", "seed", "max_completion_tokens"]))] = 1
        elif rare == 23:  # both refuse
            body["max_tokens"] = 0
        if draw(st.integers(0, 7)) == 5:  # Claude Code's context: a system message there
            body["messages"].insert(-1, {"role": "system", "content": draw(said)})
        return Case("/v1/messages", body)

    return {"openai": st.one_of(completions(), completions(), chat(), chat(), responses()),
            "messages": messages_call()}


def cases(api: str = "openai"):
    """A Hypothesis strategy of `Case`s: over OpenAI's three routes (`api` "openai"), or
    Anthropic's /v1/messages ("messages")."""
    return _strategies()[api]


def draw_cases(count: int, seed: int = 0, api: str = "openai") -> list[Case]:
    """`count` distinct cases of `api` (see `cases`) drawn by Hypothesis from `seed`: the
    same ones on every run of one version of the strategies."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as seeded

    drawn: list[Case] = []

    # Hypothesis draws some examples twice: twice as many drawn, the first `count` kept.
    @seeded(seed)
    @settings(max_examples=2 * count, database=None, phases=[Phase.generate],
              deadline=None, suppress_health_check=list(HealthCheck))
    @given(cases(api))
    def collect(case):
        drawn.append(case)

    collect()
    unique = list({c.to_json(): c for c in drawn}.values())
    if len(unique) < count:
        raise ValueError(f"drew {len(unique)} distinct cases, not {count}")
    return unique[:count]


# --- sending ------------------------------------------------------------------------------


@dataclass
class Outcome:
    status: int
    body: Any           # the JSON answer; a stream assembled (see `assemble`)
    error: str = ""     # the error message, for a refused request

    @property
    def ok(self) -> bool:
        return self.status == 200


async def exchange(session, base_url: str, case: Case, timeout: float = 300) -> Outcome:
    """Send `case` to the server at `base_url` (an aiohttp session) and read its answer."""
    import aiohttp

    async with session.post(base_url + case.path, json=case.body,
                            timeout=aiohttp.ClientTimeout(total=timeout)) as response:
        raw = await response.read()
        if response.status != 200:
            try:
                body = json.loads(raw)
            except ValueError:
                body = {"raw": raw.decode(errors="replace")}
            error = body.get("error", body) if isinstance(body, dict) else body
            message = error.get("message", "") if isinstance(error, dict) else str(error)
            return Outcome(response.status, body, str(message))
        if case.body.get("stream"):
            return Outcome(200, assemble(case, parse_events(raw.decode())))
        return Outcome(200, json.loads(raw))


def parse_events(text: str) -> list[dict]:
    """The JSON events of a server-sent event stream, each `{"event": type, "data": obj}`
    (type None where the stream names none); `[DONE]` ends it."""
    events, kind = [], None
    for line in text.splitlines():
        if line.startswith("event:"):
            kind = line.removeprefix("event:").strip()
        elif line.startswith("data:"):
            data = line.removeprefix("data:").strip()
            if data == "[DONE]":
                events.append({"event": "[DONE]", "data": None})
                break
            events.append({"event": kind, "data": json.loads(data)})
            kind = None
    return events


def assemble(case: Case, events: list[dict]) -> dict:
    """A stream as the plain answer it stands for, plus what the stream's shape itself
    must agree on (`stream`: chunk objects, where usage came, how it ended)."""
    datas = [e["data"] for e in events if e["data"] is not None]
    errors = [d for d in datas if "error" in d and "choices" not in d and "type" not in d]
    shape = {"ends_with_done": bool(events) and events[-1]["event"] == "[DONE]",
             "error_events": len(errors)}
    if case.path == "/v1/messages":
        return _assemble_message(events)
    if case.path == "/v1/responses":
        types = [e["event"] or e["data"].get("type") for e in events if e["data"] is not None]
        final = next((d["response"] for d in reversed(datas)
                      if d.get("type") in ("response.completed", "response.incomplete",
                                           "response.failed")), None)
        shape.update(event_types=sorted(set(types)), last_event=types[-1] if types else None,
                     sequence_numbers_increase=all(
                         b.get("sequence_number", 0) > a.get("sequence_number", 0)
                         for a, b in zip(datas, datas[1:])))
        return {"response": final, "stream": shape}
    chat = case.path == "/v1/chat/completions"
    choices: dict[int, dict] = {}
    usage, objects, usage_last, prompt_ids = None, set(), False, None
    chunk_keys, choice_keys = set(), set()
    for d in datas:
        if "choices" not in d:
            continue
        objects.add(d.get("object"))
        # The chunks' own fields, those with a value (a null one is an absent one).
        chunk_keys |= {k for k, v in d.items() if not _absent(v)}
        choice_keys |= {k for c in d["choices"] for k, v in c.items() if not _absent(v)}
        for c in d["choices"]:
            acc = choices.setdefault(c["index"], {"index": c["index"], "finish_reason": None,
                                                  "logprobs": None})
            _merge_choice(acc, c, chat)
        if d.get("usage"):
            usage = d["usage"]
            usage_last = not d["choices"]
        if d.get("prompt_token_ids") is not None:   # vLLM: a chat stream's first chunk
            prompt_ids = d["prompt_token_ids"]
    # Fields the rules leave out (IGNORED, or compared on the assembled answer), by name.
    skip = {"id", "created", "system_fingerprint", "weight_version", "weight_versions",
            "usage", "choices", "prompt_token_ids", "token_ids", "stop_reason", "logprobs",
            "finish_reason", "tool_call_errors"}
    shape.update(objects=sorted(map(str, objects)), usage_chunk_without_choices=usage_last,
                 chunk_fields=sorted(chunk_keys - skip), choice_fields=sorted(choice_keys - skip))
    body = {"object": "chat.completion" if chat else "text_completion",
            "model": datas[0].get("model") if datas else None,
            "choices": [choices[i] for i in sorted(choices)], "usage": usage, "stream": shape}
    if prompt_ids is not None:
        body["prompt_token_ids"] = prompt_ids
    return body


def _assemble_message(events: list[dict]) -> dict:
    """Anthropic's events as the message they add up to (as the anthropic SDK accumulates
    them: message_start's message, each block from its start and deltas, message_delta's
    stop_reason, stop_sequence and usage over message_start's), plus the stream's shape:
    the events' order, each block started, changed and stopped in turn, an error event,
    and message_start's usage (compared apart: it is what a client knows first)."""
    message: dict | None = None
    blocks: dict[int, dict] = {}
    partial: dict[int, str] = {}
    open_, order_ok, kinds = set(), True, []
    start_usage = None
    for e in events:
        data = e["data"]
        if not isinstance(data, dict):
            continue
        kind = e["event"] or data.get("type")
        kinds.append(kind)
        if kind == "message_start":
            message = copy.deepcopy(data.get("message") or {})
            start_usage = copy.deepcopy(message.get("usage"))
            order_ok &= len(kinds) == 1 and message.get("content") == []
        elif kind == "content_block_start":
            index = data.get("index")
            order_ok &= index == len(blocks) and not open_
            blocks[index] = copy.deepcopy(data.get("content_block") or {})
            open_.add(index)
        elif kind == "content_block_delta":
            index, change = data.get("index"), data.get("delta") or {}
            order_ok &= index in open_
            into = blocks.setdefault(index, {})
            if change.get("type") == "text_delta":
                into["text"] = into.get("text", "") + (change.get("text") or "")
            elif change.get("type") == "input_json_delta":
                partial[index] = partial.get(index, "") + (change.get("partial_json") or "")
            else:
                into.setdefault("other_deltas", []).append(change.get("type"))
        elif kind == "content_block_stop":
            index = data.get("index")
            order_ok &= index in open_
            open_.discard(index)
        elif kind == "message_delta" and message is not None:
            change = data.get("delta") or {}
            for key in ("stop_reason", "stop_sequence"):
                if key in change:
                    message[key] = change[key]
            message["usage"] = {**(message.get("usage") or {}), **(data.get("usage") or {})}
    for index, text in partial.items():
        try:
            blocks[index]["input"] = json.loads(text) if text else {}
        except ValueError:
            blocks[index]["input"] = text   # not JSON: compared as the text it is
    if message is not None:
        message["content"] = [blocks[i] for i in sorted(blocks)]
    body = message if message is not None else {}
    body["stream"] = {
        "event_order": order_ok and not open_ and kinds[-2:] == ["message_delta",
                                                                "message_stop"],
        "event_types": sorted(set(kinds)), "error_events": kinds.count("error"),
        "start_usage": start_usage}
    return body


def _merge_choice(acc: dict, c: dict, chat: bool) -> None:
    if c.get("finish_reason") is not None:
        acc["finish_reason"] = c["finish_reason"]
    for key in ("stop_reason",):
        if c.get(key) is not None:
            acc[key] = c[key]
    if c.get("token_ids") is not None:
        acc["token_ids"] = acc.get("token_ids", []) + list(c["token_ids"])
    if c.get("prompt_token_ids") is not None:
        acc["prompt_token_ids"] = c["prompt_token_ids"]
    lp = c.get("logprobs")
    if chat:
        message = acc.setdefault("message", {"role": None, "content": None})
        delta = c.get("delta") or {}
        if delta.get("role"):
            message["role"] = delta["role"]
        if delta.get("content"):
            message["content"] = (message["content"] or "") + delta["content"]
        for call in delta.get("tool_calls") or []:
            calls = message.setdefault("tool_calls", [])
            while len(calls) <= call.get("index", 0):
                calls.append({"id": None, "type": "function",
                              "function": {"name": "", "arguments": ""}})
            into = calls[call.get("index", 0)]
            into["id"] = call.get("id") or into["id"]
            into["type"] = call.get("type") or into["type"]
            function = call.get("function") or {}
            into["function"]["name"] += function.get("name") or ""
            into["function"]["arguments"] += function.get("arguments") or ""
        if lp and lp.get("content"):
            acc["logprobs"] = acc["logprobs"] or {"content": []}
            acc["logprobs"]["content"] += lp["content"]
    else:
        acc["text"] = acc.get("text", "") + (c.get("text") or "")
        if lp:
            into = acc["logprobs"] = acc["logprobs"] or {}
            for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                if lp.get(key) is not None:
                    into[key] = into.get(key, []) + list(lp[key])


# --- comparing ----------------------------------------------------------------------------


@dataclass
class Difference:
    kind: str        # the case's kind: route, "+stream" for a stream
    field: str       # where, indices left out: "choices[].message.content"
    detail: str
    case: int = -1   # the case's index in the corpus
    explained: str = ""   # the DOCUMENTED or OPEN entry that explains it, if any


# Left out of every comparison, each by rule.
IGNORED = {
    # Made up per response by each server.
    "id": "a fresh id per response",
    "created": "the server's clock",
    "created_at": "the server's clock",
    "choices[].message.tool_calls[].id": "a fresh id per call",
    "output[].id": "a fresh id per output item",
    "output[].call_id": "a fresh id per call",
    # Describe the server, not the answer.
    "system_fingerprint": "vLLM's build",
    "metrics": "vLLM's per-request timing",
    # Prefix-cache hits depend on which requests each server ran before, and when.
    "usage.prompt_tokens_details.cached_tokens": "the prefix cache's state",
    "usage.input_tokens_details.cached_tokens": "the prefix cache's state",
    # Hand-offs between vLLM's disaggregated prefill/decode instances; not in this server.
    "kv_transfer_params": "vLLM's disaggregated serving",
    "ec_transfer_params": "vLLM's disaggregated serving",
    "choices[].routed_experts": "vLLM writes null unless started to record routing; "
                                "rollout writes it where asked (return_routed_experts)",
    # rollout's extensions, which vLLM's server lacks (docs/serving.md, "Responses").
    "choices[].weight_versions": "rollout's extension: which weights made which tokens",
    "choices[].message.tool_call_errors": "rollout's extension: why text is no call",
    "output[].tool_call_errors": "rollout's extension",
    "tool_call_errors": "rollout's extension",
    # The stream's own shape (event kinds) is compared under `stream`; the final response
    # of a Responses stream is compared like a plain one.
    # /v1/messages: a call's id (vLLM's chat call id, rollout's toolu_... ), and rollout's
    # extension, as on the OpenAI routes.
    "content[].id": "a fresh id per call",
    "weight_versions": "rollout's extension: which weights made which tokens",
}


def _ids(case: Case) -> bool:
    """Whether both servers name logprob tokens by id for this case."""
    return case.body.get("return_tokens_as_token_ids") is True


def deterministic(case: Case) -> bool:
    """Greedy, or seeded: the same tokens on both servers."""
    body = case.body
    if body.get("seed") is not None:
        return True
    temperature = body.get("temperature")
    return temperature is not None and temperature == 0


def _normalize_completions(case: Case, body: dict) -> dict:
    for choice in body.get("choices") or []:
        lp = choice.get("logprobs")
        if not isinstance(lp, dict):
            continue
        # text_offset needs each token's text: rollout has no tokenizer and sends null
        # (docs/serving.md, "Responses"): left out.
        lp.pop("text_offset", None)
        if not _ids(case):
            # vLLM names tokens by their text unless asked for ids, rollout always by id
            # (DOCUMENTED["token names"]): the names are left out, the values kept, as a
            # list from the most likely (see `_align_named_tops` for what vLLM merges).
            lp.pop("tokens", None)
            tops = lp.get("top_logprobs")
            if isinstance(tops, list):
                lp["top_logprobs"] = [sorted(t.values(), reverse=True)
                                      if isinstance(t, dict) else t for t in tops]
        elif isinstance(lp.get("top_logprobs"), list):
            lp["top_logprobs"] = [_untied_names(t) for t in lp["top_logprobs"]]
    return body


def _untied_names(top):
    """A completions position's top logprobs (by id), the tied ones named by rank only."""
    if not isinstance(top, dict):
        return top
    tied = _tied(list(top.values()))
    return {(f"token_id:tied-{rank}" if v in tied else k): v
            for rank, (k, v) in enumerate(top.items())}


def _tied(logprobs: list) -> set:
    """The values that several tokens share: the tokens a constraint masked (minus
    infinity, sent as -9999 by both servers), or tokens the model scores the same. Each
    engine lists tied tokens in its own order, so their names are not compared."""
    return {v for v in logprobs if isinstance(v, (int, float)) and (
        v <= -9999 or logprobs.count(v) > 1)}


def _align_named_tops(ref: dict, got: dict) -> None:
    """A completions position's top logprobs, keyed by token text on vLLM's side, merge the
    tokens whose text is the same (two partial UTF-8 bytes both read ""; the chosen token
    and the same token among the most likely): vLLM's are equal to rollout's when each of
    vLLM's values is one of rollout's. Such a position takes vLLM's list on both sides. And
    the other way round, where two tokens tie: vLLM's sampler may choose one and its top
    list hold the other (two keys), where rollout's chose the one it lists (one key)."""
    pairs = zip(ref.get("choices") or [], got.get("choices") or [])
    for a, b in pairs:
        tops_a = (a.get("logprobs") or {}).get("top_logprobs")
        tops_b = (b.get("logprobs") or {}).get("top_logprobs")
        if not (isinstance(tops_a, list) and isinstance(tops_b, list)):
            continue
        for k, (x, y) in enumerate(zip(tops_a, tops_b)):
            if isinstance(x, list) and isinstance(y, list) and (
                    _values_within(x, y) or _values_within(y, x)):
                tops_b[k] = x


def _values_within(x: list, y: list) -> bool:
    """`x` no longer than `y`, and each of its values one of `y`'s."""
    return len(x) <= len(y) and all(
        any(math.isclose(v, w, abs_tol=LOGPROB_TOL) for w in y) for v in x)


def _normalize_chat(case: Case, body: dict) -> dict:
    for choice in body.get("choices") or []:
        lp = choice.get("logprobs")
        for entry in (lp or {}).get("content") or []:
            # `bytes` needs the token's text: rollout sends null (DOCUMENTED["token names"]).
            entry.pop("bytes", None)
            if not _ids(case):
                entry.pop("token", None)
            tops = entry.get("top_logprobs") or []
            tied = _tied([top.get("logprob") for top in tops])
            for top in tops:
                top.pop("bytes", None)
                if not _ids(case) or top.get("logprob") in tied:
                    top.pop("token", None)
        message = choice.get("message") or {}
        for call in message.get("tool_calls") or []:
            # Arguments compared as the JSON they hold, not its spacing.
            function = call.get("function") or {}
            try:
                function["arguments"] = json.loads(function.get("arguments"))
            except (TypeError, ValueError):
                pass
    return body


def _normalize_responses(case: Case, body: dict) -> dict:
    # A Responses answer repeats the request's settings (temperature, tools, text, ...):
    # echoed settings are compared only where the request set them, since each server
    # fills in its own defaults otherwise (DOCUMENTED["responses echo"]).
    echoed = ("instructions", "tools", "tool_choice", "parallel_tool_calls", "temperature",
              "top_p", "max_output_tokens", "previous_response_id", "text", "truncation",
              "metadata", "store", "service_tier", "top_logprobs", "max_tool_calls",
              "background", "prompt", "reasoning", "user", "presence_penalty",
              "frequency_penalty")
    for key in echoed:
        if key not in case.body:
            body.pop(key, None)
    if "tools" in body and isinstance(body["tools"], list):
        # Each server writes the tool back with its own defaults filled in: names compared.
        body["tools"] = [t.get("name") for t in body["tools"] if isinstance(t, dict)]
    usage = body.get("usage") or {}
    # vLLM's per-turn breakdowns of its own agent loop (empty lists here); rollout writes
    # the standard counts only.
    for details in ("input_tokens_details", "output_tokens_details"):
        if isinstance(usage.get(details), dict):
            usage[details] = {k: v for k, v in usage[details].items()
                              if k in ("cached_tokens", "reasoning_tokens")}
    for item in body.get("output") or []:
        for part in item.get("content") or []:
            if isinstance(part, dict):
                part.pop("logprobs", None)   # null / absent: no logprobs on this route
        if item.get("type") == "function_call":
            try:
                item["arguments"] = json.loads(item.get("arguments"))
            except (TypeError, ValueError):
                pass
    # vLLM's own fields for its internal agent loop: the messages it rendered (null unless
    # asked for with enable_response_messages, a vLLM-only field).
    body.pop("input_messages", None)
    body.pop("output_messages", None)
    return body


STOP_REASONS = ("end_turn", "max_tokens", "stop_sequence", "tool_use")


def _anthropic_usage(usage: Any) -> Any:
    """A Messages usage as the prompt's whole length and the tokens made. Anthropic's
    `input_tokens` leaves out the prefix cache's part (`cache_read_input_tokens`,
    `cache_creation_input_tokens`); vLLM counts the cache only with
    --enable-prompt-tokens-details (else its input_tokens is the whole prompt and the cache
    fields are left out), and each server's cache holds what it ran before: the sum is
    compared."""
    if not isinstance(usage, dict):
        return usage
    whole = sum(usage.get(k) or 0 for k in ("input_tokens", "cache_read_input_tokens",
                                            "cache_creation_input_tokens"))
    return {"input_tokens": whole, "output_tokens": usage.get("output_tokens")}


def _normalize_messages(case: Case, body: dict) -> dict:
    if "usage" in body:
        body["usage"] = _anthropic_usage(body["usage"])
    stream = body.get("stream")
    if isinstance(stream, dict) and "start_usage" in stream:
        stream["start_usage"] = _anthropic_usage(stream["start_usage"])
    if deterministic(case):
        return body
    if isinstance(stream, dict) and isinstance(stream.get("event_types"), list):
        # Whether a block is sent follows the sample (none for a sample of one cut
        # character on vLLM's side).
        stream["event_types"] = [t for t in stream["event_types"]
                                 if not str(t).startswith("content_block")]
    # A free sample (no seed on this route): its shape. Each block well formed, a stop
    # reason of Anthropic's, a stop sequence of the request's, no more tokens than asked.
    names = {t.get("name") for t in case.body.get("tools") or [] if isinstance(t, dict)}
    stops = case.body.get("stop_sequences") or []
    content = body.get("content")
    if isinstance(content, list):
        body["content"] = all(isinstance(b, dict) and (
            (b.get("type") == "text" and isinstance(b.get("text"), str))
            or (b.get("type") == "tool_use" and b.get("name") in names
                and isinstance(b.get("input"), dict))) for b in content)
    if body.get("stop_reason") in STOP_REASONS:
        body["stop_reason"] = "one of Anthropic's"
    if body.get("stop_sequence") is None or body.get("stop_sequence") in stops:
        body["stop_sequence"] = "none, or one of the request's"
    usage = body.get("usage")
    if isinstance(usage, dict) and isinstance(usage.get("output_tokens"), int):
        usage["output_tokens"] = ("within" if usage["output_tokens"] <= case.body.get(
            "max_tokens", 0) else "over") + " max_tokens"
    return body


def normalize(case: Case, outcome: Outcome) -> Any:
    body = copy.deepcopy(outcome.body)
    if not outcome.ok or not isinstance(body, dict):
        return body
    if case.path == "/v1/messages":
        return _normalize_messages(case, body)
    if case.path == "/v1/responses":
        if case.body.get("stream"):
            stream = body.get("stream")
            body = _normalize_responses(case, body.get("response") or {})
            body["stream"] = stream
            return body
        return _normalize_responses(case, body)
    if case.path == "/v1/chat/completions":
        return _normalize_chat(case, body)
    return _normalize_completions(case, body)


def _absent(value: Any) -> bool:
    """A field one server leaves out and the other sends empty: the same answer (vLLM
    writes every optional field, as null, rollout only those it has)."""
    return value is None or value == [] or value == {}


def _ignored(path: str) -> bool:
    return path in IGNORED or any(fnmatch.fnmatchcase(path, p) for p in IGNORED if "*" in p)


def _walk(ref: Any, got: Any, path: str, exact: bool, out: list[tuple[str, str]]) -> None:
    if _ignored(path):
        return
    if path.endswith(("prompt_logprobs", "prompt_token_ids")):
        exact = True  # the prompt's, the same however the sample is drawn
    if isinstance(ref, dict) and isinstance(got, dict):
        for key in list(ref) + [k for k in got if k not in ref]:
            # Keys that name tokens (logprob dicts) are one field in the table.
            name = "<token>" if key.isdigit() or key.startswith("token_id:") else key
            sub = f"{path}.{name}" if path else name
            if _ignored(sub):
                continue
            if key not in got:
                if not _absent(ref[key]):
                    out.append((sub, f"only vLLM has it: {_short(ref[key])}"))
            elif key not in ref:
                if not _absent(got[key]):
                    out.append((sub, f"only rollout has it: {_short(got[key])}"))
            else:
                _walk(ref[key], got[key], sub, exact, out)
        return
    if isinstance(ref, list) and isinstance(got, list) and exact and ref and got and all(
            not isinstance(v, (dict, list)) for v in ref + got):
        # A list of ids or numbers is one field: one difference, not one per item.
        if len(ref) != len(got) or any(
                not _same_scalar(a, b) for a, b in zip(ref, got)):
            out.append((path, f"{_short(ref)} vs {_short(got)}"))
        return
    if isinstance(ref, list) and isinstance(got, list):
        # Free samples differ in length; the list of choices / output items does not.
        if len(ref) != len(got) and (exact or path in ("choices", "output")):
            out.append((path, f"length {len(ref)} vs {len(got)}"))
        for a, b in zip(ref, got):
            _walk(a, b, path + "[]", exact, out)
        return
    numbers = (int, float)
    if isinstance(ref, numbers) and isinstance(got, numbers) and not isinstance(ref, bool) \
            and not isinstance(got, bool):
        if exact and not math.isclose(ref, got, rel_tol=0, abs_tol=LOGPROB_TOL):
            out.append((path, f"{ref!r} vs {got!r}"))
        return
    if ref is None and isinstance(got, str) and not got.strip("\ufffd") and path.endswith(
            "content"):  # a streamed answer of one cut character: vLLM sent no content
        out.append((path, CUT_CHARACTER))
        return
    if type(ref) is not type(got):
        out.append((path, f"type {type(ref).__name__} vs {type(got).__name__}: "
                          f"{_short(ref)} vs {_short(got)}"))
        return
    # Free samples: text and token ids differ; finish reasons, roles, objects do not.
    loose_ok = not exact and path.endswith(("text", "content", "arguments", "token_ids",
                                            "token", "name"))
    if ref != got and not loose_ok:
        text = path.endswith(("text", "content"))
        if not text:
            out.append((path, f"{_short(ref)} vs {_short(got)}"))
        elif ref.strip("\ufffd") == got.strip("\ufffd"):
            out.append((path, CUT_CHARACTER))
        elif got.strip("\ufffd") and ref.rstrip("\ufffd").endswith(got.strip("\ufffd")) \
                and "\ufffd" in ref:
            out.append((path, PROMPT_TEXT))
        elif got.startswith(ref):  # ("" where the stop token came first)
            out.append((path, STOP_TOKEN_TEXT))
        elif _without_special(ref) != ref:  # (and bytes beside them decode otherwise)
            out.append((path, SPECIAL_TEXT))
        else:
            out.append((path, f"{_short(ref)} vs {_short(got)}"))


# A sample that ends inside a character: vLLM holds the incomplete bytes back; one whose
# prompt ends inside a character: vLLM decodes the first tokens together with the prompt's
# last ones, and the text starts with U+FFFD. rollout's text is the decoding of token_ids
# alone (DOCUMENTED["cut character"]).
CUT_CHARACTER = "the texts differ by U+FFFD at an end (a character cut by the sample's ends)"

# vLLM's chat top_logprobs: the sampled token first, then the most likely others, cut to
# top_logprobs entries (so a sampled token outside the k most likely pushes the k-th out);
# rollout's are the k most likely, as OpenAI defines them (DOCUMENTED["chat top_logprobs"]).
CHAT_TOPS = "vLLM lists the sampled token first in top_logprobs; rollout the k most likely"


def _chat_tops_in_vllm_order(ref: dict, got: dict) -> bool:
    """Where rollout's chat top_logprobs differ from vLLM's only by vLLM's ordering (see
    CHAT_TOPS), put rollout's in vLLM's order; whether any was."""
    changed = False
    for a, b in zip(ref.get("choices") or [], got.get("choices") or []):
        for x, y in zip(((a.get("logprobs") or {}).get("content") or []),
                        ((b.get("logprobs") or {}).get("content") or [])):
            tops_a, tops_b = x.get("top_logprobs") or [], y.get("top_logprobs") or []
            values = [t.get("logprob") for t in tops_a]
            if not tops_b or values == [t.get("logprob") for t in tops_b]:
                continue
            chosen = y.get("logprob")
            rest = [t for t in tops_b if not math.isclose(t.get("logprob"), chosen,
                                                          abs_tol=1e-9)]
            first = [t for t in tops_b if t not in rest][:1] or [
                {**{k: v for k, v in y.items() if k != "top_logprobs"}}]
            reordered = (first + rest)[:len(tops_b)]
            if [t.get("logprob") for t in reordered] == values:
                y["top_logprobs"] = reordered
                changed = True
    return changed


# vLLM's text of a sample whose prompt (token ids) ends inside a character starts with
# that character, or more of the prompt's text: its detokenizer carries the prompt's
# undecoded bytes over into the output's text (DOCUMENTED["prompt text in the output"]).
PROMPT_TEXT = "vLLM's text starts with text of the prompt (undecoded bytes at its end)"
# The text of a stop token (stop_token_ids) ends rollout's text: vLLM leaves it out unless
# include_stop_str_in_output (DOCUMENTED["stop token text"]).
STOP_TOKEN_TEXT = "rollout's text goes on where vLLM's stops"
# vLLM's hermes tool parser turns skip_special_tokens off for a request with tools, so its
# text holds the special tokens' text (DOCUMENTED["special tokens with tools"]).
SPECIAL_TEXT = "vLLM's text holds special tokens' text"
# Where calls are held by a grammar (tool_choice required or a named tool, strict tools,
# parallel_tool_calls false), rollout's grammar is its own: compact JSON, a forced call's
# arguments held to the schema, the structural tag compiled to EBNF (vLLM's xgrammar takes
# the tag itself; their free text parted once before any call). The texts may part
# wherever that grammar runs (DOCUMENTED["tool-call JSON"]): every difference of such a
# case is this one.
CALL_JSON = "calls held by rollout's own grammar (compact JSON, held to the schema)"


# A /v1/messages stream whose text (no tools offered) holds the tool parser's marker
# (`<tool_call>`, hermes): vLLM's stream ends the text there, where its plain answer and its
# chat stream go on; rollout's stream sends all of it (DOCUMENTED["tool-call marker in a
# messages stream"]).
MARKER_CUT = "vLLM's messages stream ends the text at a tool-call marker"
MARKERS = ("<tool_call>",)


def _marker_cut(ref: dict, got: dict) -> bool:
    """Where rollout's streamed text is vLLM's and then a tool-call marker and more: such a
    block takes vLLM's text on both sides; whether any did."""
    found = False
    blocks = zip(ref.get("content") or [], got.get("content") or []) if isinstance(
        ref.get("content"), list) and isinstance(got.get("content"), list) else ()
    for a, b in blocks:
        mine, theirs = b.get("text"), a.get("text")
        if isinstance(mine, str) and isinstance(theirs, str) and mine != theirs and \
                mine.startswith(theirs) and mine[len(theirs):].startswith(MARKERS):
            b["text"] = theirs
            found = True
    return found


def _calls_held(case: Case) -> bool:
    body = case.body
    choice = body.get("tool_choice")
    if case.path == "/v1/messages":
        choice = choice if isinstance(choice, dict) else {}
        return bool(body.get("tools")) and choice.get("type") != "none" and (
            _forced(case) or _strict(case) or choice.get("disable_parallel_tool_use") is True)
    return bool(body.get("tools")) and choice != "none" and (
        _forced(case) or _strict(case) or body.get("parallel_tool_calls") is False)


def _special_text(body: dict) -> bool:
    """Whether a message's text holds a special token's text, or ends with the start of
    one (`<p` of `<pad>`: a stop sequence cut it)."""
    from rollout.kit.tiny_model import SPECIAL

    content = body.get("content") if isinstance(body, dict) else None
    for block in content if isinstance(content, list) else []:
        text = block.get("text") if isinstance(block, dict) else None
        if isinstance(text, str) and (_without_special(text) != text or any(
                text.endswith(token[:k]) for token in SPECIAL for k in range(2, len(token)))):
            return True
    return False


def _without_special(text: str) -> str:
    from rollout.kit.tiny_model import SPECIAL

    for token in SPECIAL:
        text = text.replace(token, "")
    return text


def _empty_message(item: dict) -> bool:
    """A Responses output message whose text is nothing but U+FFFD."""
    parts = item.get("content") or [] if isinstance(item, dict) else []
    return item.get("type") == "message" and all(
        isinstance(p, dict) and not (p.get("text") or "").strip("\ufffd") for p in parts)


def _sampled_shape(value: Any) -> Any:
    """Logprobs of a free sample as their shape: keys, and the shape of a list's first item
    (their lengths follow the sample's)."""
    if isinstance(value, dict):
        if value and all(k.startswith("token_id:") or not k.isidentifier() for k in value):
            return {"<token>": _sampled_shape(next(iter(value.values())))}
        return {k: _sampled_shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_sampled_shape(value[0])] if value else []
    return type(value).__name__


def _same_scalar(a: Any, b: Any) -> bool:
    numbers = (int, float)
    if isinstance(a, numbers) and isinstance(b, numbers) and not isinstance(a, bool) \
            and not isinstance(b, bool):
        return math.isclose(a, b, rel_tol=0, abs_tol=LOGPROB_TOL)
    return a == b


_SAMPLED_COUNTS = {"usage.completion_tokens", "usage.total_tokens", "usage.output_tokens"}


def _token_prompts(case: Case) -> list[list[int]]:
    prompt = case.body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        return prompt
    return []


def _prompt_text_in_output(case: Case, ref: dict, got: dict, decode) -> bool:
    """Where vLLM's completions text is the end of its prompt's text and then rollout's
    text (cut by a stop string, perhaps inside the prompt's part): the prompt, token ids
    that end inside a character, leaks into vLLM's output (PROMPT_TEXT). Such a choice
    takes rollout's text on both sides; whether any did."""
    prompts = _token_prompts(case)
    if decode is None or not prompts:
        return False
    n = case.body.get("n") or 1
    found = False
    for a, b in zip(ref.get("choices") or [], got.get("choices") or []):
        index = a.get("index", 0) // n
        if index >= len(prompts) or a.get("text") == b.get("text"):
            continue
        head = decode(prompts[index])
        mine, theirs = b.get("text") or "", (a.get("text") or "").rstrip("\ufffd")
        # An empty `theirs`: vLLM's text was nothing but the prompt's undecoded bytes. The
        # prompt's last bytes and the output's first may also make one character in
        # vLLM's text (U+FFFD in the prompt's text and in rollout's).
        whole = head.rstrip("\ufffd")
        if "\ufffd" in head and (not theirs or any(
                (head[k:] + mine).startswith(theirs) for k in range(len(head))) or any(
                theirs.startswith(whole[k:]) for k in range(max(1, len(whole) - 2)))):
            a["text"] = mine
            found = True
    return found


def compare(case: Case, ref: Outcome, got: Outcome, index: int = -1,
            decode: Callable[[list[int]], str] | None = None) -> list[Difference]:
    """vLLM's outcome `ref` against rollout's `got`, as a list of differences. `decode`
    (token ids to text, the model's tokenizer) lets it recognise vLLM's PROMPT_TEXT."""
    kind = case.kind
    if ref.ok != got.ok:
        who = "rollout refused" if ref.ok else "vLLM refused"
        message = got.error if ref.ok else ref.error
        return [Difference(kind, "accepted", f"{who} ({ref.status if not ref.ok else got.status}):"
                                             f" {_short(message, 200)}", index)]
    if not ref.ok:
        if ref.status != got.status:
            return [Difference(kind, "status", f"{ref.status} vs {got.status}: "
                               f"{_short(ref.error, 100)} / {_short(got.error, 100)}", index)]
        error = got.body.get("error") if isinstance(got.body, dict) else None
        if not isinstance(error, dict) or not {"message", "type"} <= set(error):
            return [Difference(kind, "error", f"not an OpenAI error body: {_short(got.body)}",
                               index)]
        if case.path == "/v1/messages" and got.body.get("type") != "error":
            return [Difference(kind, "error", f"not an Anthropic error body: "
                                              f"{_short(got.body)}", index)]
        return []
    exact = deterministic(case)
    found: list[tuple[str, str]] = []
    ref_body, got_body = normalize(case, ref), normalize(case, got)
    if case.path == "/v1/completions" and not _ids(case):
        _align_named_tops(ref_body, got_body)
    if case.path == "/v1/completions" and _prompt_text_in_output(case, ref_body, got_body,
                                                                  decode):
        found.append(("choices[].text", PROMPT_TEXT))
    if case.path == "/v1/chat/completions" and _chat_tops_in_vllm_order(ref_body, got_body):
        found.append(("choices[].logprobs.content[].top_logprobs", CHAT_TOPS))
    if case.path == "/v1/responses" and ref_body.get("output") == [] and len(
            got_body.get("output") or []) == 1 and _empty_message(got_body["output"][0]):
        # vLLM's text was empty (one cut character) and it sent no message at all.
        found.append(("output[].content[].text", CUT_CHARACTER))
        got_body["output"] = []
        if "stream" in got_body and "stream" in ref_body:
            got_body["stream"]["event_types"] = ref_body["stream"]["event_types"]
    if case.path == "/v1/messages" and ref_body.get("content") == [] and isinstance(
            got_body.get("content"), list) and len(got_body["content"]) == 1 and \
            got_body["content"][0].get("type") == "text" and \
            not got_body["content"][0].get("text", "").strip("\ufffd"):
        # vLLM's streamed text was empty (one cut character) and it sent no block at all.
        found.append(("content[].text", CUT_CHARACTER))
        got_body["content"] = []
        if "stream" in got_body and "stream" in ref_body:
            for key in ("event_types", "event_order"):
                got_body["stream"][key] = ref_body["stream"].get(key)
    if case.path == "/v1/messages" and case.body.get("stream") and _marker_cut(ref_body,
                                                                              got_body):
        found.append(("content[].text", MARKER_CUT))
    if not exact:
        for body in (ref_body, got_body):
            for choice in body.get("choices") or []:
                if isinstance(choice, dict) and choice.get("logprobs") is not None:
                    choice["logprobs"] = _sampled_shape(choice["logprobs"])
    _walk(ref_body, got_body, "", exact, found)
    if not exact and case.path != "/v1/messages":  # (a sample's count: its shape there)
        found = [(p, d) for p, d in found if p not in _SAMPLED_COUNTS]
    if found and case.path == "/v1/messages" and _has_tools(case) and _special_text(ref_body):
        # vLLM's text holds a special token's text (or the start of one, cut by a stop
        # sequence): the texts, and so where and why they stopped, part there.
        found = [(p, d) for p, d in found if p.startswith("stream.start_usage")] + [
            ("content[].text", SPECIAL_TEXT)]
    if found and _calls_held(case):
        where = "content[]" if case.path == "/v1/messages" else (
            "choices[]" if "choices" in ref_body else "output[]")
        found = [(where, CALL_JSON)]
    return [Difference(kind, path, detail, index) for path, detail in found]


def _short(value: Any, limit: int = 80) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= limit else text[:limit] + "..."


# --- explaining ---------------------------------------------------------------------------


def _refused(param: str | None = None, message: str | None = None):
    """Rollout refused (where vLLM accepted, or failed with a 500), naming `param` (its
    error message starts with it), or saying `message`."""
    def match(case: Case, diff: Difference) -> bool:
        if diff.field == "accepted" and diff.detail.startswith("rollout refused"):
            said = diff.detail.split("): ", 1)[-1]
        elif diff.field == "status" and diff.detail.startswith("500 vs 400"):
            said = diff.detail.split(" / ", 1)[-1]  # vLLM failed (500) where rollout refused
        else:
            return False
        return (param is None or said.startswith(param)) and (
            message is None or message in said)
    return match


def _field(*patterns: str, kinds: tuple[str, ...] = ()):
    def match(case: Case, diff: Difference) -> bool:
        return any(fnmatch.fnmatchcase(diff.field, p) for p in patterns) and (
            not kinds or case.kind in kinds)
    return match


def _deferred(case: Case) -> bool:
    """A /v1/messages call with a tool deferred (`defer_loading`) that no tool_reference
    names yet."""
    named = {part.get("tool_name") for m in case.body.get("messages") or []
             if isinstance(m, dict) and isinstance(m.get("content"), list)
             for b in m["content"] if isinstance(b, dict) and isinstance(b.get("content"), list)
             for part in b["content"] if isinstance(part, dict)}
    return case.path == "/v1/messages" and any(
        isinstance(t, dict) and t.get("defer_loading") is True and t.get("name") not in named
        for t in case.body.get("tools") or [])


def _has_tools(case: Case) -> bool:
    return bool(case.body.get("tools")) or any(
        m.get("tool_calls") or m.get("role") == "tool"
        for m in case.body.get("messages") or [] if isinstance(m, dict))


def _json_schema_constraint(case: Case) -> bool:
    fmt = case.body.get("response_format") or (case.body.get("text") or {}).get("format")
    ours = case.body.get("structured_outputs")
    return (isinstance(fmt, dict) and fmt.get("type") == "json_schema") or (
        isinstance(ours, dict) and ours.get("json") is not None)


# Deliberate differences, each listed with its reason in docs/serving.md, "Differences
# from vLLM's server" (the names are that list's). A difference is explained when its
# entry matches it.
DOCUMENTED: dict[str, Callable[[Case, Difference], bool]] = {
    # Logprob tokens are "token_id:N" whatever return_tokens_as_token_ids says, and
    # `bytes` is null; vLLM writes text and bytes unless asked for ids.
    "token names": lambda case, diff: (
        diff.field.endswith(("logprobs.tokens", ".token", ".bytes"))) and not _ids(case),
    "strict fields": _refused(message="unknown field"),
    "stop_reason": _field("choices[].stop_reason"),
    "skip_special_tokens false": _refused("skip_special_tokens"),
    # A `developer` message (chat or Responses input) is a system message to the chat
    # template (chat templates know no developer role); vLLM hands the template the role
    # "developer".
    "developer role": lambda case, diff: any(
        isinstance(item, dict) and item.get("role") == "developer"
        for item in (case.body.get("input") if not isinstance(case.body.get("input"), str)
                     else None) or case.body.get("messages") or []),
    "chat top_logprobs": lambda case, diff: diff.detail == CHAT_TOPS,
    # A stream with return_token_ids: vLLM sends the prompt's ids in the first chunk,
    # rollout's stream chunks carry the generated ids only.
    "stream prompt_token_ids": lambda case, diff: (
        case.body.get("stream") is True and diff.field.endswith("prompt_token_ids")
        and diff.detail.startswith("only vLLM")),
    "cut character": lambda case, diff: diff.detail == CUT_CHARACTER,
    "prompt text in the output": lambda case, diff: diff.detail == PROMPT_TEXT,
    "stop token text": lambda case, diff: diff.detail == STOP_TOKEN_TEXT and bool(
        case.body.get("stop_token_ids")) and not case.body.get("include_stop_str_in_output"),
    # Chat choices carry prompt_token_ids too (as completions choices do on both).
    "chat prompt_token_ids": lambda case, diff: (
        diff.field == "choices[].prompt_token_ids" and diff.detail.startswith("only rollout")
        and case.kind.startswith("chat")),
    "responses echo": _field("tool_choice", "top_p", "text", "service_tier",
                             kinds=("responses", "responses+stream")),
    "special tokens with tools": lambda case, diff: (
        diff.detail == SPECIAL_TEXT and _has_tools(case)),
    # transformers' get_json_schema writes a function's `return`; rollout renders it to
    # the chat template (as TRL's own server does), vLLM's server drops it.
    "tool return": lambda case, diff: any(
        isinstance(t, dict) and isinstance(t.get("function"), dict)
        and "return" in t["function"] for t in case.body.get("tools") or []),
    # prompt_logprobs: tokens are named "token_id:N" as everywhere (token names above);
    # a prompt token outside the top k has rank k + 1 (the engines give no rank beyond the
    # top k), and a stream with prompt_logprobs is refused.
    "prompt_logprobs": lambda case, diff: "prompt_logprobs" in diff.field and (
        diff.field.endswith((".rank", ".decoded_token")) or "rank" in diff.detail
        or "decoded_token" in diff.detail),
    "tool-call JSON": lambda case, diff: diff.detail == CALL_JSON,
    # Calls held by a grammar and a structured output in one request: refused (400).
    "held calls with structured outputs": _refused(message="own output constraint"),
    # A forced call cut by its limit, streamed: vLLM's stream sends none of its text.
    "cut forced call in a stream": lambda case, diff: (
        case.body.get("stream") is True and _forced(case)
        and diff.field == "choices[].message.content"
        and diff.detail.startswith("type NoneType vs str")),
    "prompt_logprobs stream": lambda case, diff: (
        diff.field == "accepted" and case.body.get("prompt_logprobs") is not None
        and case.body.get("stream") is True),
    # /v1/messages: a tool with defer_loading is left out of the prompt until a
    # tool_reference names it (as Anthropic's tool search); vLLM hands it to the chat
    # template with the others, so the prompts differ (Claude Code's recorded calls).
    "deferred tools": lambda case, diff: _deferred(case),
    "tool-call marker in a messages stream": lambda case, diff: diff.detail == MARKER_CUT,
}

# Known differences not fixed yet, each a defect to fix (docs/serving.md, "Open
# differences"): listed by name so that a new difference stands out as unexplained, and
# the test fails once an entry explains nothing any more.
OPEN: dict[str, Callable[[Case, Difference], bool]] = {}


def _forced(case: Case) -> bool:
    choice = case.body.get("tool_choice")
    if case.path == "/v1/messages":   # Anthropic's: {"type": "any"} or {"type": "tool"}
        return isinstance(choice, dict) and choice.get("type") in ("any", "tool")
    return choice == "required" or isinstance(choice, dict)


def _strict(case: Case) -> bool:
    return any(isinstance(t, dict) and (t.get("function") if isinstance(
        t.get("function"), dict) else t).get("strict") is True
        for t in case.body.get("tools") or [])


def classify(case: Case, diff: Difference) -> Difference:
    for table in (DOCUMENTED, OPEN):
        for name, match in table.items():
            if match(case, diff):
                diff.explained = ("documented: " if table is DOCUMENTED else "open: ") + name
                return diff
    return diff


# --- running ------------------------------------------------------------------------------


@dataclass
class Report:
    cases: list[Case]
    outcomes: list[tuple[Outcome, Outcome]] = field(default_factory=list)
    differences: list[Difference] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)   # each case's, both servers'

    @property
    def unexplained(self) -> list[Difference]:
        return [d for d in self.differences if not d.explained]

    def table(self) -> list[tuple[str, str, str, int]]:
        """(kind, field, explanation, count), the most frequent first."""
        counts = Counter((d.kind, d.field, d.explained or "UNEXPLAINED")
                         for d in self.differences)
        return [(k, f, e, n) for (k, f, e), n in counts.most_common()]

    def format_table(self) -> str:
        rows = self.table()
        if not rows:
            return "no differences"
        width = max(len(f"{k} {f}") for k, f, _, _ in rows)
        return "\n".join(f"{n:5d}  {(k + ' ' + f).ljust(width)}  {e}" for k, f, e, n in rows)

    def summary(self) -> dict:
        accepted = sum(a.ok and b.ok for a, b in self.outcomes)
        refused = sum(not a.ok and not b.ok for a, b in self.outcomes)
        seconds: Counter = Counter()
        for case, took in zip(self.cases, self.seconds):
            seconds[case.path] += round(took, 1)
        return {"cases": len(self.cases), "both_accepted": accepted, "both_refused": refused,
                "kinds": dict(Counter(c.kind for c in self.cases)),
                "seconds": {ROUTES[p]: round(t, 1) for p, t in seconds.items()},
                "differences": len(self.differences),
                "unexplained": len(self.unexplained)}

    def examples(self, limit: int = 10) -> str:
        """The first unexplained differences, each with its request."""
        lines = []
        for d in self.unexplained[:limit]:
            lines.append(f"[{d.case}] {d.kind} {d.field}: {d.detail}\n    "
                         f"{_short(self.cases[d.case].body, 600)}")
        return "\n".join(lines)


async def run(cases_: list[Case], vllm_url: str, rollout_url: str, concurrency: int = 1,
              decode: Callable[[list[int]], str] | None = None) -> Report:
    """Send every case to both servers (`concurrency` cases at a time, each to both at
    once) and compare (`decode`: see `compare`)."""
    import aiohttp

    report = Report(cases_)
    limit = asyncio.Semaphore(concurrency)

    async def one(session, case):
        async with limit:
            start = time.monotonic()
            both = await asyncio.gather(exchange(session, vllm_url, case),
                                        exchange(session, rollout_url, case))
            return both, time.monotonic() - start

    connector = aiohttp.TCPConnector(limit=4 * concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        done = await asyncio.gather(*(one(session, c) for c in cases_))
    report.outcomes = [tuple(both) for both, _ in done]
    report.seconds = [took for _, took in done]
    for i, (case, (ref, got)) in enumerate(zip(cases_, report.outcomes)):
        report.differences += [classify(case, d) for d in compare(case, ref, got, i, decode)]
    return report


# --- the two servers ----------------------------------------------------------------------


# The vLLM backend's structured-outputs settings (rollout_vllm.backend), given to vLLM's
# server too: JSON constraints are then compared like for like (compact JSON is
# DOCUMENTED["compact JSON"] in docs/serving.md; it is not a difference of the server).
STRUCTURED_OUTPUTS_CONFIG = {"backend": "xgrammar", "disable_any_whitespace": True}
# A step's token budget that holds every prompt of `run`'s concurrent cases whole. vLLM's
# CPU build dies ("CPU Generator does not use offset") when a seeded request is prefilled in
# chunks (its model runner rewinds the request's generator, which CPU generators cannot),
# and a budget of vLLM's default lets a long tool prompt push the others into chunks. The
# same engine runs behind rollout, so both get it. It is also the context (`CONTEXT`, below):
# vLLM's CPU build prefills a prompt whole, in one step, so a step takes the longest prompt.
STEP_TOKENS = 32768


def server_argvs(python: str, model: str, served: str, vllm_port: int,
                 rollout_port: int) -> dict[str, list[str]]:
    """vLLM's OpenAI server and `rollout serve --backend vllm` on the same model, float32
    and eager, with the same tool-call parser (hermes, the tiny model's format) and the
    same structured-outputs settings. (vLLM's OpenAI server serves /v1/messages too.)"""
    return {
        "vllm": [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                 "--served-model-name", served, "--port", str(vllm_port), "--host",
                 "127.0.0.1", "--dtype", "float32", "--enforce-eager",
                 "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                 "--structured-outputs-config", json.dumps(STRUCTURED_OUTPUTS_CONFIG),
                 "--max-num-batched-tokens", str(STEP_TOKENS)],
        "rollout": [python, "-m", "rollout", "serve", "--backend", "vllm", "--model", model,
                    "--served-model-name", served, "--port", str(rollout_port),
                    "--tool-call-parser", "hermes", "-o", "dtype=\"float32\"",
                    "-o", "enforce_eager=true", "-o",
                    "engine_args=" + json.dumps({"max_num_batched_tokens": STEP_TOKENS})],
    }


# The context both servers get: Claude Code's recorded calls (load_harness) take 9-15k
# tokens of the tiny model's, whose own config says 2,048 positions.
CONTEXT = STEP_TOKENS


def long_context_copy(model: str | Path, out: str | Path, positions: int = CONTEXT) -> Path:
    """`model` with room for `positions` tokens: its files linked into `out`, config.json
    rewritten with max_position_embeddings = `positions` (both servers then default to that
    max_model_len). The tiny model's RoPE is unscaled, so its logits at every position it
    had are the same; vLLM sizes its RoPE cache by max_position_embeddings, so the config
    is changed rather than --max-model-len given (VLLM_ALLOW_LONG_MAX_MODEL_LEN)."""
    src, dst = Path(model), Path(out)
    dst.mkdir(parents=True, exist_ok=True)
    for item in src.iterdir():
        if item.name == "config.json":
            config = json.loads(item.read_text())
            config["max_position_embeddings"] = positions
            (dst / item.name).write_text(json.dumps(config, indent=2))
        elif not (dst / item.name).exists():
            (dst / item.name).symlink_to(item.resolve())
    return dst


def decoder(model: str) -> Callable[[list[int]], str]:
    """The model's token ids to text, special tokens left out (as both servers write it)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


def server_env(core: int) -> dict[str, str]:
    """Each server's engine on one core of its own, with a KV cache of 1 GiB (2M tokens of
    the tiny model's): vLLM's own server otherwise wants 92% of the machine's memory free
    when it starts (gpu_memory_utilization), which the other server, or anything else
    running, denies it."""
    return {"VLLM_CPU_OMP_THREADS_BIND": str(core), "OMP_NUM_THREADS": "1",
            "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}

