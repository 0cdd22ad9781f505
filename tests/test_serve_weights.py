"""Weights pushed from a trainer into a served backend over shared memory (HF backend, tiny
model, a real server on a thread of this process): the output after an update equals a
fresh load, versions reach the results, and every way an update fails leaves the server
refusing requests, saying why, until a full update succeeds. The trainer's `ServedRollout`
also awaits and streams requests as a `Rollout` does."""

import asyncio
import json
import time
import urllib.error
import urllib.request

import pytest

from rollout import InvalidRequestError, UnsupportedError, load_backend
from rollout.apps.serving.app import ServerThread
from rollout.service.served import ServedRollout
from rollout.service.service import LocalService
from rollout.weights.buckets import iter_buckets
from rollout.weights.transports.nodes import this_node
from rollout.weights.transports.shm import SHM_DIR, ShmSender
from rollout.testing.contract import probe_requests
from rollout.testing.model_folders import load_weights, perturbed_copy

KEY = "weights-key"


@pytest.fixture(scope="module")
def served(tiny_model, tmp_path_factory):
    other = perturbed_copy(tiny_model, tmp_path_factory.mktemp("other"))
    rollout = load_backend("hf", str(tiny_model))
    with ServerThread(LocalService(rollout, "tiny"), api_key=KEY) as server:
        trainer = ServedRollout.connect(server.url, KEY)
        fresh = {}
        for name, folder in (("base", tiny_model), ("other", other)):
            with load_backend("hf", str(folder)) as engine:
                fresh[name] = probe(engine)
        yield trainer, server.url, {"base": load_weights(tiny_model),
                                    "other": load_weights(other)}, fresh, rollout
        trainer.close()
    rollout.close()


def probe(backend) -> tuple:
    return tuple(c.unwrap()[0].token_ids for c in backend.generate(probe_requests()))


def versions(trainer) -> set:
    return {r.weight_version for c in trainer.generate(probe_requests()) for r in c.unwrap()}


