"""The HTTP server's contract, run against a real backend: the OpenAI routes called with the
official `openai` client, the native route, the API key, and 500 concurrent calls.

Subclass `ServerContract` in a test module and override `make_rollout`: a class-scoped
fixture giving `lambda model, max_model_len: rollout.Rollout`. The server runs in a thread
of the test process, in front of that backend (`LocalService`).
"""

from __future__ import annotations

import asyncio
import json
import time
import re
import urllib.error
import urllib.request

import aiohttp
import openai
import pytest

from rollout.apps.serving.app import ServerThread
from rollout.service.service import LocalService

KEY = "test-key"
MODEL = "tiny"
MAX_MODEL_LEN = 1024  # small, so a too-long prompt is cheap to write; room for tool turns
CHAT = [{"role": "user", "content": "def add(a, b):"}]
DIGIT = {"type": "integer", "minimum": 0, "maximum": 9}
TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "add two digits",
    "parameters": {"type": "object", "properties": {"a": DIGIT, "b": DIGIT},
                   "required": ["a", "b"], "additionalProperties": False}}}]
# A random model makes a hermes tool call, then a final answer, when a regex says so.
CALL_REGEX = r'<tool_call>\{"name": "add", "arguments": \{"a": [0-9], "b": [0-9]\}\}</tool_call>'
ANSWER_REGEX = r"The sum is [0-9]{1,2}\."


def seed(ro, value: int):
    """`value` as the call's seed where the backend takes seeds; left out elsewhere."""
    return value if ro.capabilities.supports("seed") else openai.NOT_GIVEN


def direct(ro, **request):
    """What the Rollout itself answers, to compare the server with."""
    return ro.generate([request])[0].unwrap()


def http(url, body=None, key=KEY, data=None):
    """(status, JSON body) of a raw call, for what the openai client cannot send."""
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    if data is None and body is not None:
        data = json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def completions(url: str, body: dict) -> list[dict]:
    """The choices of a raw `/v1/completions` call that must succeed."""
    status, answer = http(f"{url}/v1/completions", body)
    assert status == 200, answer
    return answer["choices"]


def check_one_sequence(client, url: str, turns: int, model: str = MODEL, key: str = KEY,
                       session: str = "contract") -> None:
    """`turns` chat turns of one session, each answer sent back as it came: the server
    records one branch whose sampled tokens are exactly the ids each turn returned, with
    logprobs there only."""
    messages, returned = list(CHAT), []
    for _ in range(turns):
        answer = client.chat.completions.create(
            model=model, messages=messages, max_tokens=8, temperature=1.0,
            extra_headers={"X-Session-ID": session}, extra_body={"return_token_ids": True})
        (choice,) = answer.choices
        returned.append(choice.model_dump()["token_ids"])
        messages += [choice.message.model_dump(exclude_none=True),
                     {"role": "user", "content": "go on"}]
    status, recorded = http(f"{url}/rollout/sessions/{session}?pop=true", key=key)
    assert status == 200, recorded
    (branch,) = recorded["branches"]
    assert len(branch["calls"]) == turns
    assert [t for t, m in zip(branch["token_ids"], branch["mask"]) if m] == \
        [t for ids in returned for t in ids]
    assert [p is not None for p in branch["logprobs"]] == [bool(m) for m in branch["mask"]]


def scrape(url: str, key: str | None = KEY) -> dict:
    """The server's /metrics, parsed: {(sample name, frozenset of labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    request = urllib.request.Request(f"{url}/metrics", headers={
        "Authorization": f"Bearer {key}"} if key else {})
    with urllib.request.urlopen(request, timeout=30) as response:
        text = response.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def metric(scraped: dict, name: str, **labels) -> float:
    """The sum of `name`'s samples that carry `labels` (0 where there are none)."""
    wanted = set(labels.items())
    return sum(v for (n, have), v in scraped.items() if n == name and wanted <= have)


class BorrowedService(LocalService):
    """The class's backend behind a server of a test's own: closing the server leaves it
    open for the other tests."""

    async def close(self) -> None:
        pass


class ServedBackend:
    """A backend on the tiny model (`make_rollout`, to override: a class-scoped fixture
    giving `lambda model, max_model_len: rollout.Rollout`) behind a server in a thread of
    the test process."""

    @pytest.fixture(scope="class")
    @classmethod
    def make_rollout(cls):
        raise NotImplementedError("override make_rollout: lambda model, max_model_len: Rollout")

    @pytest.fixture(scope="class")
    @classmethod
    def ro(cls, make_rollout, tiny_model):
        ro = make_rollout(str(tiny_model), MAX_MODEL_LEN)
        yield ro
        ro.close()

    @pytest.fixture(scope="class")
    @classmethod
    def server(cls, ro):
        with ServerThread(LocalService(ro, MODEL), api_key=KEY) as server:
            yield server


