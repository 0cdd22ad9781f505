"""Registering a backend checks its hooks against the specifications; the core's own rules
(refusals, contract errors, lifecycle waits) on a stand-in backend that answers at once."""

import asyncio
import threading

import pytest

import rollout
from rollout import BackendContractError, BackendReleasedError, Capabilities, Chunk, Result, \
    Rollout

NONE = {c: "not in this test backend" for c in
        ("release", "update_weights", "logprobs", "seed", "chat", "images")}


class Encoder:
    """Characters as token ids: enough for the core to encode and decode."""

    def encode(self, request):
        return [ord(c) for c in request.prompt]

    def decode(self, token_ids):
        return "".join(map(chr, token_ids))


class Minimal:
    """Answers every sample with one token; a stand-in for the core's rules."""

    unsupported = NONE

    @rollout.hookimpl
    def capabilities(self):
        return Capabilities(unsupported=dict(self.unsupported))

    @rollout.hookimpl
    def prompt_encoder(self):
        return Encoder()

    @rollout.hookimpl
    async def generate(self, request, prompt_token_ids):
        for i in range(request.sampling.n):
            yield Chunk(i, (120,), finish_reason="length")


def test_a_misspelled_hook_is_refused():
    class Typo(Minimal):
        @rollout.hookimpl
        def generat(self, request):
            return []

    with pytest.raises(BackendContractError, match="generat"):
        Rollout(Typo())


def test_the_old_batch_hook_is_refused_by_its_arguments():
    class Old(Minimal):
        @rollout.hookimpl
        def generate(self, requests):
            return []

    with pytest.raises(BackendContractError, match="requests"):
        Rollout(Old())


@pytest.mark.parametrize("hook", ["generate", "prompt_encoder"])
def test_required_hooks(hook):
    class Without:
        @rollout.hookimpl
        def capabilities(self):
            return Capabilities()

    if hook == "generate":
        Without.prompt_encoder = Minimal.prompt_encoder
    else:
        Without.generate = Minimal.generate
    with pytest.raises(BackendContractError, match=hook):
        Rollout(Without())


def test_claimed_capability_needs_its_hook():
    class Claims(Minimal):
        unsupported = {k: v for k, v in NONE.items() if k != "release"}

    with pytest.raises(BackendContractError, match="release"):
        Rollout(Claims())


def test_unsupported_capability_is_refused_with_its_reason():
    ro = Rollout(Minimal())
    with pytest.raises(rollout.UnsupportedError, match="not in this test backend"):
        ro.release()
    (completion,) = ro.generate([{"prompt": "x", "sampling": {"logprobs": 1}}])
    assert completion.error.field == "sampling.logprobs"
    assert "not in this test backend" in completion.error.detail


def test_a_chunk_for_a_sample_that_does_not_exist_fails_its_request_alone():
    class Extra(Minimal):
        @rollout.hookimpl
        async def generate(self, request, prompt_token_ids):
            yield Chunk(request.sampling.n, (1,), finish_reason="stop")

    bad, = Rollout(Extra()).generate([{"prompt": "x"}])
    assert isinstance(bad.error, BackendContractError) and "sample 1" in str(bad.error)


def test_unfinished_samples_and_backend_bugs_fail_their_request_alone():
    class Flaky(Minimal):
        @rollout.hookimpl
        async def generate(self, request, prompt_token_ids):
            if request.prompt == "bug":
                raise KeyError("oops")
            if request.prompt == "short":
                yield Chunk(0, (1,))  # never finished
                return
            async for chunk in Minimal.generate(self, request, prompt_token_ids):
                yield chunk

    bug, short, good = Rollout(Flaky()).generate([{"prompt": p} for p in ("bug", "short", "ok")])
    assert isinstance(bug.error, rollout.GenerationError) and "oops" in str(bug.error)
    assert isinstance(short.error, BackendContractError)
    assert good.unwrap()[0].text == "x"


