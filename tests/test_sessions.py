"""Agent sessions with exact tokens (rollout.apps.serving.sessions), through `rollout serve`
in front of the HF backend on the tiny model, with the openai and anthropic SDKs: a
session's later turns are prompted with the ids sampled before, never re-tokenized, and the
recorded sequence is what a trainer's forward pass scores."""

import json
import urllib.request

import anthropic
import openai
import pytest
import torch

import rollout
from rollout.apps.serving.app import ServerThread
from rollout.service.service import LocalService
from rollout.testing.server_contract import CALL_REGEX, KEY, MODEL, TOOLS

ASK = [{"role": "user", "content": "what is 2 + 3?"}]


@pytest.fixture(scope="module")
def ro(tiny_model):
    ro = rollout.load_backend("hf", model=str(tiny_model), max_model_len=2048)
    yield ro
    ro.close()


@pytest.fixture(scope="module")
def server(ro):
    with ServerThread(LocalService(ro, MODEL), api_key=KEY, sessions_kept=3) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)


def session(server, name: str, pop: bool = False) -> tuple[int, dict]:
    request = urllib.request.Request(
        f"{server.url}/rollout/sessions/{name}" + ("?pop=true" if pop else ""),
        headers={"Authorization": f"Bearer {KEY}"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def tool_loop(client, name: str, turns: int = 3) -> list:
    """A tool-calling agent's turns under session `name`: each answer a call (held to the
    hermes format by a regex), sent back as the openai client returns it with its result."""
    messages, answers = list(ASK), []
    for turn in range(turns):
        answer = client.chat.completions.create(
            model=MODEL, messages=messages, tools=TOOLS, max_tokens=64, temperature=1.0,
            seed=turn, extra_headers={"X-Session-ID": name},
            extra_body={"structured_outputs": {"regex": CALL_REGEX}, "return_token_ids": True})
        (choice,) = answer.choices
        answers.append(choice)
        (call,) = choice.message.tool_calls
        messages += [choice.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "5"}]
    return answers


def test_a_tool_loop_is_one_sequence_of_the_engines_own_tokens(client, server, tiny_model):
    answers = tool_loop(client, "loop")
    status, recorded = session(server, "loop")
    assert status == 200 and recorded["id"] == "loop"
    (branch,) = recorded["branches"]
    ids, mask, calls = branch["token_ids"], branch["mask"], branch["calls"]
    assert len(calls) == len(answers) == 3
    last = answers[-1].model_dump()
    assert ids == last["prompt_token_ids"] + last["token_ids"]
    for call, answer in zip(calls, answers):
        sampled = answer.model_dump()["token_ids"]
        # Every turn's sampled ids sit in the sequence as sampled, and only they are masked.
        assert ids[call["prompt_end"]:call["end"]] == sampled
        assert answer.model_dump()["prompt_token_ids"] == ids[:call["prompt_end"]]
    assert mask == [int(any(c["prompt_end"] <= i < c["end"] for c in calls))
                    for i in range(len(ids))]
    assert [c["finish_reason"] for c in calls] == ["stop"] * 3
    assert all(c["tool_calls"][0]["name"] == "add" for c in calls)
    # Rebuilt from the text, the same conversation would not give these tokens: the
    # template writes a call its own way, not as the model sampled it.
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model))
    messages = list(ASK)
    for answer in answers:
        call = answer.message.tool_calls[0]
        messages += [{"role": "assistant", "content": "", "tool_calls": [
            {"id": call.id, "type": "function", "function": {
                "name": "add", "arguments": json.loads(call.function.arguments)}}]},
                     {"role": "tool", "tool_call_id": call.id, "content": "5"}]
    rebuilt = tokenizer.apply_chat_template(messages[:-1], tools=TOOLS, tokenize=True,
                                            return_dict=False)
    assert rebuilt[:calls[0]["prompt_end"]] == ids[:calls[0]["prompt_end"]]
    assert rebuilt != ids[:len(rebuilt)]  # (drift is what the session does not have)


def test_recorded_logprobs_are_a_trainers_forward_pass(client, server, tiny_model):
    """(Free sampling: under a structured output's grammar the engine's logprobs are not
    the raw model's.)"""
    messages = list(ASK)
    for turn in range(3):
        answer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12,
                                                temperature=1.0, seed=turn, user="scored")
        messages += [answer.choices[0].message.model_dump(exclude_none=True),
                     {"role": "user", "content": "go on"}]
    (branch,) = session(server, "scored")[1]["branches"]
    assert len(branch["calls"]) == 3
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([branch["token_ids"]])).logits[0].float()
    scores = torch.log_softmax(logits, -1)
    for i, (token, mask, logprob) in enumerate(zip(branch["token_ids"], branch["mask"],
                                                   branch["logprobs"])):
        if mask:  # the answer asked for none: the session has them all the same
            assert abs(scores[i - 1, token].item() - logprob) < 1e-4
        else:
            assert logprob is None


def test_answers_carry_logprobs_only_where_asked(client):
    answer = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=3,
                                            extra_headers={"X-Session-ID": "quiet"})
    assert answer.choices[0].logprobs is None
    streamed = list(client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=3,
                                                   stream=True, user="quiet-stream"))
    assert all(c.choices[0].logprobs is None for c in streamed if c.choices)


