"""The native route `POST /rollout/generate`: rollout's own request and completion schema
over HTTP, as the replica pool's client sends it, against the real HF backend."""

import asyncio

import aiohttp
import pytest

import rollout
from rollout.contract import convert
from rollout.contract.schemas import Completion
from rollout.apps.serving.app import ServerThread
from rollout.apps.serving.service import LocalService


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
