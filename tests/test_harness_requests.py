"""What real agent harnesses send, answered: Claude Code 2.1.328 (`/v1/messages`) and Codex
CLI 0.169.0 (`/v1/responses`), recorded from the CLIs themselves against a capture server
(tests/data/harnesses; their long prose replaced by placeholders of its length), sent to
`rollout serve` in front of the HF backend on the tiny model, with their own headers."""

import json
import urllib.request
from pathlib import Path

import pytest

import rollout
from rollout.apps.serving.app import ServerThread
from rollout.service.service import LocalService

KEY = "harness-key"
RECORDED = Path(__file__).parent / "data" / "harnesses"
LIMIT = 24  # tokens a turn may make here: a random model seldom stops by itself


def recorded(name: str) -> dict:
    return json.loads((RECORDED / name).read_text())


@pytest.fixture(scope="module")
def server(tiny_model):
    # Each harness's prompt (system prompt and tool schemas) takes 5-15k tokens.
    ro = rollout.load_backend("hf", model=str(tiny_model), max_model_len=32768)
    with ServerThread(LocalService(ro, "tiny"), api_key=KEY) as server:
        yield server
    ro.close()


def send(server, record: dict, **changes) -> list[dict]:
    """The recorded call, with its own headers (the key replaced) and `changes` to its body;
    the events of its stream."""
    headers = {k: v for k, v in record["headers"].items()
               if k.lower() not in ("authorization", "x-api-key")}
    headers.update({"x-api-key": KEY} if "x-api-key" in record["headers"]
                   else {"Authorization": f"Bearer {KEY}"})
    query = "".join(f"?{k}={v}" for k, v in record["query"].items())
    request = urllib.request.Request(f"{server.url}{record['path']}{query}", headers=headers,
                                     data=json.dumps({**record["body"], **changes}).encode())
    with urllib.request.urlopen(request, timeout=120) as response:
        assert response.status == 200
        lines = response.read().decode().splitlines()
    return [json.loads(line[6:]) for line in lines if line.startswith("data: ")]


@pytest.mark.parametrize("turn", ["turn1", "turn2", "fallback"])
def test_claude_codes_calls_are_answered_as_anthropic_streams(server, turn):
    record = recorded(f"claude_code-2.1.328-{turn}.json")
    assert record["body"]["stream"] is True and record["query"] == {"beta": "true"}
    events = send(server, record, max_tokens=LIMIT)
    kinds = [e["type"] for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert "error" not in kinds
    assert events[-2]["delta"]["stop_reason"] in ("end_turn", "max_tokens", "tool_use")
    assert events[-2]["usage"]["output_tokens"] <= LIMIT


def test_claude_codes_tool_result_and_deferred_tools_reach_the_prompt_as_sent(server):
    def prompt_tokens(record, **changes):
        (start, *_, end, _) = send(server, record, max_tokens=1, **changes)
        return end["usage"]["input_tokens"] + end["usage"]["cache_read_input_tokens"]

    first, second = (recorded(f"claude_code-2.1.328-turn{n}.json") for n in (1, 2))
    assert prompt_tokens(second) > prompt_tokens(first) + 20  # the call and its result
    # A tool with defer_loading is not offered until a tool search names it.
    tools = first["body"]["tools"]
    assert any(t.get("defer_loading") for t in tools)
    loaded = [{k: v for k, v in t.items() if k != "defer_loading"} for t in tools]
    assert prompt_tokens(first, tools=loaded) > prompt_tokens(first)


@pytest.mark.parametrize("turn", ["turn1", "turn2"])
def test_codexs_calls_are_answered_as_responses_streams(server, turn):
    record = recorded(f"codex-0.169.0-{turn}.json")
    body = record["body"]
    assert body["stream"] is True and body["include"] == ["reasoning.encrypted_content"]
    assert {t["type"] for t in body["tools"]} == {"function", "namespace", "web_search"}
    events = send(server, record, max_output_tokens=LIMIT)
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed" and "error" not in kinds
    done = events[-1]["response"]
    assert done["status"] in ("completed", "incomplete")
    assert done["usage"]["output_tokens"] <= LIMIT
    if turn == "turn2":  # the function call and its output reached the prompt
        first = send(server, recorded("codex-0.169.0-turn1.json"), max_output_tokens=1)
        assert done["usage"]["input_tokens"] > \
            first[-1]["response"]["usage"]["input_tokens"] + 20