def test_a_rewritten_history_starts_a_new_branch(client, server):
    answers = tool_loop(client, "forked", turns=2)
    # The harness drops the first exchange (compaction): a new branch, rendered afresh.
    call = answers[1].message
    client.chat.completions.create(
        model=MODEL, tools=TOOLS, max_tokens=4, extra_headers={"X-Session-ID": "forked"},
        messages=ASK + [call.model_dump(exclude_none=True),
                        {"role": "tool", "tool_call_id": call.tool_calls[0].id,
                         "content": "5"}])
    branches = session(server, "forked")[1]["branches"]
    assert [len(b["calls"]) for b in branches] == [2, 1]
    assert branches[1]["calls"][0]["start"] == 0


def test_a_harness_that_drops_its_last_answer_forks_after_the_answer_it_kept(client,
                                                                             server):
    """Claude Code's way with an answer that has no text: it drops the answer, edits the
    user turn before it and asks again. The new branch starts with the old one's exact
    tokens up to the answer both keep."""
    def ask(messages, seed):
        answer = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=6, temperature=1.0, seed=seed,
            extra_headers={"X-Session-ID": "retried"}, extra_body={"return_token_ids": True})
        return answer, {"role": "assistant", "content": answer.choices[0].message.content}

    _, first = ask(ASK, 0)
    ask(ASK + [first, {"role": "user", "content": "go on"}], 1)
    again, _ = ask(ASK + [first, {"role": "user", "content": "go on, and say something"}], 2)
    kept, forked = session(server, "retried")[1]["branches"]
    assert len(kept["calls"]) == len(forked["calls"]) == 2
    assert forked["calls"][0] == kept["calls"][0]
    end = kept["calls"][0]["end"]
    assert forked["calls"][1]["start"] == end
    for key in ("token_ids", "mask", "logprobs"):
        assert forked[key][:end] == kept[key][:end]
    assert again.prompt_token_ids[:end] == kept["token_ids"][:end]  # what the engine saw
    assert forked["token_ids"][:len(again.prompt_token_ids)] == again.prompt_token_ids
    assert sum(forked["mask"]) == end - kept["calls"][0]["prompt_end"] + \
        len(again.choices[0].token_ids)


def test_anthropic_sessions_by_path_and_by_claude_codes_metadata(server):
    kwargs = dict(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    by_path = anthropic.Anthropic(base_url=f"{server.url}/sessions/by-path", api_key=KEY,
                                  max_retries=0)
    first = by_path.messages.create(**kwargs)
    by_path.messages.create(**{**kwargs, "messages": kwargs["messages"] + [
        {"role": "assistant", "content": first.content[0].text or ""},
        {"role": "user", "content": "and?"}]})
    (branch,) = session(server, "by-path")[1]["branches"]
    assert [c["route"] for c in branch["calls"]] == ["messages", "messages"]
    client = anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)
    user = json.dumps({"device_id": "d", "account_uuid": "", "session_id": "cc-1"})
    client.messages.create(**kwargs, metadata={"user_id": user})
    assert session(server, "cc-1")[0] == 200


def test_sessions_are_bounded_and_a_gone_one_is_a_404(client, server):
    for name in ("b1", "b2", "b3", "b4"):  # the server keeps 3
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2,
                                       extra_headers={"X-Session-ID": name})
    status, body = session(server, "b1")
    assert status == 404 and "keeps 3 sessions" in body["error"]["message"]
    assert session(server, "b4", pop=True)[0] == 200
    assert session(server, "b4")[0] == 404  # taken


def test_a_served_sampler_reads_sessions_and_writes_them_to_parquet(client, server, tmp_path):
    import pyarrow.parquet as pq

    from rollout import ServedRollout
    from rollout.apps.serving.sessions import write_parquet

    tool_loop(client, "kept", turns=2)
    sampler = ServedRollout.connect(server.url, api_key=KEY)
    try:
        taken = sampler.session("kept", pop=True)
        assert len(taken["branches"][0]["calls"]) == 2
        with pytest.raises(rollout.RolloutError, match="not kept here"):
            sampler.session("kept")
    finally:
        sampler.close()
    assert write_parquet([taken], str(tmp_path / "s.parquet")) == 1
    (row,) = pq.read_table(tmp_path / "s.parquet").to_pylist()
    branch = taken["branches"][0]
    assert (row["session"], row["token_ids"], row["mask"]) == (
        "kept", branch["token_ids"], branch["mask"])
    assert json.loads(row["calls"]) == branch["calls"]


def test_a_session_base_url_serves_the_model_list_and_every_api(server):
    base = f"{server.url}/sessions/by-url/v1"
    assert [m.id for m in openai.OpenAI(base_url=base, api_key=KEY).models.list().data] == [
        MODEL]
    chat = openai.OpenAI(base_url=base, api_key=KEY, max_retries=0)
    chat.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2)
    chat.responses.create(model=MODEL, input="hi", max_output_tokens=2)
    routes = [c["route"] for b in session(server, "by-url")[1]["branches"] for c in b["calls"]]
    assert sorted(routes) == ["chat", "responses"]
