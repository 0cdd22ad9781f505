"""`rollout serve --replicas 2` as a real process tree (HF backend, tiny model): the openai
client through the front server (streams too), a batch job through `--server`, a replica
killed (the other serves on), then both (503)."""

import json
import os
import signal
import subprocess
import sys
import time

import openai
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from processes import replicas_of

from rollout.kit.process import HOST, ServerProcess, free_port
from rollout.testing.server_contract import CALL_REGEX, TOOLS, check_one_sequence

KEY = "front-key"


@pytest.fixture(scope="module")
def front(tiny_model):
    port = free_port()
    server = ServerProcess("serve", [sys.executable, "-m", "rollout", "serve", "--backend", "hf",
                                     "--model", str(tiny_model), "--replicas", "2",
                                     "--port", str(port), "--served-model-name", "tiny",
                                     "--replica-restarts", "0"],
                           env={"ROLLOUT_API_KEY": KEY})
    url = f"http://{HOST}:{port}"
    try:
        server.wait_healthy(f"{url}/health", 300, {"Authorization": f"Bearer {KEY}"})
        yield server, url
    finally:
        server.stop()


def health(url: str) -> tuple[int, dict]:
    import urllib.error
    import urllib.request

    request = urllib.request.Request(f"{url}/health", headers={"Authorization": f"Bearer {KEY}"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_a_session_through_the_front_is_one_sequence_of_the_sampled_ids(front):
    """The front records the session and continues each turn from the ids sampled before,
    whichever replica sampled them: four turns make one branch of exactly the ids the turns
    returned."""
    _, url = front
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)
    check_one_sequence(client, url, turns=4, model="tiny", key=KEY, session="pooled")


def test_replicas_behind_one_server_survive_one_death_and_503_after_all(front, tmp_path):
    server, url = front
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)
    answer = client.chat.completions.create(model="tiny", max_tokens=4, temperature=0,
                                            messages=[{"role": "user", "content": "hi"}])
    assert answer.choices[0].finish_reason in ("stop", "length")
    # Tools, a constraint and a bias travel to the replicas in rollout's own schema.
    called = client.chat.completions.create(
        model="tiny", max_tokens=128, temperature=1.0, tools=TOOLS,
        messages=[{"role": "user", "content": "2 + 3?"}],
        extra_body={"structured_outputs": {"regex": CALL_REGEX}, "logit_bias": {"7": -100}})
    assert called.choices[0].finish_reason == "tool_calls"
    assert called.choices[0].message.tool_calls[0].function.name == "add"
    # The Responses API through the pool: a conversation continued by its id.
    first = client.responses.create(model="tiny", input="hi", max_output_tokens=4)
    second = client.responses.create(model="tiny", input="again", max_output_tokens=4,
                                     previous_response_id=first.id)
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    status, body = health(url)
    assert status == 200 and body["healthy"] == 2
    # Streams pass through the front server in pieces, not in one. (A loaded machine lets
    # the engine put several steps' tokens in one chunk, so the count of pieces varies.)
    pieces = [c.choices[0].text for c in client.completions.create(
        model="tiny", prompt="the ka", max_tokens=32, temperature=0, stream=True,
        extra_body={"ignore_eos": True}) if c.choices and c.choices[0].text]
    assert len(pieces) > 1

    # A batch job through the front server.
    prompts = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt": [f"the ka {i}" for i in range(12)]}), prompts)
    out = tmp_path / "out.parquet"
    job = subprocess.run([sys.executable, "-m", "rollout", "generate", "--server", url,
                          "--input", str(prompts), "--output", str(out), "--n", "2",
                          "--max-tokens", "4", "--quiet"],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "ROLLOUT_CLIENT_API_KEY": KEY})
    assert job.returncode == 0, job.stderr
    rows = pq.read_table(out).to_pylist()
    assert len(rows) == 12 and all(r["error"] is None and len(r["responses"]) == 2 for r in rows)

    first, second = replicas_of(server.proc.pid)
    os.kill(first, signal.SIGKILL)
    for i in range(6):  # the other replica answers, whichever the balancer tried first
        client.completions.create(model="tiny", prompt=f"x {i}", max_tokens=2)
    deadline = time.monotonic() + 60
    while health(url)[1].get("healthy") != 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert health(url)[1]["healthy"] == 1

    os.kill(second, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while health(url)[0] != 503 and time.monotonic() < deadline:
        time.sleep(0.2)
    status, body = health(url)
    assert status == 503 and body["error"]["code"] == "no_replica"
    with pytest.raises(openai.APIStatusError) as caught:
        client.completions.create(model="tiny", prompt="x", max_tokens=2)
    assert caught.value.status_code == 503
    assert server.alive()  # the front server itself stays up
