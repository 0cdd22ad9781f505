"""Server mode: tokens come one event each (stream_interval=1), and a request stopped
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


def test_a_stream_gets_its_tokens_one_by_one(backend):
    async def run():
        return [len(c.token_ids) async for c in backend.stream(
            {"prompt": "def x", "sampling": {"max_tokens": 8, "ignore_eos": True}})]

    assert asyncio.run(run()) == [1] * 8


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