class ServerContract(ServedBackend):
    @pytest.fixture(scope="class")
    @classmethod
    def client(cls, server):
        return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)

    # --- completions ----------------------------------------------------------------------------

    def test_completion_of_text_matches_the_engine(self, client, ro):
        response = client.completions.create(model=MODEL, prompt="def add(a, b):", max_tokens=6,
                                             temperature=0)
        expected = direct(ro, prompt="def add(a, b):",
                          sampling={"max_tokens": 6, "temperature": 0})[0]
        (choice,) = response.choices
        assert (choice.text, choice.finish_reason) == (expected.text, expected.finish_reason)
        assert response.object == "text_completion" and response.model == MODEL
        assert response.usage.prompt_tokens == expected.prompt_tokens
        assert response.usage.completion_tokens == expected.completion_tokens
        assert response.usage.total_tokens == expected.prompt_tokens + expected.completion_tokens

    def test_completion_of_token_prompts_with_n_samples_returns_token_ids(self, client, ro):
        if not ro.capabilities.supports("seed"):
            pytest.skip(f"seed unsupported: {ro.capabilities.unsupported['seed']}")
        prompts = [[5, 17, 42], [7, 8, 9, 10]]
        response = client.completions.create(
            model=MODEL, prompt=prompts, max_tokens=4, n=2, temperature=1.0, seed=3,
            extra_body={"return_token_ids": True})
        choices = [c.model_dump() for c in response.choices]
        assert [c["index"] for c in choices] == [0, 1, 2, 3]  # prompt after prompt
        assert [c["prompt_token_ids"] for c in choices] == [prompts[0]] * 2 + [prompts[1]] * 2
        assert all(1 <= len(c["token_ids"]) <= 4 for c in choices)
        assert response.usage.prompt_tokens == 3 + 4
        assert response.usage.completion_tokens == sum(len(c["token_ids"]) for c in choices)
        again = client.completions.create(
            model=MODEL, prompt=prompts, max_tokens=4, n=2, temperature=1.0, seed=3,
            extra_body={"return_token_ids": True})
        assert [c.model_dump()["token_ids"] for c in again.choices] == [
            c["token_ids"] for c in choices]  # same seed, same samples

    def test_top_k_zero_or_minus_one_is_no_limit_as_on_vllm(self, client, ro):
        """TRL's client sends top_k=0 by default (vLLM's and SGLang's "no limit")."""
        # Seeded sampling where the backend takes seeds (a limit would change the draws).
        call = dict(model=MODEL, prompt="the", max_tokens=8, logprobs=0,
                    temperature=1.0 if ro.capabilities.supports("seed") else 0,
                    seed=seed(ro, 7), extra_body={"return_tokens_as_token_ids": True})
        plain = client.completions.create(**call).choices[0]
        for value in (0, -1):
            same = client.completions.create(
                **{**call, "extra_body": {**call["extra_body"], "top_k": value}}).choices[0]
            assert same.logprobs.tokens == plain.logprobs.tokens  # the same draws

    def test_completion_logprobs_name_token_ids(self, client):
        response = client.completions.create(model=MODEL, prompt=["hello", "def"], max_tokens=5,
                                             temperature=0, logprobs=3,
                                             extra_body={"return_token_ids": True})
        for choice in response.choices:
            logprobs, token_ids = choice.logprobs, choice.model_dump()["token_ids"]
            assert logprobs.tokens == [f"token_id:{t}" for t in token_ids]
            assert len(logprobs.token_logprobs) == len(token_ids)
            assert all(len(top) == 3 for top in logprobs.top_logprobs)
            # Greedy: the chosen token is the most likely one.
            for token, value, top in zip(logprobs.tokens, logprobs.token_logprobs,
                                         logprobs.top_logprobs):
                assert max(top, key=top.get) == token and top[token] == pytest.approx(value)
        only_chosen = client.completions.create(model=MODEL, prompt="hello", max_tokens=3,
                                                temperature=0, logprobs=0).choices[0].logprobs
        assert len(only_chosen.token_logprobs) == 3
        # as vLLM writes it: each position's chosen token alone
        assert only_chosen.top_logprobs == [{t: v} for t, v in zip(only_chosen.tokens,
                                                                    only_chosen.token_logprobs)]

    def test_completion_prompt_logprobs_as_vllm_writes_them(self, client, ro):
        """vLLM's `prompt_logprobs` (what TRL's get_sequence_logprobs reads): per prompt
        position None first, then token id -> {logprob, rank, decoded_token} for the
        prompt's token and the k most likely, equal to the engine's scores."""
        if not ro.capabilities.supports("prompt_logprobs"):
            pytest.skip(f"unsupported: {ro.capabilities.unsupported['prompt_logprobs']}")
        prompts = [[5, 17, 42, 9, 3], [7, 8, 9, 10]]
        response = client.completions.create(model=MODEL, prompt=prompts, max_tokens=1,
                                             temperature=0, extra_body={"prompt_logprobs": 2})
        for prompt, choice in zip(prompts, response.choices):
            (expected,) = direct(ro, prompt_token_ids=prompt, sampling={
                "max_tokens": 1, "temperature": 0, "prompt_logprobs": 2})
            scores = choice.model_dump()["prompt_logprobs"]
            assert len(scores) == len(prompt) and scores[0] is None
            for token, value, tops, position in zip(prompt[1:], expected.prompt_logprobs[1:],
                                                    expected.prompt_top_logprobs[1:],
                                                    scores[1:]):
                assert position[str(token)]["logprob"] == pytest.approx(value, abs=1e-5)
                assert position[str(token)]["decoded_token"] == f"token_id:{token}"
                ranked = sorted(position.items(), key=lambda item: item[1]["rank"])
                assert [int(t) for t, _ in ranked[:2]] == [t.token_id for t in tops]
                assert [e["rank"] for _, e in ranked[:2]] == [1, 2]
                if str(token) not in dict(ranked[:2]):  # outside the top k: after them
                    assert position[str(token)]["rank"] == 3 and len(position) == 3
        plain = client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=1)
        assert "prompt_logprobs" not in plain.choices[0].model_dump()
        status, body = http(client.base_url.__str__().rstrip("/") + "/completions", {
            "model": MODEL, "prompt": prompts[0], "prompt_logprobs": 1, "stream": True})
        assert status == 400 and body["error"]["param"] == "prompt_logprobs"

    def test_chat_prompt_logprobs_score_the_rendered_prompt(self, client, ro):
        """Chat takes `prompt_logprobs` too, and answers them at the response's top (as
        vLLM's server): the scores of the prompt the chat template rendered."""
        if not ro.capabilities.supports("prompt_logprobs"):
            pytest.skip(f"unsupported: {ro.capabilities.unsupported['prompt_logprobs']}")
        response = client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=1, temperature=0,
            extra_body={"prompt_logprobs": 1, "return_token_ids": True})
        body = response.model_dump()
        prompt, scores = body["prompt_token_ids"], body["prompt_logprobs"]
        (expected,) = direct(ro, prompt_token_ids=prompt, sampling={
            "max_tokens": 1, "temperature": 0, "prompt_logprobs": 1})
        assert len(scores) == len(prompt) and scores[0] is None
        for token, value, position in zip(prompt[1:], expected.prompt_logprobs[1:],
                                          scores[1:]):
            assert position[str(token)]["logprob"] == pytest.approx(value, abs=1e-5)
        status, error = http(client.base_url.__str__().rstrip("/") + "/chat/completions", {
            "model": MODEL, "messages": CHAT, "prompt_logprobs": 1, "stream": True})
        assert status == 400 and error["error"]["param"] == "prompt_logprobs"

    def test_completion_stops_before_a_stop_string(self, client):
        full = client.completions.create(model=MODEL, prompt="the", max_tokens=12, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text
        start = next(i for i in range(1, len(full) - 1) if full[i:i + 2].isascii()
                     and full[i:i + 2].isalpha())
        stop = full[start:start + 2]
        for given in (stop, [stop, "never-seen"]):
            choice = client.completions.create(model=MODEL, prompt="the", max_tokens=12,
                                               temperature=0, stop=given,
                                               extra_body={"ignore_eos": True}).choices[0]
            assert (choice.text, choice.finish_reason) == (full[:full.find(stop)], "stop")

    def test_completion_streaming_gives_the_same_choices(self, client):
        kwargs = dict(model=MODEL, prompt=["hello", "def add"], max_tokens=5, temperature=0)
        whole = client.completions.create(**kwargs)
        texts, reasons = {}, {}
        for chunk in client.completions.create(**kwargs, stream=True):
            for choice in chunk.choices:
                texts[choice.index] = texts.get(choice.index, "") + choice.text
                if choice.finish_reason:
                    reasons[choice.index] = choice.finish_reason
        assert texts == {c.index: c.text for c in whole.choices}
        assert reasons == {c.index: c.finish_reason for c in whole.choices}

    def test_streamed_chunks_come_token_by_token(self, client, ro):
        stream = client.completions.create(model=MODEL, prompt="def add", max_tokens=16,
                                           temperature=0, stream=True,
                                           extra_body={"ignore_eos": True,
                                                       "return_token_ids": True})
        tokens = [choice.model_extra.get("token_ids") or []
                  for chunk in stream for choice in chunk.choices]
        # An engine merges the deltas a lagging reader has not taken yet (a loaded machine):
        # pieces, and all of them, not one per token.
        assert sum(1 for t in tokens if t) >= 2, "the tokens came in one piece, at the end"
        assert [t for ts in tokens for t in ts] == list(
            direct(ro, prompt="def add", sampling={"max_tokens": 16, "temperature": 0,
                                                       "ignore_eos": True})[0].token_ids)

    def test_a_dropped_client_stops_its_request(self, server, ro, monkeypatch):
        body = {"model": MODEL, "prompt": "the ka lo", "max_tokens": MAX_MODEL_LEN - 16,
                "ignore_eos": True, "stream": True, "temperature": 1.0}
        made = []  # the tokens the engine made for the request, stopped or not
        run = ro._run

        async def counted(flight, timeout, sink=None):
            def counting(chunk):
                made.append(len(chunk.token_ids))
                sink(chunk)

            return await run(flight, timeout, None if sink is None else counting)

        monkeypatch.setattr(ro, "_run", counted)

        async def drop_after_two_chunks():
            async with aiohttp.ClientSession(
                    headers={"Authorization": f"Bearer {KEY}"}) as session:
                async with session.post(f"{server.url}/v1/completions", json=body) as response:
                    seen = 0
                    async for line in response.content:
                        seen += line.startswith(b"data: {")
                        if seen == 2:
                            break  # leaving the block closes the connection
            deadline = time.monotonic() + 60
            while ro.health()["running"] and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            return ro.health()["running"]

        assert asyncio.run(drop_after_two_chunks()) == 0, "the request ran on without a client"
        assert 0 < sum(made) < body["max_tokens"], "the request ran to its end, not stopped"

    # --- agent sessions -------------------------------------------------------------------------

    def test_a_session_is_one_sequence_of_the_ids_each_turn_sampled(self, client, server):
        """Two chat turns of one session, the first answer sent back as it came
        (rollout.apps.serving.sessions, on every backend)."""
        check_one_sequence(client, server.url, turns=2)

    # --- chat -----------------------------------------------------------------------------------

    def test_chat_matches_the_engine(self, client, ro):
        response = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6,
                                                  temperature=0, logprobs=True, top_logprobs=2)
        expected = direct(ro, messages=CHAT, sampling={"max_tokens": 6, "temperature": 0,
                                                           "logprobs": 2})[0]
        (choice,) = response.choices
        assert choice.message.role == "assistant" and choice.message.content == expected.text
        assert choice.finish_reason == expected.finish_reason
        assert [e.token for e in choice.logprobs.content] == [
            f"token_id:{t}" for t in expected.token_ids]
        assert [e.logprob for e in choice.logprobs.content] == pytest.approx(expected.logprobs)
        assert all(len(e.top_logprobs) == 2 for e in choice.logprobs.content)
        assert response.usage.prompt_tokens == expected.prompt_tokens

    def test_chat_takes_parts_tool_calls_and_tool_results(self, client):
        messages = [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "add 1 and 2"}]},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call-1", "type": "function",
                 "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
            {"role": "tool", "tool_call_id": "call-1", "content": "3"},
        ]
        response = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4,
                                                  max_completion_tokens=None, n=3,
                                                  temperature=0.9,
                                                  extra_body={"return_token_ids": True})
        assert [c.index for c in response.choices] == [0, 1, 2]
        # An answer sent back as the openai client returns it is a valid message again.
        messages.append(response.choices[0].message.model_dump())
        messages.append({"role": "user", "content": "thanks"})
        client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=2)

    def test_chat_streaming_matches_the_whole_answer(self, client):
        kwargs = dict(model=MODEL, messages=CHAT, max_tokens=8, temperature=0)
        whole = client.chat.completions.create(**kwargs).choices[0]
        chunks = list(client.chat.completions.create(**kwargs, stream=True,
                                                     stream_options={"include_usage": True}))
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
        assert text == whole.message.content
        assert [r for r in reasons if r] == [whole.finish_reason]
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1
        assert len({c.id for c in chunks}) == 1

    # --- sampling, structured outputs, tools -----------------------------------------------------

    def test_sampling_extensions_reach_the_engine(self, client, ro):
        plain = direct(ro, messages=CHAT, sampling={"max_tokens": 8, "temperature": 0})[0]
        first = plain.token_ids[0]  # banned, so the answer must change
        extra = {"repetition_penalty": 1.4, "presence_penalty": 0.3, "frequency_penalty": 0.2,
                 "min_p": 0.05, "min_tokens": 4, "logit_bias": {str(first): -100},
                 "top_k": 20, "include_stop_str_in_output": True}
        response = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8,
                                                  temperature=0, logprobs=True,
                                                  extra_body=extra)
        sampling = {**extra, "logit_bias": {first: -100.0}, "max_tokens": 8, "temperature": 0}
        expected = direct(ro, messages=CHAT, sampling=sampling)[0]
        assert response.choices[0].message.content == expected.text
        assert [e.token for e in response.choices[0].logprobs.content] == [
            f"token_id:{t}" for t in expected.token_ids]
        assert expected.token_ids[0] != first

    # --- on-policy fields: what the engine drew from, as the engine answers in process ----------

    @staticmethod
    def refused_by_name(ro, url: str, capability: str, field: str, body: dict) -> bool:
        """Whether the backend refuses `capability`; if it does, the server at `url` must
        answer `body` with a 400 naming `field`."""
        if ro.capabilities.supports(capability):
            return False
        status, answer = http(f"{url}/v1/completions", body)
        assert status == 400 and answer["error"]["param"] == field, answer
        assert ro.capabilities.unsupported[capability] in answer["error"]["message"]
        return True

    def test_sampling_masks_through_http_are_the_engines(self, server, client, ro):
        body = {"model": MODEL, "prompt": "def add(a, b):", "max_tokens": 6, "top_k": 3,
                "seed": 5, "return_sampling_mask": True, "return_token_ids": True}
        if self.refused_by_name(ro, server.url, "sampling_mask", "return_sampling_mask", body):
            return
        if not ro.capabilities.supports("seed"):  # the same sample cannot be asked for twice
            del body["seed"]
        (choice,) = completions(server.url, body)
        if "seed" in body:
            expected = direct(ro, prompt=body["prompt"], sampling={
                k: body[k] for k in ("max_tokens", "top_k", "seed", "return_sampling_mask")})[0]
            assert choice["token_ids"] == list(expected.token_ids)
            assert choice["sampling_mask"] == [list(m) for m in expected.sampling_mask]
        else:
            assert all(t in m and len(m) == 3
                       for t, m in zip(choice["token_ids"], choice["sampling_mask"], strict=True))
        streamed = client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=6, stream=True,
            extra_body={"top_k": 3, "return_sampling_mask": True, "return_token_ids": True})
        tokens, masks = [], []
        for chunk in streamed:
            for c in chunk.choices:
                tokens += c.model_extra.get("token_ids", [])
                masks += c.model_extra.get("sampling_mask", [])
        assert len(masks) == len(tokens) > 0
        assert all(t in m and len(m) <= 3 for t, m in zip(tokens, masks))

    def test_a_trace_through_http_is_scored_as_the_engine_sampled_it(self, server, ro):
        sampled = direct(ro, prompt="def add(a, b):", sampling={
            "max_tokens": 6, "ignore_eos": True, "logprobs": 0})[0]
        body = {"model": MODEL, "prompt": "def add(a, b):", "max_tokens": 6, "logprobs": 0,
                "trace_decode_token_ids": list(sampled.token_ids), "return_token_ids": True}
        if self.refused_by_name(ro, server.url, "trace_replay", "trace_decode_token_ids", body):
            return
        (choice,) = completions(server.url, body)
        assert choice["token_ids"] == list(sampled.token_ids)
        assert choice["logprobs"]["token_logprobs"] == pytest.approx(sampled.logprobs, abs=1e-4)
        status, answer = http(f"{server.url}/v1/completions", {**body, "stop": ["x"]})
        assert status == 400 and answer["error"]["param"] == "stop", answer

    def test_routed_experts_of_a_dense_model_are_refused_by_name(self, server, ro):
        body = {"model": MODEL, "prompt": "def add", "max_tokens": 2,
                "return_routed_experts": True}
        assert self.refused_by_name(ro, server.url, "routed_experts", "return_routed_experts",
                                    body)

    def test_a_batch_invariant_request_through_http_is_the_engines(self, server, client, ro):
        """`batch_invariant`, sent by the openai client as an extension field, is taken:
        the server answers as the Rollout itself does, to the last bit of each logprob (or
        refuses naming the field). The contract suite checks what the field promises."""
        body = {"model": MODEL, "prompt": "def add(a, b):", "max_tokens": 6, "logprobs": 0,
                "temperature": 0, "batch_invariant": True, "return_token_ids": True}
        if self.refused_by_name(ro, server.url, "batch_invariant", "batch_invariant", body):
            return
        (choice,) = client.completions.create(
            model=MODEL, prompt=body["prompt"], max_tokens=6, logprobs=0, temperature=0,
            extra_body={"batch_invariant": True, "return_token_ids": True}).choices
        expected = direct(ro, prompt=body["prompt"], sampling={
            "max_tokens": 6, "logprobs": 0, "temperature": 0, "batch_invariant": True})[0]
        assert choice.model_extra["token_ids"] == list(expected.token_ids)
        assert choice.logprobs.token_logprobs == list(expected.logprobs)

    def test_structured_outputs_through_both_names(self, client, ro):
        schema = {"type": "object", "properties": {"x": DIGIT}, "required": ["x"],
                  "additionalProperties": False}
        answer = client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=32, temperature=1.0, n=3, seed=seed(ro, 5),
            response_format={"type": "json_schema", "json_schema": {"name": "x",
                                                                    "schema": schema}})
        for choice in answer.choices:
            assert set(json.loads(choice.message.content)) == {"x"}
        picked = client.completions.create(
            model=MODEL, prompt="the", max_tokens=8, temperature=1.0, n=4, seed=seed(ro, 5),
            extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
        assert {c.text for c in picked.choices} <= {"yes", "no"}

    @pytest.mark.parametrize("stream", [False, True])
    def test_a_tool_round_trip_with_the_openai_client(self, client, ro, tiny_model,
                                                      stream):
        messages = [{"role": "user", "content": "what is 2 + 3?"}]
        first = _chat(client, stream, messages=messages, tools=TOOLS, max_tokens=128,
                      temperature=1.0, seed=seed(ro, 1), extra_body={"structured_outputs": {
                          "regex": CALL_REGEX}})
        assert first["finish_reason"] == "tool_calls" and not first["content"]
        (call,) = first["tool_calls"]
        assert call["function"]["name"] == "add" and call["id"]
        arguments = json.loads(call["function"]["arguments"])
        assert set(arguments) == {"a", "b"}
        messages += [{"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": call["id"],
                      "content": str(arguments["a"] + arguments["b"])}]
        final = _chat(client, stream, messages=messages, tools=TOOLS, max_tokens=64,
                      temperature=1.0, seed=seed(ro, 2), extra_body={"structured_outputs": {
                          "regex": ANSWER_REGEX}})
        assert final["finish_reason"] == "stop" and not final["tool_calls"]
        assert re.fullmatch(ANSWER_REGEX, final["content"])
        # Everything sent back reached the chat template, tools and the call included.
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(tiny_model))
        rendered = [{**m, "content": m["content"] or ""} for m in messages]
        rendered[1]["tool_calls"] = [{**call, "function": {"name": "add",
                                                          "arguments": arguments}}]
        ids = tokenizer.apply_chat_template(rendered, tools=TOOLS, add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        assert final["prompt_tokens"] == len(ids)

    @pytest.mark.parametrize("strict", [False, True])
    @pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                     "function": {"name": "add"}}])
    def test_required_and_named_tool_choice_force_a_valid_call(self, client, ro, choice,
                                                                strict):
        """Strict tools too: the forced call is held to the schema either way, written in
        the tool-call parser's format. As OpenAI's and vLLM's: a named tool's call ends in
        `stop`, a required one's in `tool_calls`, and the message's content is ""."""
        import jsonschema

        tools = [{**t, "function": {**t["function"], "strict": strict}} for t in TOOLS]
        response = client.chat.completions.create(
            model=MODEL, messages=CHAT, tools=tools, tool_choice=choice, max_tokens=128,
            temperature=1.0, n=2, seed=seed(ro, 3), parallel_tool_calls=False)
        for answer in response.choices:
            assert answer.finish_reason == ("tool_calls" if choice == "required" else "stop")
            assert answer.message.content == ""
            (call,) = answer.message.tool_calls
            assert call.function.name == "add"
            jsonschema.validate(json.loads(call.function.arguments),
                                TOOLS[0]["function"]["parameters"])

    @pytest.mark.parametrize("stream", [False, True])
    def test_strict_tools_in_auto_mode_hold_every_call_to_its_schema(self, client, ro,
                                                                      tiny_model, stream):
        import jsonschema
        from transformers import AutoTokenizer

        opening = AutoTokenizer.from_pretrained(str(tiny_model)).convert_tokens_to_ids(
            "<tool_call>")
        week = {"type": "function", "function": {
            "name": "forecast", "strict": True, "parameters": {
                "type": "object", "properties": {"unit": {"enum": ["c", "f"]},
                                                 "days": {"type": "integer", "minimum": 1,
                                                          "maximum": 7}},
                "required": ["unit", "days"], "additionalProperties": False}}}
        tools = [{**TOOLS[0], "function": {**TOOLS[0]["function"], "strict": True}}, week]
        schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
        # The random model writes the opening tag (a bias); from there on the constraint
        # writes a call of one of the tools, with valid arguments (free text, it would
        # write garbage and the call would fail to parse). The stop string ends the sample
        # at the first call's end. A random model may spell the frame out a character a
        # token: room for all of it.
        for i in range(3):
            answer = _chat(client, stream, messages=CHAT, tools=tools, tool_choice="auto",
                           max_tokens=160, temperature=1.0, seed=seed(ro, 10 + i),
                           logit_bias={str(opening): 100}, stop=["</tool_call>"],
                           extra_body={"include_stop_str_in_output": True})
            assert answer["finish_reason"] == "tool_calls", answer
            (call,) = answer["tool_calls"]
            function = call["function"]
            jsonschema.validate(json.loads(function["arguments"]), schemas[function["name"]])

    def test_a_cut_tool_call_comes_back_as_a_length_finish_with_the_reason(self, client):
        """A client that reads finish_reason (LangChain, the Agents SDK) sees a cut answer,
        not a final one."""
        response = client.chat.completions.create(
            model=MODEL, messages=CHAT, tools=TOOLS, tool_choice="required", max_tokens=4)
        (choice,) = response.choices
        assert choice.finish_reason == "length" and not choice.message.tool_calls
        (error,) = choice.message.model_extra["tool_call_errors"]
        assert choice.message.content == error["text"] and error["reason"]

    def test_chat_without_max_tokens_may_use_the_room_left_completions_keep_16(self, client,
                                                                              ro):
        chat = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0,
                                              extra_body={"ignore_eos": True})
        assert chat.choices[0].finish_reason == "length"
        # (the context as the engine takes it: SGLang keeps a few tokens for itself)
        assert chat.usage.prompt_tokens + chat.usage.completion_tokens == \
            ro.encoder.max_model_len
        text = client.completions.create(model=MODEL, prompt="def", temperature=0,
                                         extra_body={"ignore_eos": True})
        assert text.usage.completion_tokens == 16

    def test_a_malformed_tool_call_is_reported_not_answered(self, client):
        regex = r'<tool_call>\{"name": "subtract", "arguments": \{\}\}</tool_call>'
        response = client.chat.completions.create(
            model=MODEL, messages=CHAT, tools=TOOLS, max_tokens=128, temperature=0,
            extra_body={"structured_outputs": {"regex": regex}})
        (choice,) = response.choices
        assert choice.finish_reason == "stop"  # a standard reason: the text is the answer
        assert not choice.message.tool_calls
        (error,) = choice.message.model_extra["tool_call_errors"]
        assert "unknown tool 'subtract'" in error["reason"]
        assert choice.message.content == error["text"]

    # --- errors ---------------------------------------------------------------------------------

    @pytest.mark.parametrize(("extra", "param"), [
        ({"temprature": 0.5}, "temprature"),
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"logit_bias": {"five": 10}}, "logit_bias.five"),
        ({"logit_bias": {"100000": 10}}, "logit_bias.100000"),
        ({"max_tokens": 4, "min_tokens": 5}, "min_tokens"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0].function.name"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "sub"}}},
         "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "required", "structured_outputs": {"regex": "a"}},
         "tool_choice"),
        ({"tools": [{**TOOLS[0], "function": {**TOOLS[0]["function"], "strict": True}}],
          "response_format": {"type": "json_object"}}, "tools[0].function.strict"),
        ({"tools": [{**TOOLS[0], "function": {**TOOLS[0]["function"], "strict": "yes"}}]},
         "tools[0].function.strict"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
        ({"structured_outputs": {"regex": "(a"}}, "structured_outputs.regex"),
        ({"structured_outputs": {"structural_tag": "{not json"}},
         "structured_outputs.structural_tag"),
        ({"structured_outputs": {"structural_tag": {"type": "structural_tag",
                                                    "format": {"type": "nonsense"}}}},
         "structured_outputs.structural_tag"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 2}, "top_p"),
        ({"n": 0}, "n"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
        ({"stop": [""]}, "stop"),
        ({"top_k": -2}, "top_k"),
        ({"return_tokens_as_token_ids": False}, "return_tokens_as_token_ids"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": "hi", "mood": "glad"}]}, "messages[0].mood"),
        ({"messages": [{"role": "user", "content": [{"type": "audio"}]}]},
         "messages[0].content[0].type"),
        ({"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]},
         "messages"),  # the tiny model is text-only: images are unsupported
    ])
    def test_a_bad_chat_field_is_a_400_naming_it(self, client, extra, param):
        with pytest.raises(openai.BadRequestError) as caught:  # extra_body: sent as it is
            client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2,
                                           extra_body=extra)
        assert caught.value.body["param"] == param
        assert caught.value.body["message"].startswith(param)

    @pytest.mark.parametrize(("extra", "param"), [
        ({"prompt": []}, "prompt"),
        ({"prompt": [[1, 2], "text"]}, "prompt"),
        ({"prompt": [[1, 2], [100000]]}, "prompt[1]"),  # out of the vocabulary
        ({"echo": True}, "echo"),
        ({"best_of": 3}, "best_of"),
        ({"suffix": "end"}, "suffix"),
        ({"logprobs": 21}, "logprobs"),
        ({"seed": 1.5}, "seed"),
        ({"stream": "yes"}, "stream"),
    ])
    def test_a_bad_completion_field_is_a_400_naming_it(self, client, extra, param):
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model=MODEL, prompt="hello", max_tokens=2, extra_body=extra)
        assert caught.value.body["param"] == param

    def test_another_model_name_is_a_404(self, client):
        with pytest.raises(openai.NotFoundError) as caught:
            client.completions.create(model="gpt-4", prompt="hello", max_tokens=2)
        assert caught.value.body["code"] == "model_not_found"

    def test_trls_nccl_weight_routes_are_refused_with_the_reason(self, server):
        for path in ("/server_info", "/get_world_size", "/init_weight_transfer_engine"):
            status, body = http(server.url + path, {} if path.startswith("/init") else None)
            assert status == 501 and "rollout.integrations.trl" in body["error"]["message"]

    def test_malformed_json_and_unknown_routes_get_openai_errors(self, server):
        status, body = http(f"{server.url}/v1/completions", data=b"{not json")
        assert status == 400 and "not valid JSON" in body["error"]["message"]
        status, body = http(f"{server.url}/v1/completions", body=["a", "list"])
        assert status == 400 and body["error"]["type"] == "invalid_request_error"
        status, body = http(f"{server.url}/v1/embeddings", body={"input": "x"})
        assert status == 404 and body["error"]["message"]

    # --- weights from a trainer in another process -------------------------------------

    def test_weights_pushed_through_the_server_equal_the_same_update_in_process(
            self, server, ro, tiny_model, tmp_path):
        if not ro.capabilities.supports("update_weights"):
            pytest.skip(f"update_weights: {ro.capabilities.unsupported['update_weights']}")
        from rollout.service.served import ServedRollout
        from rollout.testing.probes import probe, probe_requests
        from rollout.testing.model_folders import load_weights, perturbed_copy

        base = load_weights(tiny_model)
        other = load_weights(perturbed_copy(tiny_model, tmp_path / "other"))
        before = probe(ro)
        with ServedRollout.connect(server.url, KEY) as trainer:
            try:
                # Small buckets: many through one reused shared-memory file.
                trainer.update_weights(other.items(), bucket_bytes=1 << 16, version=11)
                served = [c.unwrap()[0] for c in trainer.generate(probe_requests())]
                assert {r.weight_version for r in served} == {11}
                ro.update_weights(other.items())  # the same weights, in process
                assert tuple(r.token_ids for r in served) == probe(ro) != before
            finally:
                trainer.update_weights(base.items())
            assert probe(ro) == before

    def test_a_too_long_prompt_is_a_400_and_the_server_goes_on(self, client):
        long_prompt = "hello there " * MAX_MODEL_LEN
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model=MODEL, prompt=["hello", long_prompt], max_tokens=2)
        assert caught.value.body["param"] == "prompt[1]"
        assert "too long" in caught.value.body["message"]
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": long_prompt}], max_tokens=2)
        assert caught.value.body["param"] == "messages"
        # Streaming sent its first chunk before the engine found the prompt too long.
        with pytest.raises(openai.APIError, match="too long"):
            list(client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": long_prompt}], max_tokens=2,
                stream=True))
        assert client.completions.create(model=MODEL, prompt="hello", max_tokens=2).choices

    # --- models, health, keys -------------------------------------------------------------------

    def test_models_lists_the_served_model(self, client):
        assert [m.id for m in client.models.list()] == [MODEL]
        assert client.models.retrieve(MODEL).id == MODEL

    def test_health_reports_the_service(self, server, ro):
        status, body = http(f"{server.url}/health")
        assert status == 200 and body["backend"] == ro.name

    def test_every_route_needs_the_key(self, server):
        wrong = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong-key", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as caught:
            wrong.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2)
        assert caught.value.body["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()
        for key in (None, "wrong-key"):
            for route, body in (("/v1/models", None), ("/health", None),
                                ("/v1/chat/completions", {"model": MODEL, "messages": CHAT}),
                                ("/rollout/generate", {"requests": []})):
                status, answer = http(server.url + route, body, key=key)
                assert (status, answer["error"]["code"]) == (401, "invalid_api_key")

    # --- load -----------------------------------------------------------------------------------

    # --- the Responses API ------------------------------------------------------------------

    def test_responses_continue_a_conversation_by_previous_response_id(self, client):
        first = client.responses.create(model=MODEL, input="def add(a, b):", temperature=0,
                                        instructions="Answer briefly.", max_output_tokens=8)
        second = client.responses.create(model=MODEL, input="and again", temperature=0,
                                         previous_response_id=first.id, max_output_tokens=8)
        # The same conversation sent whole (instructions are not carried over, as OpenAI's).
        chat = client.chat.completions.create(model=MODEL, max_tokens=8, temperature=0, messages=[
            {"role": "user", "content": "def add(a, b):"},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "and again"}])
        assert second.previous_response_id == first.id
        assert second.usage.input_tokens == chat.usage.prompt_tokens
        assert second.output_text == chat.choices[0].message.content
        assert first.usage.output_tokens <= 8 and first.status in ("completed", "incomplete")

    @pytest.mark.parametrize("stream", [False, True])
    def test_responses_force_a_valid_function_call_and_take_its_output(self, client, stream):
        import jsonschema

        schema = TOOLS[0]["function"]["parameters"]
        tools = [{"type": "function", "name": "add", "parameters": schema, "strict": True}]
        call = dict(model=MODEL, input="add two digits", tools=tools, tool_choice="required",
                    parallel_tool_calls=False, max_output_tokens=128, temperature=1.0)
        if stream:
            with client.responses.stream(**call) as events:
                kinds = [event.type for event in events]
                response = events.get_final_response()
            assert kinds[:2] == ["response.created", "response.in_progress"]
            assert "response.function_call_arguments.done" in kinds
            assert kinds[-1] == "response.completed"
        else:
            response = client.responses.create(**call)
        (called,) = [item for item in response.output if item.type == "function_call"]
        assert called.name == "add" and response.status == "completed"
        jsonschema.validate(json.loads(called.arguments), schema)
        after = client.responses.create(
            model=MODEL, previous_response_id=response.id, max_output_tokens=8, input=[
                {"type": "function_call_output", "call_id": called.call_id, "output": "7"}])
        same = client.chat.completions.create(model=MODEL, max_tokens=8, messages=[
            {"role": "user", "content": "add two digits"},
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": called.call_id, "type": "function",
                "function": {"name": "add", "arguments": called.arguments}}]},
            {"role": "tool", "tool_call_id": called.call_id, "content": "7"}])
        assert after.usage.input_tokens == same.usage.prompt_tokens

    def test_responses_text_format_holds_the_answer_to_a_json_schema(self, client):
        import jsonschema

        schema = {"type": "object", "properties": {"digit": DIGIT}, "required": ["digit"],
                  "additionalProperties": False}
        response = client.responses.create(
            model=MODEL, input="a digit, as JSON", max_output_tokens=64, temperature=1.0,
            text={"format": {"type": "json_schema", "name": "digit", "schema": schema,
                             "strict": True}})
        assert response.status == "completed"
        jsonschema.validate(json.loads(response.output_text), schema)

    def test_responses_stream_the_same_text_as_a_whole_answer(self, client):
        call = dict(model=MODEL, input="def add(a, b):", max_output_tokens=12, temperature=0)
        with client.responses.stream(**call) as events:
            deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
            streamed = events.get_final_response()
        whole = client.responses.create(**call)
        assert "".join(deltas) == streamed.output_text == whole.output_text
        assert streamed.usage.output_tokens == whole.usage.output_tokens

    def test_responses_without_max_output_tokens_may_use_the_room_left(self, client, ro):
        response = client.responses.create(model=MODEL, input="def", temperature=0,
                                           extra_body={"ignore_eos": True})
        assert response.status == "incomplete"
        assert response.incomplete_details.reason == "max_output_tokens"
        assert response.usage.input_tokens + response.usage.output_tokens == \
            ro.encoder.max_model_len

    def test_an_unknown_or_evicted_previous_response_is_a_404(self, ro, client):
        with pytest.raises(openai.NotFoundError) as unknown:
            client.responses.create(model=MODEL, input="x", previous_response_id="resp_none")
        assert unknown.value.body["code"] == "previous_response_not_found"
        with ServerThread(BorrowedService(ro, MODEL), api_key=KEY, responses_kept=1) as small:
            kept = openai.OpenAI(base_url=f"{small.url}/v1", api_key=KEY, max_retries=0)
            older, newer = (kept.responses.create(model=MODEL, input=text, max_output_tokens=2)
                            for text in ("one", "two"))
            unstored = kept.responses.create(model=MODEL, input="three", max_output_tokens=2,
                                             store=False)
            for gone in (older, unstored):
                with pytest.raises(openai.NotFoundError, match="keeps the last 1 responses"):
                    kept.responses.create(model=MODEL, input="x", previous_response_id=gone.id)
            assert kept.responses.retrieve(newer.id).output_text == newer.output_text
            kept.responses.create(model=MODEL, input="x", previous_response_id=newer.id,
                                  max_output_tokens=2)

    @pytest.mark.parametrize("field, value", [
        ("reasoning", {"effort": "extreme"}), ("tools", [{"type": "computer_use_preview"}]),
        ("include", ["message.output_text.logprobs"]), ("truncation", "auto"),
        ("background", True)])
    def test_responses_refuse_what_they_do_not_offer_naming_it(self, server, field, value):
        status, body = http(f"{server.url}/v1/responses",
                            {"model": MODEL, "input": "x", field: value})
        assert status == 400 and body["error"]["param"].startswith(field), body

    # --- metrics and admission control ------------------------------------------------------

    def test_metrics_count_what_the_server_served(self, server, client):
        before = scrape(server.url)
        texts = [client.completions.create(model=MODEL, prompt="def add(a, b):", max_tokens=5,
                                           temperature=0) for _ in range(2)]
        chunks = list(client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=5, stream=True,
            stream_options={"include_usage": True}))
        status, _ = http(f"{server.url}/v1/completions",
                         {"model": MODEL, "prompt": "x", "temperature": -1})
        after = scrape(server.url)

        def grew(name, **labels):
            return metric(after, name, **labels) - metric(before, name, **labels)

        usages = [t.usage for t in texts] + [chunks[-1].usage]
        reasons = [t.choices[0].finish_reason for t in texts] + [
            c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert status == 400 and len(reasons) == 3
        assert grew("rollout:prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
        assert grew("rollout:generation_tokens_total") == sum(u.completion_tokens for u in usages)
        for reason in set(reasons):
            assert grew("rollout:request_success_total", finished_reason=reason) == \
                reasons.count(reason)
        for histogram in ("e2e_request_latency_seconds", "time_to_first_token_seconds"):
            assert grew(f"rollout:{histogram}_count", model_name=MODEL) == 3
        assert grew("rollout:request_errors_total", kind="invalid_request") == 1
        assert metric(after, "rollout:num_requests_running") == 0
        assert metric(after, "rollout:weights_dirty") == 0

    def test_metrics_need_the_key_like_every_route(self, server):
        status, body = http(f"{server.url}/metrics", key=None)
        assert status == 401 and body["error"]["code"] == "invalid_api_key"

    def test_a_full_line_is_refused_at_once_with_429_and_retry_after(self, ro):
        """One request runs, one waits, the next is refused (HTTP 429, Retry-After; a
        Python client gets OverloadedError); once they are gone the server serves again."""
        from rollout.service.admission import Limits
        from rollout.service.client import RemoteService
        from rollout.contract.errors import OverloadedError
        from rollout.contract.schemas import Request
        from rollout.testing.waiting import wait_for

        service = BorrowedService(ro, MODEL, Limits(max_running=1, max_waiting=1))
        # Long enough to still run when the third call comes (cancelled then).
        long = {"model": MODEL, "prompt": "the", "max_tokens": MAX_MODEL_LEN - 16,
                "ignore_eos": True, "temperature": 1.0}

        async def hold_two_then_call_a_third(url):
            async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY}"}) as s:
                held = [asyncio.ensure_future(s.post(f"{url}/v1/completions", json=long))]
                await asyncio.to_thread(wait_for, lambda: service.gate.running == 1, 60,
                                        "the first request to run")
                held.append(asyncio.ensure_future(s.post(f"{url}/v1/completions", json=long)))
                await asyncio.to_thread(wait_for, lambda: service.gate.waiting == 1, 60,
                                        "the second request to wait")
                async with s.post(f"{url}/v1/completions", json={**long, "max_tokens": 2}) as r:
                    refused = r.status, r.headers.get("Retry-After"), await r.json()
                gauges = await asyncio.to_thread(scrape, url, None)  # public here
                remote = RemoteService(url, KEY)
                try:
                    with pytest.raises(OverloadedError):
                        await remote.generate(Request(prompt="the"))
                finally:
                    await remote.close()
                for call in held:
                    call.cancel()
                return refused, gauges

        with ServerThread(service, api_key=KEY, public_metrics=True) as small:
            (status, retry_after, body), gauges = asyncio.run(hold_two_then_call_a_third(
                small.url))
            assert status == 429 and retry_after == "1"
            assert body["error"]["code"] == "overloaded" and "wait" in body["error"]["message"]
            assert metric(gauges, "rollout:num_requests_running") == 1
            assert metric(gauges, "rollout:num_requests_waiting") == 1
            assert metric(gauges, "rollout:request_errors_total", kind="overloaded") >= 1
            wait_for(lambda: service.gate.running == service.gate.waiting == 0, 120,
                     "the cancelled requests to stop")
            status, body = http(f"{small.url}/v1/completions",
                                {"model": MODEL, "prompt": "the", "max_tokens": 2})
            assert status == 200 and body["usage"]["completion_tokens"] >= 1

    def test_500_concurrent_chat_calls_all_succeed(self, server, ro):
        async def main():
            client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0,
                                        timeout=300)
            async with client:
                return await asyncio.gather(*(
                    client.chat.completions.create(
                        model=MODEL, max_tokens=8, temperature=1.0, seed=seed(ro, i),
                        messages=[{"role": "user", "content": f"question {i}"}])
                    for i in range(500)))

        responses = asyncio.run(main())
        assert len(responses) == 500
        assert all(r.choices[0].finish_reason in ("stop", "length") for r in responses)
        assert all(1 <= r.usage.completion_tokens <= 8 for r in responses)


def _chat(client, stream: bool, **kwargs) -> dict:
    """One chat answer's content, tool calls (as dicts), finish reason and prompt tokens,
    read from a whole answer or put together from a stream as a client would."""
    if not stream:
        response = client.chat.completions.create(model=MODEL, **kwargs)
        (choice,) = response.choices
        calls = [c.model_dump() for c in choice.message.tool_calls or ()]
        return {"content": choice.message.content, "tool_calls": calls,
                "finish_reason": choice.finish_reason,
                "prompt_tokens": response.usage.prompt_tokens}
    content, calls, finish_reason, usage = "", {}, None, None
    for chunk in client.chat.completions.create(model=MODEL, stream=True,
                                                stream_options={"include_usage": True},
                                                **kwargs):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or ():
                call = calls.setdefault(delta.index, {"id": "", "type": "function",
                                                      "function": {"name": "", "arguments": ""}})
                call["id"] += delta.id or ""
                call["function"]["name"] += delta.function.name or ""
                call["function"]["arguments"] += delta.function.arguments or ""
            finish_reason = choice.finish_reason or finish_reason
    return {"content": content, "tool_calls": [calls[k] for k in sorted(calls)],
            "finish_reason": finish_reason, "prompt_tokens": usage.prompt_tokens}
