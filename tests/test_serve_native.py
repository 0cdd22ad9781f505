"""The native routes `POST /rollout/generate` and `POST /rollout/stream`: rollout's own
request, chunk and completion schema over HTTP, as the replica pool's client sends it,
against the real HF backend."""

import asyncio

import aiohttp
import pytest

import rollout
from rollout.contract import convert
from rollout.contract.errors import InvalidRequestError
from rollout.contract.schemas import Completion, Request
from rollout.apps.serving.app import ServerThread
from rollout.service.client import RemoteService
from rollout.service.service import CALL, LocalService


@pytest.fixture(scope="module")
def ro(tiny_model):
    with rollout.load_backend("hf", model=str(tiny_model), max_model_len=64) as ro:
        yield ro


@pytest.fixture(scope="module")
def server(ro):
    with ServerThread(LocalService(ro, "tiny")) as server:
        yield server


def post(server, body) -> tuple[int, dict]:
    async def call():
        async with aiohttp.ClientSession() as session:
            async with session.post(f"{server.url}/rollout/generate", json=body) as response:
                return response.status, await response.json()

    return asyncio.run(call())


def test_a_bad_request_fails_alone_and_token_ids_round_trip(server, ro):
    requests = [
        {"id": "text", "prompt": "def add(a, b):", "sampling": {"max_tokens": 5, "temperature": 0}},
        {"id": "typo", "prompt": "hello", "sampling": {"temprature": 0}},
        {"id": "tokens", "prompt_token_ids": [5, 17, 42],
         "sampling": {"max_tokens": 4, "temperature": 0, "logprobs": 2}},
        {"id": "long", "prompt": "hello there " * 64},
    ]
    status, body = post(server, {"requests": requests})
    assert status == 200
    text, typo, tokens, long = [convert.structure(c, Completion) for c in body["completions"]]
    assert [c.request_id for c in (text, typo, tokens, long)] == ["text", "typo", "tokens", "long"]
    assert (typo.error.kind, typo.error.field) == ("invalid_request", "sampling.temprature")
    assert (long.error.kind, long.error.field) == ("invalid_request", "prompt")
    expected = ro.generate([requests[0], requests[2]])
    for served, direct in ((text, expected[0]), (tokens, expected[1])):
        same(served.unwrap()[0], direct.unwrap()[0])
    assert len(tokens.results[0].top_logprobs[0]) == 2


def same(served, direct):
    """The same sample. Logprobs agree to float precision only: requests that join a
    running batch at different steps are padded differently."""
    assert (served.token_ids, served.text, served.finish_reason, served.prompt_token_ids) == (
        direct.token_ids, direct.text, direct.finish_reason, direct.prompt_token_ids)
    if direct.logprobs is not None:
        assert served.logprobs == pytest.approx(direct.logprobs, abs=1e-4)
        assert [[t.token_id for t in top] for top in served.top_logprobs] == [
            [t.token_id for t in top] for top in direct.top_logprobs]


def test_the_same_id_twice_is_served_twice(server):
    request = {"id": "same", "prompt": "hello", "sampling": {"max_tokens": 2, "temperature": 0}}
    status, body = post(server, {"requests": [request, request]})
    assert status == 200
    first, second = [convert.structure(c, Completion) for c in body["completions"]]
    assert first.ok and second.ok and first.results == second.results


@pytest.mark.parametrize("body", [{"prompts": []}, [], {"requests": {"prompt": "x"}},
                                  {"requests": [], "timeout": 5}])
def test_a_body_of_another_shape_is_a_400(server, body):
    status, answer = post(server, body)
    assert status == 400 and answer["error"]["param"] == "requests"


def test_an_empty_batch_answers_nothing(server):
    assert post(server, {"requests": []}) == (200, {"completions": []})


def remote_stream(server, request: dict):
    """(chunks, completion) of one request streamed through the pool's client, or the
    error its iteration raised."""
    async def call():
        service = RemoteService(server.url)
        stream = service.stream(convert.structure(request, Request))
        try:
            return [chunk async for chunk in stream], stream.completion
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            return exc
        finally:
            await service.close()

    return asyncio.run(call())


