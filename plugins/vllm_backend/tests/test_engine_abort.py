"""Engine and async modes: a request stopped at any point (before its add reaches vLLM,
just after, or while it runs) leaves nothing running in vLLM, which drops nothing by
itself."""

import asyncio
import time

import pytest

from rollout.kit.aio import engine_loop
from rollout.testing.contract import check_it_kept_what_was_held_back, stopped_beside_a_stream

STEPS = 20  # engine steps after which an aborted request still in the core has leaked
LONG = {"prompt": "the ka lo", "sampling": {"max_tokens": 2000, "ignore_eos": True, "n": 2}}


@pytest.fixture(scope="module", params=["engine", "async"])
def backend(shared_vllm, request):
    return shared_vllm(request.param)


def unfinished(backend) -> int:
    """Requests in vLLM: in engine mode counted on its own thread after every command
    queued before; in async mode in this process's output processor and in the core."""
    engine = backend._backend.engine
    if backend._backend.engine.__class__.__name__ == "AsyncEngine":
        return engine_loop().run(_unfinished_async(engine.engine), 30, "counting vLLM's requests")
    return engine_loop().run(engine._call(lambda e: e.get_num_unfinished_requests()), 30,
                             "counting vLLM's requests")


async def _unfinished_async(llm) -> int:
    # The core takes messages in order, so it has seen every abort sent before this call;
    # its scheduler may still hold a finished request for one step. The core answers a call
    # between two steps and steps whenever it has work, so each answer "has work" after the
    # first means one step more: a leaked request (2000 tokens) still has work after
    # STEPS; a held one not. Counted in steps, not seconds: a loaded machine's step may
    # take one (60 s only keeps a stuck core from hanging the test).
    answers, deadline = 0, time.monotonic() + 60
    while await llm.engine_core.call_utility_async("has_work"):
        answers += 1
        if answers > STEPS or time.monotonic() > deadline:
            return 1 + llm.get_num_unfinished_requests()
        await asyncio.sleep(0.05)
    return llm.get_num_unfinished_requests()


# One loop turn: the calls have started, and their adds are just going to vLLM.
@pytest.mark.parametrize("turns", [1, 2, 5, 200])
def test_an_aborted_request_leaves_the_engine(backend, turns):
    requests = [{**LONG, "id": f"turns-{turns}-{i}"} for i in range(4)]

    async def run():  # on the engine loop, where the core runs requests
        tasks = [asyncio.ensure_future(backend.agenerate(r)) for r in requests]
        for _ in range(turns):
            await asyncio.sleep(0)
        backend.abort([r["id"] for r in requests])
        return await asyncio.gather(*tasks)

    for completion in engine_loop().run(run(), 60, "aborted requests"):
        assert [r.finish_reason for r in completion.unwrap()] == ["abort", "abort"]
    assert unfinished(backend) == 0


def test_a_stream_left_early_leaves_the_engine(backend):
    async def run():
        stream = backend.stream(LONG)
        seen = 0
        async for chunk in stream:
            seen += len(chunk.token_ids)
            if seen >= 5:
                break
        await stream.aclose()
        return seen

    assert asyncio.run(run()) >= 5
    assert unfinished(backend) == 0


def test_an_aborted_request_keeps_what_vllm_held_back(backend):
    """A caller that does not stream gets its tokens 16 at a time (`stream_interval`); an
    abort (and a "keep" update, which stops requests the same way) still gets every token
    vLLM made, not only those handed over, so none is lost or made again. Measured against
    a stream of the same greedy request beside it, both aborted with the engine held."""
    greedy = {"prompt": "the ka lo", "sampling": {"max_tokens": 200, "ignore_eos": True,
                                                  "top_k": 1, "logprobs": 0, "n": 2}}
    stopped = stopped_beside_a_stream(backend, greedy, engine=backend._backend.engine)
    quiet, streamed = engine_loop().run(stopped, 240, "aborted beside a stream")
    check_it_kept_what_was_held_back(quiet, streamed)
    assert unfinished(backend) == 0
