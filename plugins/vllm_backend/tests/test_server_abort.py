"""Server mode: tokens come as they are made (stream_interval=1), and a request stopped
while it runs (its stream closed) leaves nothing running in the vLLM server.

The tests' coroutines run on the engine loop, where the streams are read. While many
streams pour in, another thread of this process may not run for as long as they last (a
minute has been seen on 2 busy cores), so a check made from it could come after the
requests are done. The server runs at most 4 sequences a step, so the requests queued
behind the first ones are still waiting when the first events arrive."""

import asyncio
import re
import time
import urllib.request

import pytest
from conftest import ENGINE

import rollout
from rollout.kit.aio import engine_loop
from rollout.testing.contract import check_it_kept_what_was_held_back, stopped_beside_a_stream

LONG = {"prompt": "the ka lo", "sampling": {"max_tokens": 2000, "ignore_eos": True}}


@pytest.fixture(scope="module")
def backend(tiny_model):
    with rollout.load_backend("vllm", model=str(tiny_model), mode="server", **ENGINE,
                              engine_args={"max_num_seqs": 4}) as r:
        yield r


def running(backend) -> float:
    """The server's own count of requests running or waiting."""
    with urllib.request.urlopen(backend._backend.engine.url + "/metrics", timeout=60) as r:
        text = r.read().decode()
    return sum(float(m) for m in re.findall(
        r"^vllm:num_requests_(?:running|waiting)\{[^}]*\} (\S+)$", text, re.M))


def on_engine_loop(coro):
    return engine_loop().run(coro, 300, "the test")


def test_a_stream_gets_its_tokens_while_they_are_made(backend):
    """With stream_interval=1 a reader that keeps up gets one token an event; one that
    falls behind gets what it has not read merged (vLLM merges, and so does the backend).
    What holds on any machine: events come before the request's end, none is empty, and
    an abort ends the requests still running or queued."""
    ids = ["streamed"] + [f"beside-{i}" for i in range(15)]

    async def run():
        beside = [asyncio.ensure_future(backend.agenerate({**LONG, "id": i})) for i in ids[1:]]
        chunks = []
        async for chunk in backend.stream({**LONG, "id": ids[0]}):
            chunks.append(chunk)
            if len(chunks) == 3:
                backend.abort(ids)
        return chunks, await asyncio.gather(*beside)

    chunks, beside = on_engine_loop(run())
    assert all(c.token_ids and c.finish_reason is None for c in chunks[:3])
    assert chunks[-1].finish_reason in ("abort", "length")
    assert beside[-1].unwrap()[0].finish_reason == "abort"  # queued behind 3 rounds


def test_an_aborted_request_leaves_the_server(backend):
    ids = [f"long-{i}" for i in range(16)]

    async def run():
        tasks = [asyncio.ensure_future(backend.agenerate({**LONG, "id": i})) for i in ids[1:]]
        async for _ in backend.stream({**LONG, "id": ids[0]}):
            break  # the server runs the requests: abort them all
        backend.abort(ids)
        return await asyncio.gather(*tasks)

    completions = on_engine_loop(run())
    reasons = [r.finish_reason for c in completions for r in c.unwrap()]
    assert set(reasons) <= {"abort", "length"} and reasons[-1] == "abort", reasons
    deadline = time.monotonic() + 30
    while running(backend) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert running(backend) == 0


def test_an_aborted_request_keeps_what_vllm_held_back(backend):
    """A caller that does not stream gets its tokens 16 at a time (`stream_interval`); an
    abort (and a "keep" update, which stops requests the same way) still gets every token
    the server made, not only those it sent, so none is lost or made again. Measured
    against a stream of the same greedy request beside it, both aborted with the server
    held."""
    greedy = {"prompt": "the ka lo", "sampling": {"max_tokens": 200, "ignore_eos": True,
                                                  "top_k": 1, "logprobs": 0, "n": 2}}
    stopped = stopped_beside_a_stream(backend, greedy, engine=backend._backend.engine)
    quiet, streamed = on_engine_loop(stopped)
    check_it_kept_what_was_held_back(quiet, streamed)
