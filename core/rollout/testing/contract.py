"""`BackendContract`: the tests every backend passes, against its real engine.

A subclass provides `make_backend`, a class-scoped fixture returning a callable
`make_backend(model_dir) -> Rollout`. The suite builds the tiny model itself. Capabilities
that the backend reports as unsupported are skipped with the backend's reason.

The checks that a trainer relies on through the `Sampler` protocol (generate, stream,
abort, timeouts, weight updates) run on both of its faces: the `Rollout` itself, and a
`ServedRollout` over the same backend behind `rollout serve`.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable
from pathlib import Path

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from rollout import (BackendReleasedError, Capabilities, GenerationError, InvalidRequestError,
                     Rollout, RolloutError, Sampler, UnsupportedError, WeightsDirtyError)
from rollout.kit.aio import engine_loop
from rollout.testing.adapters import lora_adapter, merged_copy
from rollout.testing.model_folders import load_weights, perturbed_copy, tiny_model_dir
from rollout.testing.probes import PROBE_PROMPTS, probe, probe_requests, probe_versions
from rollout.testing.sampling import SamplingContract
from rollout.testing.on_policy import OnPolicyContract
from rollout.testing.strategies import EXAMPLES, HYPOTHESIS, invalid_requests, requests
from rollout.testing.weight_streams import trainer_that_dies

def skip_unless(caps: Capabilities, capability: str) -> None:
    if not caps.supports(capability):
        pytest.skip(f"{capability} unsupported by this backend: {caps.unsupported[capability]}")


def wait_until(condition, timeout: float = 120.0) -> bool:
    """Block this thread until `condition()` holds (bounded), checking every millisecond."""
    import time
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


async def read_across_a_push(stream, after: int, push, began):
    """Read `stream` to its end; once `after` tokens are out, run `push` (a weight update)
    on a thread, and hold this loop until `began()` holds, so that the request cannot end
    first however late the thread runs. Returns the push's future and the stream's error
    (None if it ended well)."""
    made, update = 0, None
    try:
        async for chunk in stream:
            made += len(chunk.token_ids)
            if made >= after and update is None:
                update = asyncio.get_running_loop().run_in_executor(None, push)
                assert wait_until(began), "the update never began"
    except RolloutError as exc:
        return update, exc
    return update, None


async def stopped_beside_a_stream(sampler, request: dict, tokens: int = 5, engine=None):
    """`request` (greedy: `top_k` 1, which `n` > 1 may take) twice at once, one call
    streamed (every token handed over as it is made; one sample) and one not (which a
    backend may hand over a few tokens at a time; `n` samples), both aborted once the
    stream has `tokens`, with `engine` held meanwhile where given (one with `pause` and
    `go_on`, as vLLM's: held, it makes no more). Returns (the quiet call's Results, the
    streamed token ids): a backend that hands over what it holds when stopped gives each
    as many tokens, give or take a step between their starts."""
    quiet = asyncio.ensure_future(sampler.agenerate({**request, "id": "quiet"}))
    enough = asyncio.get_running_loop().create_future()
    one = {**request, "id": "streamed", "sampling": {**request["sampling"], "n": 1}}

    async def read():
        made = []
        async for chunk in sampler.stream(one):
            made += chunk.token_ids
            if len(made) >= tokens and not enough.done():
                enough.set_result(None)
        return made

    streamed = asyncio.ensure_future(read())
    await asyncio.wait_for(asyncio.shield(enough), 120)
    if engine is not None:
        await engine.pause()
    try:
        sampler.abort(["quiet", "streamed"])
        return (await asyncio.wait_for(quiet, 60)).unwrap(), \
            await asyncio.wait_for(streamed, 60)
    finally:
        if engine is not None:
            await engine.go_on()


def check_it_kept_what_was_held_back(quiet: list, streamed: list[int], tokens: int = 5) -> None:
    """What `stopped_beside_a_stream` returns, from a backend that hands over what it
    holds when stopped: each sample of the quiet call was aborted with as many tokens as
    the stream (give or take the step between their starts), the same ones, each with its
    logprob."""
    assert len(streamed) >= tokens
    for result in quiet:
        assert result.finish_reason == "abort"
        assert abs(len(result.token_ids) - len(streamed)) <= 1, \
            (len(result.token_ids), len(streamed))
        shorter = min(len(result.token_ids), len(streamed))
        assert list(result.token_ids[:shorter]) == streamed[:shorter]
        assert len(result.logprobs) == len(result.token_ids)


def across_a_keep(sampler: Sampler, rollout: Rollout, request: dict, weights: dict,
                  version: int, after: int = 1, pause: str = "keep"):
    """`request` streamed through `sampler`; once `after` tokens are out, `weights` are
    pushed through it as `version` with `pause` ("keep" or "keep_kv"). Returns the
    request's Completion. `rollout` is the backend behind `sampler`, watched for the update
    to begin."""

    async def run():  # on the engine loop: see on_engine_loop
        stream = sampler.stream(request)
        # Begun: the update holds running requests, or ("keep_kv", which waits for none)
        # it may be in and done before a look sees it run.
        update, error = await read_across_a_push(
            stream, after,
            lambda: sampler.update_weights(weights.items(), version=version, pause=pause),
            lambda: rollout.updating or rollout.weight_version == version)
        if error is not None:
            raise error
        await asyncio.wait_for(update, 120)
        return stream.completion

    return on_engine_loop(run())


def on_engine_loop(coro):
    """Run a test's coroutine on the engine loop, where the engines' outputs are read, and
    wait for it. A check that races an engine (is the request still running?) must run
    there: while many outputs pour in, the loop's thread can keep this process's other
    threads from running for as long as they last."""
    return engine_loop().run(coro, 300, "the test")


@attrs.define
class Harness:
    rollout: Rollout
    model_dir: object
    other_dir: object
    vocab_size: int
    max_model_len: int
    baseline: tuple  # probe() with the model's own weights
    reference: tuple  # probe() of a backend freshly loaded with the other weights
    make_backend: Callable
    reference_key: str | None

    @property
    def caps(self) -> Capabilities:
        return self.rollout.capabilities

    @property
    def adapted(self) -> tuple:
        """probe() of a backend freshly loaded with ADAPTER merged into the model's weights
        (made once per reference key, when an adapter test first asks)."""
        adapted = _ADAPTED.get(self.reference_key)
        if adapted is None:
            merged = Path(self.model_dir).parent / "tiny-0-merged-adapter"
            if not merged.exists():
                merged_copy(self.model_dir, merged, *lora_adapter(self.model_dir, **ADAPTER))
            with self.make_backend(merged) as fresh:
                adapted = probe(fresh)
            if self.reference_key is not None:
                _ADAPTED[self.reference_key] = adapted
        return adapted


def check_completions(batch: list[dict], completions, caps: Capabilities) -> None:
    assert len(completions) == len(batch)
    for request, completion in zip(batch, completions):
        assert completion.request_id == request["id"]
        assert completion.ok, completion.error
        sampling = request["sampling"]
        assert [r.index for r in completion.results] == list(range(sampling["n"]))
        for r in completion.results:
            assert r.request_id == request["id"]
            assert r.prompt_tokens > 0
            assert 0 < r.completion_tokens <= sampling["max_tokens"]
            assert r.finish_reason in ("stop", "length")
            if r.finish_reason == "length":
                assert r.completion_tokens == sampling["max_tokens"]
            if r.completion_tokens < sampling["max_tokens"]:
                assert r.finish_reason == "stop"
            # (Before min_tokens, a stop string may show in the text without ending it.)
            if not sampling.get("include_stop_str_in_output") and not sampling.get("min_tokens"):
                for stop in sampling["stop"]:
                    assert stop not in r.text
            if sampling["logprobs"] is not None:
                assert len(r.logprobs) == r.completion_tokens
                assert all(lp <= 1e-4 for lp in r.logprobs)
            if sampling["logprobs"]:
                assert len(r.top_logprobs) == r.completion_tokens
                for top in r.top_logprobs:
                    assert len(top) == sampling["logprobs"]
                    values = [t.logprob for t in top]
                    assert values == sorted(values, reverse=True)


# The reference probes already made, by `BackendContract.reference_key`.
_REFERENCES: dict[str, tuple] = {}
_ADAPTED: dict[str, tuple] = {}  # the same for the adapter merged (Harness.adapted)
ADAPTER = {"rank": 8, "seed": 1}  # the contract's LoRA adapter (rollout.testing.adapters)


class BackendContract(SamplingContract, OnPolicyContract):
    """Subclass and override `make_backend`; every test here then runs on your backend.

    `reference_key`: classes that run one engine with one configuration in several modes
    (in process, a server) may share the reference, the greedy tokens of a fresh load with
    other weights, which is the same in every mode; give them the same key, and the fresh
    load runs once per test session instead of once per class."""

    reference_key: str | None = None

    @pytest.fixture(scope="class")
    @classmethod
    def make_backend(cls):
        raise NotImplementedError("override make_backend: return a callable model_dir -> Rollout")

    @pytest.fixture(scope="class")
    @classmethod
    def harness(cls, make_backend, tmp_path_factory):
        root = tmp_path_factory.getbasetemp() / "rollout-models"
        model_dir = tiny_model_dir(root)
        other_dir = perturbed_copy(model_dir, root / "tiny-0-other-weights")
        config = json.loads((model_dir / "config.json").read_text())
        reference = _REFERENCES.get(cls.reference_key)
        if reference is None:
            # The fresh load with other weights runs first and alone: one engine at a time.
            with make_backend(other_dir) as fresh:
                reference = probe(fresh)
            if cls.reference_key is not None:
                _REFERENCES[cls.reference_key] = reference
        backend = make_backend(model_dir)
        try:
            yield Harness(backend, model_dir, other_dir, config["vocab_size"],
                          config["max_position_embeddings"], probe(backend), reference,
                          make_backend, cls.reference_key)
        finally:
            backend.close()

    @pytest.fixture(scope="class")
    @classmethod
    def served(cls, harness):
        """The same backend behind `rollout serve` (a server thread in this process), as a
        trainer in another process holds it."""
        from rollout.apps.serving.app import ServerThread
        from rollout.service.served import ServedRollout
        from rollout.testing.server_contract import BorrowedService

        with ServerThread(BorrowedService(harness.rollout, "contract")) as server, \
                ServedRollout.connect(server.url) as sampler:
            yield sampler

    @pytest.fixture(params=["in_process", "served"])
    def sampler(self, request, harness) -> Sampler:
        """Each face of the `Sampler` protocol over the backend."""
        return harness.rollout if request.param == "in_process" else \
            request.getfixturevalue("served")

    @pytest.fixture(autouse=True)
    def _restored(self, request):
        """Each test leaves the backend resumed with its original weights."""
        yield
        if "harness" in request.fixturenames:
            h = request.getfixturevalue("harness")
            if h.rollout.released:
                h.rollout.resume()

    # --- generation ---------------------------------------------------------------------

    def test_both_faces_are_samplers_with_the_same_greedy_output(self, harness, sampler):
        assert isinstance(sampler, Sampler)
        assert probe(sampler) == harness.baseline
        assert {"running", "weight_version"} <= set(sampler.health())

    def test_capabilities_are_declared(self, harness):
        caps = harness.caps
        assert isinstance(caps, Capabilities)
        assert all(reason.strip() for reason in caps.unsupported.values())

    @HYPOTHESIS
    @given(data=st.data())
    def test_batch_gets_one_result_per_request_and_sample(self, harness, data):
        chat = harness.caps.supports("chat")
        batch = data.draw(st.lists(requests(harness.vocab_size, chat=chat), min_size=1,
                                   max_size=4))
        for request in batch:
            if not harness.caps.supports("seed"):
                request["sampling"]["seed"] = None
            if not harness.caps.supports("logprobs"):
                request["sampling"]["logprobs"] = None
        check_completions(batch, harness.rollout.generate(batch), harness.caps)

    @HYPOTHESIS
    @given(data=st.data())
    def test_greedy_output_is_identical_across_calls(self, harness, data):
        batch = data.draw(st.lists(requests(harness.vocab_size, chat=False), min_size=1,
                                   max_size=3))
        for request in batch:
            request["sampling"].update(temperature=0.0, n=1, seed=None)
        first = harness.rollout.generate(batch)
        second = harness.rollout.generate(batch)
        assert [[r.token_ids for r in c.unwrap()] for c in first] == [
            [r.token_ids for r in c.unwrap()] for c in second]
        assert [c.results[0].text for c in first] == [c.results[0].text for c in second]

    def test_same_seed_gives_same_samples(self, harness):
        skip_unless(harness.caps, "seed")
        request = {"id": "seeded", "prompt": "the ka lo",
                   "sampling": {"temperature": 1.0, "n": 2, "seed": 1234, "max_tokens": 16}}
        first, second = (harness.rollout.generate([request])[0].unwrap() for _ in range(2))
        assert [r.token_ids for r in first] == [r.token_ids for r in second]
        assert first[0].token_ids != first[1].token_ids  # two samples, not one copied

    def test_stop_string_ends_text_and_is_not_in_it(self, harness):
        for i, prompt in enumerate(PROBE_PROMPTS):
            base = {"id": f"stop-{i}", "prompt": prompt,
                    "sampling": {"temperature": 0.0, "max_tokens": 24, "ignore_eos": True}}
            full = harness.rollout.generate([base])[0].unwrap()[0]
            text = full.text
            middle = len(text) // 2
            stop = text[middle : middle + 2]
            if len(stop) < 2 or "\ufffd" in stop:
                continue
            request = {**base, "sampling": {**base["sampling"], "stop": [stop]}}
            cut = harness.rollout.generate([request])[0].unwrap()[0]
            assert cut.finish_reason == "stop"
            assert cut.text == text[: text.find(stop)]
            assert stop not in cut.text
            assert full.token_ids[: cut.completion_tokens] == cut.token_ids
            return
        pytest.fail("no probe output had a clean two-character stop string")

    def test_cached_tokens_are_the_engines_word(self, harness):
        request = {"prompt": "the ka lo " * 40, "sampling": {"temperature": 0.0,
                                                            "max_tokens": 4}}
        [first] = harness.rollout.generate([request])[0].unwrap()
        [again] = harness.rollout.generate([request])[0].unwrap()
        if first.cached_tokens is None and again.cached_tokens is None:
            pytest.skip("this backend's engine reports no prefix-cache hits")
        # The same prompt again is found in the prefix cache (all but what the engine
        # recomputes), and never more than the prompt.
        assert 0 <= first.cached_tokens <= first.prompt_tokens
        assert 0 < again.cached_tokens <= again.prompt_tokens

    def test_logprobs_match_greedy_choice(self, harness):
        skip_unless(harness.caps, "logprobs")
        request = {"id": "lp", "prompt": "the ka lo",
                   "sampling": {"temperature": 0.0, "max_tokens": 10, "logprobs": 3}}
        result = harness.rollout.generate([request])[0].unwrap()[0]
        assert len(result.logprobs) == len(result.top_logprobs) == result.completion_tokens
        for token, logprob, top in zip(result.token_ids, result.logprobs, result.top_logprobs):
            assert top[0].token_id == token  # greedy picks the most likely token
            assert abs(top[0].logprob - logprob) < 1e-4

    def test_prompt_logprobs_score_given_tokens_as_a_forward_pass_does(
            self, harness, sampler, reference):
        """Scoring given sequences (reference and recomputed logprobs): each prompt token's
        logprob and the top k equal a plain transformers forward pass in float32, through
        both faces, also when the prompt is in the prefix cache, for every sample."""
        skip_unless(harness.caps, "prompt_logprobs")
        import random

        import torch

        rng = random.Random(5)
        sequences = [reference.prompt + [rng.randrange(reference.vocab) for _ in range(40)],
                     [rng.randrange(reference.vocab) for _ in range(9)]]
        asked = [{"prompt_token_ids": ids, "sampling": {
            "temperature": 1.0, "n": 2, "max_tokens": 1, "prompt_logprobs": 3}}
            for ids in sequences]
        asked.append({"prompt_token_ids": sequences[1], "sampling": {
            "max_tokens": 1, "prompt_logprobs": 0}})
        first = sampler.generate(asked)
        again = sampler.generate(asked)  # now from the prefix cache, where the engine has one
        for ids, completion, repeated in zip(sequences, first, again):
            expected = torch.log_softmax(reference.logits(ids), dim=-1)[:-1]
            top_values, top_ids = expected.topk(3, dim=-1)
            for result in completion.unwrap() + repeated.unwrap():
                assert result.prompt_token_ids == tuple(ids)
                assert result.prompt_logprobs[0] is None and result.prompt_top_logprobs[0] == ()
                assert len(result.prompt_logprobs) == len(result.prompt_top_logprobs) == len(ids)
                got = torch.tensor(result.prompt_logprobs[1:], dtype=torch.float64)
                want = expected.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].double()
                assert (got - want).abs().max().item() < 1e-4
                for position, tops in enumerate(result.prompt_top_logprobs[1:]):
                    assert [t.token_id for t in tops] == top_ids[position].tolist()
                    assert max(abs(t.logprob - v) for t, v in zip(
                        tops, top_values[position].tolist())) < 1e-4
        [alone] = first[2].unwrap()
        assert alone.prompt_top_logprobs is None
        assert alone.prompt_logprobs[0] is None
        assert alone.prompt_logprobs[1:] == pytest.approx(
            first[1].results[0].prompt_logprobs[1:], abs=1e-4)
        [plain] = sampler.generate([{"prompt_token_ids": sequences[1]}])[0].unwrap()
        assert plain.prompt_logprobs is None and plain.prompt_top_logprobs is None

    def test_chat_messages_use_the_chat_template(self, harness):
        skip_unless(harness.caps, "chat")
        from transformers import AutoTokenizer

        messages = [{"role": "system", "content": "be brief"},
                    {"role": "user", "content": "the ka lo"}]
        tokenizer = AutoTokenizer.from_pretrained(str(harness.model_dir))
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False).input_ids
        sampling = {"temperature": 0.0, "max_tokens": 12}
        chat, tokens = harness.rollout.generate([
            {"id": "chat", "messages": messages, "sampling": sampling},
            {"id": "ids", "prompt_token_ids": ids, "sampling": sampling}])
        assert chat.unwrap()[0].prompt_tokens == len(ids)
        assert chat.unwrap()[0].token_ids == tokens.unwrap()[0].token_ids

    @HYPOTHESIS
    @given(data=st.data())
    def test_invalid_request_fails_alone(self, harness, sampler, data):
        bad, field = data.draw(invalid_requests(harness.vocab_size, harness.max_model_len))
        for capability in ("seed", "logprobs"):  # else the capability check fails it first
            if not harness.caps.supports(capability) and field != f"sampling.{capability}":
                bad["sampling"] = {**bad["sampling"], capability: None}
        good = [data.draw(requests(harness.vocab_size, chat=harness.caps.supports("chat")))
                for _ in range(2)]
        for request in good:
            request["sampling"].update(seed=None, logprobs=None)
        completions = sampler.generate([good[0], bad, good[1]])
        error = completions[1].error
        assert isinstance(error, InvalidRequestError), error
        assert error.field.startswith(field), (error.field, field)
        check_completions(good, [completions[0], completions[2]], harness.caps)

    def test_generation_stops_at_the_context_length(self, harness):
        room = 8  # engines may keep a few tokens of the context for themselves
        request = {"id": "edge", "prompt_token_ids": [5] * (harness.max_model_len - room),
                   "sampling": {"temperature": 0.0, "max_tokens": 50, "ignore_eos": True}}
        result = harness.rollout.generate([request])[0].unwrap()[0]
        assert result.finish_reason == "length"
        assert 0 < result.completion_tokens <= room

    # --- abort --------------------------------------------------------------------------

    def _long_request(self, harness, rid: str) -> dict:
        # Work that outlasts a test process starved for a while: on a loaded 2-core
        # machine, ours was seen waiting 10 s for a CPU while a vLLM server decoded 8 of
        # these with n=1 in 6 s (n=8: 17 s).
        return {"id": rid, "prompt": "the ka lo",
                "sampling": {"temperature": 1.0, "ignore_eos": True, "n": 8,
                             "max_tokens": min(4000, harness.max_model_len - 16)}}

    def test_abort_returns_partial_output_and_spares_the_rest(self, harness, sampler):
        long = self._long_request(harness, "long")
        short = {"id": "short", "prompt": "def x",
                 "sampling": {"temperature": 0.0, "max_tokens": 4, "ignore_eos": True}}

        async def run():  # on the engine loop: see on_engine_loop
            spared = asyncio.ensure_future(sampler.agenerate(short))
            stream = sampler.stream(long)
            async for chunk in stream:
                if chunk.token_ids:
                    sampler.abort(["long"])
            return stream.completion, await spared

        aborted, spared = on_engine_loop(run())
        ends = [(r.finish_reason, r.completion_tokens) for r in aborted.unwrap()]
        for result in aborted.unwrap():
            assert result.finish_reason == "abort", (ends, aborted.timing)
            assert result.completion_tokens < long["sampling"]["max_tokens"], ends
        assert spared.unwrap()[0].finish_reason == "length"
        assert spared.unwrap()[0].completion_tokens == 4

    def test_a_stream_yields_tokens_before_its_end_and_joins_to_the_result(self, harness,
                                                                            sampler):
        request = {"prompt": "the ka lo", "sampling": {
            "temperature": 0.0, "max_tokens": 48, "ignore_eos": True, "logprobs": 2}}

        async def run():
            stream = sampler.stream(request)
            chunks = [chunk async for chunk in stream]
            return chunks, stream.completion, await sampler.agenerate(request)

        chunks, completion, again = asyncio.run(run())
        with_tokens = [c for c in chunks if c.token_ids]
        assert len(with_tokens) >= 2, "the whole sample came in one piece"
        assert chunks[-1].finish_reason == "length"
        assert all(c.finish_reason is None for c in chunks[:-1])
        result = completion.unwrap()[0]
        assert tuple(t for c in chunks for t in c.token_ids) == result.token_ids
        assert "".join(c.text for c in chunks) == result.text
        assert tuple(x for c in chunks for x in c.logprobs) == result.logprobs
        assert tuple(x for c in chunks for x in c.top_logprobs) == result.top_logprobs
        assert result.token_ids == again.unwrap()[0].token_ids
        assert result.prompt_token_ids == again.unwrap()[0].prompt_token_ids
        assert len(result.prompt_token_ids) == result.prompt_tokens

    def test_a_thousand_concurrent_requests_take_no_thread_each(self, harness):
        requests = [{"prompt": PROBE_PROMPTS[i % len(PROBE_PROMPTS)], "sampling": {
            "temperature": 0.0, "max_tokens": 3, "ignore_eos": True}} for i in range(1000)]
        before = threading.active_count()
        most = [before]

        async def run():
            tasks = [asyncio.ensure_future(harness.rollout.agenerate(r)) for r in requests]
            while not all(t.done() for t in tasks):
                most[0] = max(most[0], threading.active_count())
                await asyncio.wait(tasks, timeout=0.05)
            return [t.result() for t in tasks]

        completions = asyncio.run(run())
        assert all(c.unwrap()[0].completion_tokens == 3 for c in completions)
        assert most[0] <= before + 8, f"{most[0] - before} threads more for 1000 requests"

    def test_one_slow_request_does_not_delay_99_fast_ones(self, harness):
        slow = self._long_request(harness, "slow-one")
        fast = [{"prompt": "def x", "sampling": {"temperature": 0.0, "max_tokens": 2,
                                                 "ignore_eos": True}} for _ in range(99)]

        async def run():  # on the engine loop: see on_engine_loop
            slow_task = asyncio.ensure_future(harness.rollout.agenerate(slow, timeout=300))
            done = await asyncio.gather(*(harness.rollout.agenerate(r) for r in fast))
            slow_running = not slow_task.done()
            harness.rollout.abort([slow["id"]])
            return done, slow_running, await slow_task

        done, slow_running, slow_done = on_engine_loop(run())
        assert all(c.unwrap()[0].completion_tokens == 2 for c in done)
        assert slow_running, "the fast requests waited for the slow one"
        # Each sample was stopped, or had reached its length first.
        limit = slow["sampling"]["max_tokens"]
        assert all(r.finish_reason == "abort" or r.completion_tokens == limit
                   for r in slow_done.unwrap()), [(r.finish_reason, r.completion_tokens)
                                                  for r in slow_done.unwrap()]

    def test_an_abort_right_after_the_call_still_aborts(self, harness, sampler):
        """The abort comes before the engine has registered the request (most likely
        before the core has even started it; served, before the server has it)."""
        request = self._long_request(harness, "early")

        async def run():
            task = asyncio.ensure_future(sampler.agenerate(request))
            await asyncio.sleep(0)  # the call has been made, nothing more
            sampler.abort(["early"])
            return await asyncio.wait_for(task, 120)

        for result in asyncio.run(run()).unwrap():
            assert result.finish_reason == "abort", result
            assert result.completion_tokens < request["sampling"]["max_tokens"]
        # and a zero timeout fires before any engine can have started
        for completion in sampler.generate([request], timeout=0.0):
            reasons = {r.finish_reason for r in completion.unwrap()}
            assert reasons == {"abort"}, reasons

    def test_timeout_aborts_what_is_still_running(self, harness, sampler):
        # A fast engine makes these 64 x 2000 tokens in seconds: stop them well before.
        batch = [self._long_request(harness, f"slow-{i}") for i in range(8)]
        for completion in sampler.generate(batch, timeout=0.1):
            for result in completion.unwrap():
                assert result.finish_reason == "abort", (
                    result.request_id, result.index, result.finish_reason,
                    result.completion_tokens)
                assert result.completion_tokens < batch[0]["sampling"]["max_tokens"]

    # --- LoRA adapters ------------------------------------------------------------------

    def test_an_adapter_samples_what_the_merged_model_does_beside_the_base(self, harness):
        """Loaded from tensors, an adapter's greedy tokens equal the merged model's, in
        one batch with base rows (which keep theirs); results name adapter and version.
        The backend keeps a copy: the tensors given (a trainer's parameters, which its
        optimizer then changes in place) changing after the load change nothing."""
        skip_unless(harness.caps, "adapters")
        ro = harness.rollout
        tensors, config = lora_adapter(harness.model_dir, **ADAPTER)
        ro.load_adapter("contract", tensors.items(), config, version=5)
        for tensor in tensors.values():
            tensor.zero_()
        try:
            assert ro.adapters == {"contract": 5}
            assert probe(ro, "contract") == harness.adapted != harness.baseline
            done = ro.generate(probe_requests() + probe_requests("contract"))
            results = [c.unwrap()[0] for c in done]
            half = len(PROBE_PROMPTS)
            assert tuple(r.token_ids for r in results[:half]) == harness.baseline
            assert tuple(r.token_ids for r in results[half:]) == harness.adapted
            assert {(r.adapter, r.adapter_version) for r in results} == {
                (None, None), ("contract", 5)}
        finally:
            ro.unload_adapter("contract")
        assert probe(ro) == harness.baseline

    def test_adapter_errors_name_what_is_wrong_and_change_nothing(self, harness):
        skip_unless(harness.caps, "adapters")
        ro = harness.rollout
        tensors, config = lora_adapter(harness.model_dir, **ADAPTER)
        ro.load_adapter("contract", tensors.items(), config, version=1)
        try:
            unknown, fine = ro.generate([{"prompt": "x", "adapter": "nope"},
                                         {"prompt": "x", "adapter": "contract"}])
            assert unknown.error.field == "adapter" and unknown.error.allowed == "contract"
            assert fine.ok
            wrong = {k: v[:, :-1] if "lora_A" in k else v for k, v in tensors.items()}
            with pytest.raises(InvalidRequestError):  # shapes that do not fit the model
                ro.load_adapter("contract", wrong.items(), config, version=2)
            with pytest.raises(InvalidRequestError):  # a module the model lacks
                ro.load_adapter("contract", {k.replace("q_proj", "nope_proj"): v
                                             for k, v in tensors.items()}.items(), config)
            # The adapter before the failed loads still serves, under its version.
            done = ro.generate(probe_requests("contract"))
            assert tuple(c.unwrap()[0].token_ids for c in done) == harness.adapted
            assert {c.unwrap()[0].adapter_version for c in done} == {1}
        finally:
            ro.unload_adapter("contract")
        (gone,) = ro.generate([{"prompt": "x", "adapter": "contract"}])
        assert gone.error.field == "adapter"
        with pytest.raises(InvalidRequestError):
            ro.unload_adapter("contract")

    def test_replacing_an_adapter_mid_run_follows_the_pause(self, harness):
        """pause="wait": a running request of the adapter finishes under the version it
        began with, and the load waits for it; pause="abort": it stops, partial, under
        that version. Requests after the load sample the new version."""
        skip_unless(harness.caps, "adapters")
        rollout = harness.rollout
        tensors, config = lora_adapter(harness.model_dir, **ADAPTER)
        rollout.load_adapter("mid", tensors.items(), config, version=1)
        stopped = threading.Event()

        def abort_and_tell(request_ids=None):
            type(rollout).abort(rollout, request_ids)
            stopped.set()

        async def across_a_load(request, pause, version):  # on the engine loop
            stream, load = rollout.stream(request), None
            async for chunk in stream:
                if chunk.token_ids and load is None:
                    load = asyncio.get_running_loop().run_in_executor(None, lambda: (
                        rollout.load_adapter("mid", tensors.items(), config,
                                             version=version, pause=pause)))
                    if pause == "abort":  # the loop holds still until the load stopped it
                        assert stopped.wait(120), "the load never stopped the request"
            await asyncio.wait_for(load, 120)
            return stream.completion.unwrap()

        rollout.abort = abort_and_tell  # the load's own call to abort tells the loop
        try:
            waited = {"id": "adapter-waited", "prompt": "the ka lo", "adapter": "mid",
                      "sampling": {"temperature": 1.0, "ignore_eos": True, "max_tokens": 64}}
            [done] = on_engine_loop(across_a_load(waited, "wait", 2))
            assert (done.finish_reason, done.completion_tokens) == ("length", 64)
            assert done.adapter_version == 1
            cut = {**self._long_request(harness, "adapter-cut"), "adapter": "mid"}
            for result in on_engine_loop(across_a_load(cut, "abort", 3)):
                assert result.finish_reason == "abort" and result.adapter_version == 2
            after = [c.unwrap()[0] for c in rollout.generate(probe_requests("mid"))]
            assert {r.adapter_version for r in after} == {3}
            with pytest.raises(InvalidRequestError, match="pause"):
                rollout.load_adapter("mid", tensors.items(), config, pause="keep")
        finally:
            del rollout.abort
            rollout.unload_adapter("mid")

    def test_a_backend_without_adapters_refuses_them_by_name(self, harness):
        if harness.caps.supports("adapters"):
            pytest.skip("this backend takes adapters")
        (refused,) = harness.rollout.generate([{"prompt": "x", "adapter": "a"}])
        assert refused.error.field == "adapter"
        assert harness.caps.unsupported["adapters"] in str(refused.error)
        with pytest.raises(UnsupportedError):
            harness.rollout.load_adapter("a", [], {"r": 8})

    # --- weights and memory -------------------------------------------------------------

    def test_update_weights_equals_a_fresh_load(self, harness, sampler):
        skip_unless(harness.caps, "update_weights")
        assert harness.reference != harness.baseline, "the other weights change nothing"
        try:
            sampler.update_weights(load_weights(harness.other_dir).items())
            assert probe(sampler) == harness.reference
        finally:
            sampler.update_weights(load_weights(harness.model_dir).items(),
                                   bucket_bytes=4096)
        assert probe(sampler) == harness.baseline

    def test_updates_stamp_results_with_their_version_and_flush_the_prefix_cache(
            self, harness):
        skip_unless(harness.caps, "update_weights")
        request = {"prompt": "the ka lo " * 40, "sampling": {"temperature": 0.0,
                                                            "max_tokens": 4}}
        harness.rollout.generate([request])  # now in the prefix cache, where there is one
        try:
            harness.rollout.update_weights(load_weights(harness.model_dir).items(), version=7)
            assert harness.rollout.weight_version == 7
            [after] = harness.rollout.generate([request])[0].unwrap()
            assert after.weight_version == 7
            # KV computed under older weights is never read under newer ones.
            assert after.cached_tokens in (None, 0), "the prefix cache outlived an update"
        finally:
            harness.rollout.update_weights(load_weights(harness.model_dir).items())
        assert harness.rollout.generate([request])[0].unwrap()[0].weight_version is None

    def test_a_failed_update_leaves_the_weights_dirty_until_a_full_one(self, harness):
        skip_unless(harness.caps, "update_weights")
        other = load_weights(harness.other_dir)
        with pytest.raises(ConnectionResetError):
            harness.rollout.update_weights(trainer_that_dies(other), bucket_bytes=4096,
                                           version=1)
        with pytest.raises(WeightsDirtyError, match="failed midway"):
            harness.rollout.generate(probe_requests())
        assert harness.rollout.weight_version is None  # the old version is not claimed
        harness.rollout.update_weights(load_weights(harness.model_dir).items())
        assert probe(harness.rollout) == harness.baseline

    def test_an_update_that_aborts_returns_running_requests_partial(self, harness):
        skip_unless(harness.caps, "update_weights")
        rollout = harness.rollout
        request = self._long_request(harness, "cut-by-update")
        weights = load_weights(harness.model_dir)
        stopped = threading.Event()

        def abort_and_tell(request_ids=None):
            type(rollout).abort(rollout, request_ids)
            stopped.set()

        async def run():  # on the engine loop: see on_engine_loop
            stream = rollout.stream(request)
            update = None
            async for chunk in stream:
                if chunk.token_ids and update is None:
                    update = asyncio.get_running_loop().run_in_executor(None, lambda: (
                        rollout.update_weights(weights.items(), version=3, pause="abort")))
                    # The loop holds still until the update has stopped the request: its
                    # last output cannot be read first, however late the update's thread runs.
                    assert stopped.wait(120), "the update never stopped running requests"
            await asyncio.wait_for(update, 120)
            return stream.completion

        rollout.abort = abort_and_tell  # the update's own call to abort tells the loop
        try:
            for result in on_engine_loop(run()).unwrap():
                assert result.finish_reason == "abort"
                assert result.completion_tokens < request["sampling"]["max_tokens"]
                assert result.weight_version is None  # made under the weights before
            assert probe_versions(rollout) == {3}
        finally:
            del rollout.abort
            rollout.update_weights(weights.items())
        with pytest.raises(InvalidRequestError, match="pause"):
            rollout.update_weights(weights.items(), pause="later")

    # --- across weight updates: keep, spans, continue_from --------------------------------

    def _greedy_long(self, harness, rid: str) -> dict:
        # Long enough to outlast a starved test process (see _long_request); greedy, so
        # each side of an update can be replayed.
        return {"id": rid, "prompt": "the ka lo",
                "sampling": {"temperature": 0.0, "ignore_eos": True, "logprobs": 0,
                             "max_tokens": min(4000, harness.max_model_len - 16)}}

    # The edge of a hold or an abort lands after this many tokens, not the first: each
    # side's replay then checks decode steps against a prefill of the same tokens.
    EDGE_AFTER = 16

    def _replays(self, sampler, result, start: int, end: int) -> None:
        """Tokens [start, end) of `result` are what the weights loaded now make, greedily,
        from the prompt and the tokens before `start`, with the same logprobs."""
        end = min(end, result.completion_tokens)
        again = self._continued(sampler, result, start, end - start)
        assert again.token_ids == result.token_ids[start:end], (start, end)
        assert again.logprobs == pytest.approx(result.logprobs[start:end], abs=1e-3)

    @staticmethod
    def _continued(sampler, result, start: int, tokens: int = 8):
        """`tokens` greedy tokens from the prompt and the first `start` of `result`."""
        [again] = sampler.generate([{
            "prompt_token_ids": list(result.prompt_token_ids) + list(result.token_ids[:start]),
            "sampling": {"temperature": 0.0, "ignore_eos": True, "logprobs": 0,
                         "max_tokens": tokens}}])[0].unwrap()
        return again

    def _pushed_midway(self, harness, sampler, version: int, pause: str):
        """A long greedy request across a push of the other weights as `version` with
        `pause`: (its result, the edge), checked whole and labelled on both sides."""
        request = self._greedy_long(harness, pause)
        [kept] = across_a_keep(sampler, harness.rollout, request,
                               load_weights(harness.other_dir), version, self.EDGE_AFTER,
                               pause).unwrap()
        assert kept.finish_reason == "length"  # nothing lost: it ran to its end
        assert kept.completion_tokens == request["sampling"]["max_tokens"]
        before, after = kept.weight_versions
        assert (before.version, after.version, kept.weight_version) == (None, version, version)
        edge = before.end
        assert self.EDGE_AFTER <= edge < kept.completion_tokens
        return kept, edge

    def test_keep_goes_on_under_the_new_weights_with_exact_spans(self, harness, sampler):
        skip_unless(harness.caps, "update_weights")
        assert harness.caps.keep in ("continue",)
        try:
            kept, edge = self._pushed_midway(harness, sampler, 1, "keep")
            self._replays(sampler, kept, edge, edge + 8)  # after the edge: the new weights
        finally:
            sampler.update_weights(load_weights(harness.model_dir).items())
        self._replays(sampler, kept, max(0, edge - 8), edge)  # before it: the old ones

    def test_keep_kv_changes_the_weights_between_two_steps_of_a_running_request(
            self, harness, sampler):
        """The request stays in the engine: the tokens before the edge are the old
        weights', those after it the new weights' over the old ones' KV cache (so not the
        old weights' continuation), each labelled with the weights that made it. A request
        that comes after the update is the new weights' alone, even from a prefix the
        old ones cached."""
        skip_unless(harness.caps, "keep_kv")
        try:
            kept, edge = self._pushed_midway(harness, sampler, 2, "keep_kv")
            after = self._continued(sampler, kept, edge)
        finally:
            sampler.update_weights(load_weights(harness.model_dir).items())
        self._replays(sampler, kept, max(0, edge - 8), edge)  # before it: the old ones
        old = self._continued(sampler, kept, edge)
        assert old.logprobs != pytest.approx(kept.logprobs[edge:edge + 8], abs=1e-3)
        sampler.update_weights(load_weights(harness.other_dir).items(), version=3)
        try:
            fresh = self._continued(sampler, kept, edge)  # the new weights, nothing cached
        finally:
            sampler.update_weights(load_weights(harness.model_dir).items())
        assert after.token_ids == fresh.token_ids
        assert after.logprobs == pytest.approx(fresh.logprobs, abs=1e-3)

    def test_a_keep_kv_update_that_fails_midway_fails_the_requests_beside_it(
            self, harness, sampler):
        """Their weights are half new: each gets a typed error, and the next full update
        brings the backend back."""
        skip_unless(harness.caps, "keep_kv")
        request = self._greedy_long(harness, "beside a failure")

        async def run():
            update, error = await read_across_a_push(
                sampler.stream(request), self.EDGE_AFTER,
                lambda: sampler.update_weights(
                    trainer_that_dies(load_weights(harness.other_dir)), version=5,
                    pause="keep_kv", bucket_bytes=4096),
                lambda: harness.rollout.updating or harness.rollout.weights_dirty)
            assert isinstance(error, GenerationError), error
            with pytest.raises(ConnectionResetError):
                await asyncio.wait_for(update, 120)

        try:
            on_engine_loop(run())
            # (Served, the trainer's error reaches the client before the server's update
            # has failed all the way.)
            assert wait_until(lambda: harness.rollout.weights_dirty)
        finally:
            sampler.update_weights(load_weights(harness.model_dir).items())
        assert probe(harness.rollout) == harness.baseline

    def test_keep_kv_is_refused_where_the_backend_does_not_offer_it(self, harness,
                                                                      sampler):
        skip_unless(harness.caps, "update_weights")
        if harness.caps.supports("keep_kv"):
            pytest.skip("the backend offers keep_kv")
        with pytest.raises(UnsupportedError, match="keep_kv"):
            sampler.update_weights(load_weights(harness.model_dir).items(), pause="keep_kv")
        assert probe(harness.rollout) == harness.baseline  # nothing changed

    def test_an_aborted_sample_continues_from_its_tokens_under_a_new_version(
            self, harness, sampler):
        skip_unless(harness.caps, "update_weights")
        request = self._greedy_long(harness, "partial")

        async def run():  # on the engine loop: see on_engine_loop
            stream, made = sampler.stream(request), 0
            async for chunk in stream:
                made += len(chunk.token_ids)
                if made >= self.EDGE_AFTER:
                    sampler.abort([request["id"]])
            return stream.completion

        [partial] = on_engine_loop(run()).unwrap()
        assert partial.finish_reason == "abort"
        assert partial.completion_tokens >= self.EDGE_AFTER
        try:
            sampler.update_weights(load_weights(harness.other_dir).items(), version=5)
            going_on = {**request, "sampling": {**request["sampling"], "max_tokens":
                                                partial.completion_tokens + 8}}
            [whole] = sampler.generate([{**going_on, "continue_from": partial}])[0].unwrap()
            edge = partial.completion_tokens
            assert whole.token_ids[:edge] == partial.token_ids
            assert whole.logprobs[:edge] == partial.logprobs
            assert [(x.version, x.start, x.end) for x in whole.weight_versions] == [
                (None, 0, edge), (5, edge, edge + 8)]
            assert whole.finish_reason == "length"
            self._replays(sampler, whole, edge, edge + 8)
            with pytest.raises(InvalidRequestError, match="continue_from"):
                sampler.generate([{**going_on, "prompt": "def x", "continue_from": partial}
                                  ])[0].unwrap()
            with pytest.raises(InvalidRequestError, match="continue_from"):
                sampler.generate([{**going_on, "continue_from": whole}])[0].unwrap()
        finally:
            sampler.update_weights(load_weights(harness.model_dir).items())
        self._replays(sampler, partial, edge - 8, edge)  # before the edge: the old weights

    def test_generate_while_released(self, harness):
        skip_unless(harness.caps, "release")
        backend = harness.rollout
        for tags in (["kv_cache"], ["weights", "kv_cache"]):
            backend.release(tags)
            assert backend.released == set(tags)
            if backend.capabilities.auto_resume:
                assert probe(backend) == harness.baseline
            else:
                with pytest.raises(BackendReleasedError, match="resume"):
                    backend.generate(probe_requests())
                backend.resume()
            assert not backend.released
            assert probe(backend) == harness.baseline

    def test_update_weights_needs_resident_weights(self, harness):
        skip_unless(harness.caps, "release")
        skip_unless(harness.caps, "update_weights")
        harness.rollout.release(["weights"])
        with pytest.raises(BackendReleasedError, match="weights"):
            harness.rollout.update_weights(load_weights(harness.other_dir).items())
        harness.rollout.resume(["weights"])
        assert probe(harness.rollout) == harness.baseline

    def test_random_lifecycle(self, harness):
        """Hypothesis drives generate, update_weights, release, resume and abort in random
        order and checks the output against what the loaded weights must give."""
        machine = type("Machine", (ContractMachine,), {"harness": harness, "weights": {
            "base": load_weights(harness.model_dir), "other": load_weights(harness.other_dir)}})
        run_state_machine_as_test(machine, settings=settings(
            max_examples=EXAMPLES, stateful_step_count=12, deadline=None))


class ContractMachine(RuleBasedStateMachine):
    harness: Harness
    weights: dict

    def __init__(self):
        super().__init__()
        self.loaded = "base"
        self.released: set[str] = set()

    @property
    def rollout(self) -> Rollout:
        return self.harness.rollout

    def _supports(self, capability: str) -> bool:
        return self.harness.caps.supports(capability)

    @rule()
    def generate(self):
        if self.released and not self.harness.caps.auto_resume:
            with pytest.raises(BackendReleasedError):
                probe(self.rollout)
            return
        expected = self.harness.baseline if self.loaded == "base" else self.harness.reference
        assert probe(self.rollout) == expected
        self.released.clear()

    @precondition(lambda self: self._supports("update_weights"))
    @rule(weights=st.sampled_from(["base", "other"]), bucket_bytes=st.sampled_from([1, 4096, None]))
    def update_weights(self, weights, bucket_bytes):
        named = self.weights[weights].items()
        if "weights" in self.released:
            with pytest.raises(BackendReleasedError):
                self.rollout.update_weights(named, bucket_bytes=bucket_bytes)
            return
        self.rollout.update_weights(named, bucket_bytes=bucket_bytes)
        self.loaded = weights

    @precondition(lambda self: self._supports("release"))
    @rule(tags=st.sampled_from([("weights",), ("kv_cache",), ("weights", "kv_cache")]))
    def release(self, tags):
        self.rollout.release(tags)
        self.released.update(tags)

    @precondition(lambda self: self._supports("release"))
    @rule(tags=st.sampled_from([("weights",), ("kv_cache",), ("weights", "kv_cache")]))
    def resume(self, tags):
        self.rollout.resume(tags)
        self.released.difference_update(tags)

    @rule()
    def abort_nothing_running(self):
        self.rollout.abort()

    def teardown(self):
        if self.rollout.released:
            self.rollout.resume()
        if self.loaded != "base":
            self.rollout.update_weights(self.weights["base"].items())

    @invariant()
    def released_state_matches(self):
        assert self.rollout.released == self.released


class WeightTestsOnly:
    """Mix into a `BackendContract` subclass that differs from another only in how weights
    travel (a transport option): it runs the weight tests alone, on the in-process face
    (the served one reaches the same backend through the core's HTTP routes)."""

    @pytest.fixture(autouse=True)
    def _weight_tests_only(self, request):
        name = request.node.name
        if not any(word in name for word in ("update", "weight", "lifecycle", "version")):
            pytest.skip("not about weights: the same as with the default transport")
        if name.endswith("[served]"):
            pytest.skip("the served face: the same as with the default transport")