def test_a_dead_engine_fails_every_later_call():
    class Dying(Minimal):
        @rollout.hookimpl
        async def generate(self, request, prompt_token_ids):
            raise rollout.EngineDeadError("the engine exited")
            yield  # an async generator

    ro = Rollout(Dying())
    for _ in range(2):
        with pytest.raises(rollout.EngineDeadError, match="exited"):
            ro.generate([{"prompt": "x"}])
    with pytest.raises(rollout.EngineDeadError):
        ro.health()


def test_health_carries_the_backends_counters_only_when_it_gives_some():
    class Counting(Minimal):
        calls = 0

        @rollout.hookimpl
        async def generate(self, request, prompt_token_ids):
            self.calls += 1
            async for chunk in Minimal.generate(self, request, prompt_token_ids):
                yield chunk

        @rollout.hookimpl
        def stats(self):
            return {"requests": self.calls}

    assert "stats" not in Rollout(Minimal()).health()
    ro = Rollout(Counting())
    assert ro.health()["stats"] == {"requests": 0}
    ro.generate([{"prompt": "x"}, {"prompt": "y"}])
    assert ro.health()["stats"] == {"requests": 2}


def test_release_waits_for_running_requests_and_holds_new_ones_back():
    entered, leave = threading.Event(), threading.Event()
    calls = []

    class Slow(Minimal):
        unsupported = {k: v for k, v in NONE.items() if k != "release"}

        @rollout.hookimpl
        async def generate(self, request, prompt_token_ids):
            entered.set()
            while not leave.is_set():
                await asyncio.sleep(0.01)
            calls.append("generate")
            yield Chunk(0, (120,), finish_reason="length")

        @rollout.hookimpl
        def release(self, tags):
            calls.append("release")

        @rollout.hookimpl
        def resume(self, tags):
            calls.append(("resume", tags))

    ro = Rollout(Slow())
    worker = threading.Thread(target=ro.generate, args=([{"prompt": "x"}],))
    worker.start()
    assert entered.wait(10)
    releaser = threading.Thread(target=ro.release)
    releaser.start()
    releaser.join(0.2)
    assert releaser.is_alive()  # waits for the running request
    leave.set()
    worker.join(10)
    releaser.join(10)
    assert calls == ["generate", "release"]
    with pytest.raises(BackendReleasedError):
        ro.generate([{"prompt": "x"}])
    ro.resume(["kv_cache", "weights"])
    assert calls[-1] == ("resume", ("weights", "kv_cache"))  # weights first


def test_bad_tags_name_the_allowed_ones():
    class Releasable(Minimal):
        unsupported = {k: v for k, v in NONE.items() if k != "release"}

        @rollout.hookimpl
        def release(self, tags):
            pass

        @rollout.hookimpl
        def resume(self, tags):
            pass

    with pytest.raises(rollout.InvalidRequestError, match="weights, kv_cache"):
        Rollout(Releasable()).release(["gpu"])


def test_agenerate_and_stream_from_an_event_loop():
    ro = Rollout(Minimal())

    async def main():
        completion = await ro.agenerate({"prompt": "x", "sampling": {"n": 2}})
        stream = ro.stream({"prompt": "x", "sampling": {"n": 2}})
        chunks = [c async for c in stream]
        return completion, chunks, stream.completion

    completion, chunks, streamed = asyncio.run(main())
    assert [r.index for r in completion.unwrap()] == [0, 1]
    assert [(c.index, c.text, c.finish_reason) for c in chunks] == [(0, "x", "length"),
                                                                    (1, "x", "length")]
    assert [(r.token_ids, r.text) for r in streamed.results] == [((120,), "x")] * 2
    assert completion.results[0].prompt_token_ids == (ord("x"),)


def test_a_bad_request_in_a_stream_is_raised_with_its_field():
    async def main():
        async for _ in Rollout(Minimal()).stream({"prompt": "x", "sampling": {"n": 0}}):
            pass

    with pytest.raises(rollout.InvalidRequestError) as caught:
        asyncio.run(main())
    assert caught.value.field == "sampling.n"


def test_results_serialize_with_their_token_count():
    from rollout.contract import convert

    result = Result("r", 0, (1, 2, 3), "abc", "stop", 2, prompt_token_ids=(5, 6))
    data = convert.unstructure(result)
    assert data["completion_tokens"] == 3
    assert convert.structure(data, Result) == result