def test_a_stream_comes_token_by_token_and_joins_into_its_completion(server, ro):
    request = {"id": "s", "prompt": "the ka lo",
               "sampling": {"max_tokens": 48, "temperature": 0, "ignore_eos": True,
                            "logprobs": 1}}
    chunks, completion = remote_stream(server, request)
    # Not one piece at the end. Tokens made while the loop was busy come merged (the HF
    # backend takes all it finds), so the count depends on timing: at least two.
    assert len(chunks) >= 2
    sample = completion.unwrap()[0]
    assert tuple(t for c in chunks for t in c.token_ids) == sample.token_ids
    assert "".join(c.text for c in chunks) == sample.text
    assert chunks[-1].finish_reason == sample.finish_reason == "length"
    same(sample, ro.generate([request])[0].unwrap()[0])


def test_a_streamed_request_error_is_raised_as_itself(server):
    error = remote_stream(server, {"prompt": "hello there " * 64})
    assert isinstance(error, InvalidRequestError) and error.field == "prompt"


def test_a_stream_body_of_another_shape_is_a_400(server):
    async def call():
        async with aiohttp.ClientSession() as session:
            async with session.post(f"{server.url}/rollout/stream",
                                    json={"requests": [{"prompt": "x"}]}) as response:
                return response.status, await response.json()

    status, answer = asyncio.run(call())
    assert status == 400 and answer["error"]["param"] == "request"


def test_an_abort_that_overtakes_its_request_stops_it_when_it_comes(server):
    """An abort names the sampler's calls (the X-Rollout-Call header) besides the request
    ids: a request that comes after it, of one of those calls, ends at once, aborted, by
    either route. The same id under another call, or under none, runs."""
    request = convert.structure({"id": "late", "prompt": "the ka lo", "sampling": {
        "max_tokens": 6, "temperature": 0, "ignore_eos": True}}, Request)

    async def as_call(call, make):
        named = CALL.set(call)
        try:
            return await make()
        finally:
            CALL.reset(named)

    async def streamed(service):
        stream = service.stream(request)
        return [chunk async for chunk in stream], stream.completion

    async def run():
        service = RemoteService(server.url)
        try:
            await service.abort(["late"], ["call-1", "call-2"])
            stopped = await as_call("call-1", lambda: service.generate(request))
            stopped_stream = await as_call("call-2", lambda: streamed(service))
            others = [await as_call(c, lambda: service.generate(request))
                      for c in ("call-3", None)]
            return stopped, stopped_stream, others
        finally:
            await service.close()

    stopped, (chunks, stopped_streamed), others = asyncio.run(run())
    for completion in (stopped, stopped_streamed):
        (result,) = completion.unwrap()
        assert (result.finish_reason, result.token_ids) == ("abort", ())
    assert chunks == []
    for completion in others:
        (result,) = completion.unwrap()
        assert (result.finish_reason, result.completion_tokens) == ("length", 6)


@pytest.mark.parametrize("body", [{"request_ids": "late"}, {"request_ids": ["a"], "calls": "c"},
                                  {"request_ids": ["a"], "calls": [1]}, {"calls": ["c"]},
                                  {"request_ids": ["a"], "why": "x"}])
def test_an_abort_body_of_another_shape_is_a_400(server, body):
    async def call():
        async with aiohttp.ClientSession() as session:
            async with session.post(f"{server.url}/rollout/abort", json=body) as response:
                return response.status, await response.json()

    status, answer = asyncio.run(call())
    assert status == 400 and answer["error"]["param"] == "request_ids"


@pytest.mark.parametrize("image", ["/etc/hostname", "file:///etc/hostname"])
def test_a_server_reads_no_image_file_for_a_client(server, image):
    """Over HTTP an image comes with the request (a data: URL); a path would make the
    server read its own disk for whoever asks."""
    messages = [{"role": "user", "content": [{"type": "image", "image": image}]}]
    status, body = post(server, {"requests": [{"id": "a", "messages": messages},
                                              {"id": "b", "prompt": "x",
                                               "sampling": {"max_tokens": 2}}]})
    path, other = [convert.structure(c, Completion) for c in body["completions"]]
    assert status == 200 and path.error.field == "messages[0].content[0]"
    assert "data: URL" in path.error.message and other.unwrap()
    error = remote_stream(server, {"messages": messages})
    assert isinstance(error, InvalidRequestError) and error.field == "messages[0].content[0]"
