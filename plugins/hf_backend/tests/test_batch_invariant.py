"""Batch-invariant requests in the HF engine: each row runs in a batch of its own beside
the shared one (the contract suite checks that its answer is the request's alone), and a
step that fails takes down every request it admitted, in whichever batch."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

import rollout

INVARIANT = {"max_tokens": 6, "temperature": 0.0, "logprobs": 0, "batch_invariant": True}


@pytest.fixture(scope="module")
def ro(tiny_model):
    ro = rollout.load_backend("hf", model=str(tiny_model), batch_size=4)
    yield ro
    ro.close()


def test_invariant_rows_wait_for_room_beside_the_batch_and_answer_as_alone(ro):
    """Six invariant requests and six plain ones with 4 rows at most: every request is
    answered in full, each invariant one exactly as alone."""
    prompts = [f"the {word} one" for word in ("red", "long", "odd", "last", "new", "far")]
    alone = [ro.generate([{"prompt": p, "sampling": INVARIANT}])[0].unwrap()[0]
             for p in prompts[:2]]
    plain = {"max_tokens": 5, "ignore_eos": True, "temperature": 1.0}
    mixed = ro.generate([{"prompt": p, "sampling": plain} for p in prompts]
                        + [{"prompt": p, "sampling": INVARIANT} for p in prompts])
    assert all(len(c.unwrap()[0].token_ids) == 5 for c in mixed[:6])
    for expected, completion in zip(alone, mixed[6:]):
        (result,) = completion.unwrap()
        assert result.token_ids == expected.token_ids
        assert result.logprobs == expected.logprobs


def test_a_step_that_fails_fails_the_rows_it_admitted_in_every_batch(ro, monkeypatch):
    """The shared batch's forward pass raises (a fault the real engine cannot make on
    demand) before the invariant row admitted in the same step has run: both requests fail
    by name, and the engine goes on."""
    engine = ro._backend.engine
    forward = type(engine.model).forward
    calls = []

    def fails_first(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("a fault in the shared batch")
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(type(engine.model), "forward", fails_first)
    with ThreadPoolExecutor(1) as pool:
        with engine.exclusive():  # no step runs until both requests wait: one step takes both
            running = pool.submit(ro.generate, [
                {"prompt": "ka lo", "sampling": {"max_tokens": 3}},
                {"prompt": "ka lo", "sampling": INVARIANT}], timeout=60)
            deadline = time.monotonic() + 30
            while len(engine._waiting) < 2:
                assert time.monotonic() < deadline, "the requests never reached the engine"
                time.sleep(0.01)
        plain, invariant = running.result(90)
    for completion in (plain, invariant):
        assert isinstance(completion.error, rollout.GenerationError), completion
        assert "a fault in the shared batch" in str(completion.error)
    monkeypatch.undo()
    assert all(c.ok for c in ro.generate([{"prompt": "ka lo", "sampling": INVARIANT}]))
