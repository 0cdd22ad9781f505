"""Server mode: tokens come as they are made (stream_interval=1), and a request stopped
while it runs (its stream closed) leaves nothing running in the vLLM server."""

import asyncio
import re
import time
import urllib.request

import pytest
from conftest import ENGINE

import rollout

LONG = {"prompt": "the ka lo", "sampling": {"max_tokens": 2000, "ignore_eos": True, "n": 2}}


@pytest.fixture(scope="module")
def backend(tiny_model):
    with rollout.load_backend("vllm", model=str(tiny_model), mode="server", **ENGINE) as r:
        yield r


def running(backend) -> float:
    """The server's own count of requests running or waiting."""
    with urllib.request.urlopen(backend._backend.engine.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(m) for m in re.findall(
        r"^vllm:num_requests_(?:running|waiting)\{[^}]*\} (\S+)$", text, re.M))


def test_a_stream_gets_its_tokens_while_they_are_made(backend):
    """With stream_interval=1 an idle reader gets one token an event; a starved one gets
    what it has not read merged (vLLM merges, and so does the backend). What holds on any
    machine: events come while the request runs, none is empty, and an abort ends them.
    Fifteen more requests of 2000 tokens beside it make it run for seconds."""
    one = {**LONG, "sampling": {**LONG["sampling"], "n": 1}}
    ids = ["streamed"] + [f"beside-{i}" for i in range(15)]

    async def run():
        beside = [asyncio.ensure_future(backend.agenerate({**one, "id": i})) for i in ids[1:]]
        chunks = []
        async for chunk in backend.stream({**one, "id": ids[0]}):
            chunks.append(chunk)
            if len(chunks) == 3:
                backend.abort(ids)
        return chunks, await asyncio.gather(*beside)

    chunks, beside = asyncio.run(run())
    assert all(c.token_ids and c.finish_reason is None for c in chunks[:3])
    assert chunks[-1].finish_reason == "abort"
    assert {r.finish_reason for c in beside for r in c.unwrap()} == {"abort"}


def test_an_aborted_request_leaves_the_server(backend):
    async def run():
        tasks = [asyncio.ensure_future(backend.agenerate({**LONG, "id": f"long-{i}"}))
                 for i in range(4)]
        deadline = time.monotonic() + 60  # (a loaded machine takes a while to start them)
        while not await asyncio.to_thread(running, backend) and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        assert await asyncio.to_thread(running, backend) > 0  # the count sees them
        backend.abort([f"long-{i}" for i in range(4)])
        return await asyncio.gather(*tasks)

    for completion in asyncio.run(run()):
        assert [r.finish_reason for r in completion.unwrap()] == ["abort", "abort"]
    deadline = time.monotonic() + 30
    while running(backend) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert running(backend) == 0
