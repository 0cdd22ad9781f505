"""Registering a backend checks its hooks against the specifications."""

import threading

import pytest

import rollout
from rollout import BackendContractError, BackendReleasedError, Capabilities, Result, Rollout

NONE = {c: "not in this test backend" for c in
        ("release", "update_weights", "abort", "logprobs", "seed", "chat", "images")}


class Minimal:
    """Answers every request with one token per sample; a stand-in for contract checks."""

    unsupported = NONE

    @rollout.hookimpl
    def capabilities(self):
        return Capabilities(unsupported=dict(self.unsupported))

    @rollout.hookimpl
    def generate(self, requests):
        return [[Result(r.id, i, (7,), "x", "length", 1) for i in range(r.sampling.n)]
                for r in requests]


def test_a_misspelled_hook_is_refused():
    class Typo(Minimal):
        @rollout.hookimpl
        def generat(self, requests):
            return []

    with pytest.raises(BackendContractError, match="generat"):
        Rollout(Typo())


def test_a_hook_with_an_unknown_argument_is_refused():
    class WrongArgs(Minimal):
        @rollout.hookimpl
        def abort(self, ids):
            pass

    with pytest.raises(BackendContractError, match="ids"):
        Rollout(WrongArgs())


def test_generate_is_required():
    class NoGenerate:
        @rollout.hookimpl
        def capabilities(self):
            return Capabilities()

    with pytest.raises(BackendContractError, match="generate"):
        Rollout(NoGenerate())


def test_claimed_capability_needs_its_hook():
    class Claims(Minimal):
        unsupported = {k: v for k, v in NONE.items() if k != "abort"}

    with pytest.raises(BackendContractError, match="abort"):
        Rollout(Claims())


def test_unsupported_capability_is_refused_with_its_reason():
    backend = Rollout(Minimal())
    with pytest.raises(rollout.UnsupportedError, match="not in this test backend"):
        backend.release()
    (completion,) = backend.generate([{"prompt": "x", "sampling": {"logprobs": 1}}])
    assert completion.error.field == "sampling.logprobs"


def test_wrong_result_count_is_a_contract_error():
    class Short(Minimal):
        @rollout.hookimpl
        def generate(self, requests):
            return []

    with pytest.raises(BackendContractError, match="0 entries for 1 requests"):
        Rollout(Short()).generate([{"prompt": "x"}])


def test_duplicate_ids_in_a_batch_fail_alone():
    completions = Rollout(Minimal()).generate([{"id": "a", "prompt": "x"},
                                               {"id": "a", "prompt": "y"}])
    assert completions[0].ok and completions[1].error.field == "id"


def test_release_waits_for_running_generate_and_blocks_new_ones():
    entered, leave = threading.Event(), threading.Event()
    calls = []

    class Slow(Minimal):
        unsupported = {k: v for k, v in NONE.items() if k != "release"}

        @rollout.hookimpl
        def generate(self, requests):
            entered.set()
            assert leave.wait(10)
            calls.append("generate")
            return super().generate(requests)

        @rollout.hookimpl
        def release(self, tags):
            calls.append("release")

        @rollout.hookimpl
        def resume(self, tags):
            calls.append(("resume", tags))

    backend = Rollout(Slow())
    worker = threading.Thread(target=backend.generate, args=([{"prompt": "x"}],))
    worker.start()
    assert entered.wait(10)
    releaser = threading.Thread(target=backend.release)
    releaser.start()
    releaser.join(0.2)
    assert releaser.is_alive()  # waits for the generate call
    leave.set()
    worker.join(10)
    releaser.join(10)
    assert calls == ["generate", "release"]
    with pytest.raises(BackendReleasedError):
        backend.generate([{"prompt": "x"}])
    backend.resume(["kv_cache", "weights"])
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


def test_agenerate_from_an_event_loop():
    import asyncio

    async def main():
        return await Rollout(Minimal()).agenerate([{"prompt": "x", "sampling": {"n": 2}}])

    (completion,) = asyncio.run(main())
    assert [r.index for r in completion.unwrap()] == [0, 1]


def test_results_serialize_with_their_token_count():
    from rollout.contract import convert

    result = Result("r", 0, (1, 2, 3), "abc", "stop", 4)
    data = convert.unstructure(result)
    assert data["completion_tokens"] == 3
    assert convert.structure(data, Result) == result