def post(url: str, path: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(f"{url}{path}", data=json.dumps(body).encode(),
                                     headers={"Authorization": f"Bearer {KEY}",
                                              "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_pushed_weights_equal_a_fresh_load_and_carry_their_version(served):
    trainer, _, weights, fresh, _ = served
    assert fresh["base"] != fresh["other"]
    # Small buckets: many of them through one reused shared-memory file, so a receiver
    # that read the file after answering would load the next bucket's bytes.
    trainer.update_weights(weights["other"].items(), bucket_bytes=4096, version=1)
    assert probe(trainer) == fresh["other"]
    assert versions(trainer) == {1} and trainer.health()["weight_version"] == 1
    trainer.update_weights(weights["base"].items(), version=2)
    assert probe(trainer) == fresh["base"] and versions(trainer) == {2}


def test_weights_pushed_through_a_gloo_group_equal_a_fresh_load(served):
    trainer, _, weights, fresh, _ = served
    trainer.update_weights(weights["other"].items(), bucket_bytes=4096, version=21,
                           transport="gloo")
    assert probe(trainer) == fresh["other"] and versions(trainer) == {21}
    trainer.update_weights(weights["base"].items(), version=22, transport="gloo")
    assert probe(trainer) == fresh["base"] and versions(trainer) == {22}
    with pytest.raises(InvalidRequestError, match="transport"):
        trainer.update_weights(weights["base"].items(), transport="ucx")


def test_gpu_transports_are_refused_with_their_reason_where_there_is_no_gpu(served):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    trainer, url, weights, fresh, _ = served
    with pytest.raises(UnsupportedError, match="no GPU"):
        trainer.update_weights(weights["base"].items(), transport="nccl")
    # A trainer with a GPU, a server without: the server refuses the group, saying why.
    status, begun = post(url, "/rollout/weights/begin", {})
    status, answer = post(url, "/rollout/weights/group", {
        "update": begun["update"], "host": "127.0.0.1", "port": 1, "name": "g",
        "world_size": 2, "first_rank": 1, "backend": "nccl"})
    assert status == 501 and answer["error"]["code"] == "unsupported"
    assert "no GPU" in answer["error"]["message"]
    assert probe(trainer) == fresh["base"]  # nothing was sent: the old weights serve

    with pytest.raises(UnsupportedError, match="no GPU"):
        trainer.update_weights(weights["base"].items(), transport="cuda_ipc")
    status, begun = post(url, "/rollout/weights/begin", {})
    status, answer = post(url, "/rollout/weights/bucket", {"update": begun["update"], "bucket": {
        "transport": "cuda_ipc", "nbytes": 0, "tensors": [], "ipc": {}}})
    assert status == 501 and answer["error"]["code"] == "unsupported"
    assert "no GPU" in answer["error"]["message"]
    assert probe(trainer) == fresh["base"]


def test_a_served_rollout_awaits_and_streams_requests(served, monkeypatch):
    trainer, _, _, _, rollout = served
    requests = probe_requests()
    expected = [c.unwrap()[0].token_ids for c in trainer.generate(requests)]
    # 48 tokens, so that the stream comes in pieces even where a loaded machine merges some.
    streamed = {**requests[0], "id": "streamed",
                "sampling": {**requests[0]["sampling"], "max_tokens": 48}}
    expected_stream = trainer.generate([streamed])[0].unwrap()[0].token_ids
    long = {"id": "left", "prompt": "a",
            "sampling": {"n": 4, "max_tokens": 2000, "ignore_eos": True}}
    made = []  # the tokens the server's engine made for the stream left early
    run = rollout._run

    async def counted(flight, timeout, sink=None):
        def counting(chunk):
            made.append(len(chunk.token_ids))
            sink(chunk)

        left = sink is not None and flight.request.id == "left"
        return await run(flight, timeout, counting if left else sink)

    monkeypatch.setattr(rollout, "_run", counted)

    async def calls():
        completions = await asyncio.gather(*(trainer.agenerate(r) for r in requests))
        stream = trainer.stream(streamed)
        chunks = [chunk async for chunk in stream]
        left = trainer.stream(long)
        async for _ in left:  # one chunk, then the caller leaves
            break
        await left.aclose()
        return completions, chunks, stream.completion

    completions, chunks, completion = asyncio.run(calls())
    assert [c.unwrap()[0].token_ids for c in completions] == expected
    assert len(chunks) > 1
    assert [t for c in chunks for t in c.token_ids] == list(completion.unwrap()[0].token_ids) \
        == list(expected_stream)
    deadline = time.monotonic() + 60  # the request left early stops on the server
    while rollout._flights and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not rollout._flights
    assert 0 < sum(made) < 4 * 2000, "the request left early ran to its end"


def test_release_and_resume_reach_the_served_backend(served):
    trainer, *_, rollout = served
    trainer.release(["kv_cache"])
    assert rollout.released == {"kv_cache"}
    trainer.resume()
    assert not rollout.released


def test_a_trainer_that_stops_sending_leaves_the_server_dirty_until_a_full_update(served):
    trainer, url, weights, fresh, _ = served
    status, begun = post(url, "/rollout/weights/begin", {"version": 9, "timeout": 1})
    assert status == 200
    with ShmSender() as sender:
        first = next(iter_buckets(weights["other"].items(), 4096))
        assert post(url, "/rollout/weights/bucket",
                    {"update": begun["update"], "bucket": sender.put(first)})[0] == 200
        time.sleep(2.5)  # the trainer died: no more buckets, no end
    status, body = post(url, "/rollout/generate", {"requests": probe_requests()})
    assert status == 503 and body["error"]["code"] == "weights_dirty", body
    assert "failed midway" in body["error"]["message"]
    trainer.update_weights(weights["base"].items(), version=3)
    assert probe(trainer) == fresh["base"] and versions(trainer) == {3}


def test_a_bucket_that_lies_about_its_size_is_refused_and_leaves_the_server_dirty(served):
    trainer, url, weights, fresh, _ = served
    status, begun = post(url, "/rollout/weights/begin", {"version": 4})
    with ShmSender() as sender:
        buckets = iter_buckets(weights["other"].items(), 4096)
        assert post(url, "/rollout/weights/bucket",
                    {"update": begun["update"], "bucket": sender.put(next(buckets))})[0] == 200
        message = sender.put(next(buckets))
        message["nbytes"] += 4096  # more bytes announced than the file holds
        status, body = post(url, "/rollout/weights/bucket",
                            {"update": begun["update"], "bucket": message})
    assert status == 400 and body["error"]["param"] == "nbytes", body
    assert post(url, "/rollout/weights/end", {"update": begun["update"]})[0] == 404
    status, body = post(url, "/rollout/generate", {"requests": probe_requests()})
    assert status == 503 and body["error"]["code"] == "weights_dirty"
    trainer.update_weights(weights["base"].items(), version=5)
    assert probe(trainer) == fresh["base"]


def test_bad_update_options_are_refused_naming_the_field(served):
    trainer, url, weights, *_ = served
    with pytest.raises(InvalidRequestError, match="pause"):
        trainer.update_weights(weights["base"].items(), pause="soon")
    for body, field in (({"version": "v2"}, "version"), ({"timeout": -1}, "timeout"),
                        ({"flush": True}, "flush")):
        status, answer = post(url, "/rollout/weights/begin", body)
        assert status == 400 and answer["error"]["param"] == field, answer
    status, answer = post(url, "/rollout/weights/bucket", {"update": "nope", "bucket": {}})
    assert status == 404 and answer["error"]["param"] == "update"
    status, begun = post(url, "/rollout/weights/begin", {})
    assert begun["receivers"] == 1 and begun["nodes"] == [this_node()]
    status, answer = post(url, "/rollout/weights/group", {
        "update": begun["update"], "host": "127.0.0.1", "port": -1, "backend": "gloo"})
    assert status == 400 and answer["error"]["param"] == "group.port", answer
    status, begun = post(url, "/rollout/weights/begin", {})
    status, answer = post(url, "/rollout/weights/bucket", {"update": begun["update"], "bucket": {
        "transport": "gloo", "nbytes": 0, "tensors": []}})
    assert status == 400 and "group step" in answer["error"]["message"], answer
    # A name outside rollout's shared-memory files is never opened.
    status, begun = post(url, "/rollout/weights/begin", {})
    status, answer = post(url, "/rollout/weights/bucket", {"update": begun["update"], "bucket": {
        "transport": "shm", "name": "../../etc/passwd", "nbytes": 0, "tensors": []}})
    assert status == 400 and answer["error"]["param"] == "name", answer
    trainer.update_weights(weights["base"].items())  # clean again for the tests after


TRAINER = """
import sys, time
from rollout.service.served import ServedRollout
from rollout.testing.model_folders import load_weights

weights = list(load_weights(sys.argv[3]).items())

def dies_halfway():
    yield from weights[: len(weights) // 2]
    print("half sent", flush=True)
    time.sleep(600)  # killed here

ServedRollout.connect(sys.argv[1], sys.argv[2]).update_weights(
    dies_halfway(), bucket_bytes=4096, version=99, timeout=2)
"""


def test_a_trainer_killed_mid_transfer_leaves_the_server_dirty(served, tiny_model):
    import signal
    import subprocess
    import sys

    trainer, url, weights, fresh, rollout = served
    child = subprocess.Popen([sys.executable, "-c", TRAINER, url, KEY, str(tiny_model)],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "half sent"
        child.send_signal(signal.SIGKILL)
    finally:
        child.wait(30)
    deadline = time.monotonic() + 30
    while post(url, "/rollout/generate", {"requests": probe_requests()})[0] != 503:
        assert time.monotonic() < deadline, "the server still serves after a half update"
        time.sleep(0.5)
    assert rollout.weight_version != 99
    trainer.update_weights(weights["base"].items(), version=6)
    assert probe(trainer) == fresh["base"] and versions(trainer) == {6}
    # The killed trainer could not remove its shared-memory file; the next sender did.
    assert not list(SHM_DIR.glob(f"rollout-weights-{child.pid}-*"))
