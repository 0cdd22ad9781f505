"""The lifecycle under random interleavings on the real HF backend: requests run on the
engine loop while weight updates (each pause mode, some failing midway: the requests a
"keep_kv" update runs beside then fail), adapter loads,
releases, resumes and aborts are called from threads of their own, in any order and at
once. Every request ends within a bound, with a result or a typed refusal; every result's
weight spans cover its tokens in order, with versions that were pushed, in the order they
were; and the backend ends where the last lifecycle call left it (dirty after a failed
update, at the last full update's version)."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, rule, run_state_machine_as_test

import rollout
from rollout import BackendReleasedError, RolloutError, WeightsDirtyError
from rollout.testing.adapters import lora_adapter
from rollout.testing.model_folders import load_weights, tiny_model_dir
from rollout.testing.weight_streams import trainer_that_dies

ENDS_WITHIN_S = 120.0


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    model = tiny_model_dir(tmp_path_factory.mktemp("interleavings"))
    with rollout.load_backend("hf", model=str(model)) as ro:
        yield ro, load_weights(model), lora_adapter(model)


class Interleavings(RuleBasedStateMachine):
    ro = weights = adapter = None  # the module's backend, set by the test

    def __init__(self):
        super().__init__()
        self.ro.update_weights(self.weights.items(), version=0)  # clean, at version 0
        self.sent: list = []
        self.calls: list[threading.Thread] = []
        self.versions = itertools.count(1)
        self.ran = [0]  # update versions in the order they ran (each alone)
        self.ended: dict[int, str] = {0: "done"}  # update version -> how it ended
        self.lock = threading.Lock()
        self.errors: list[BaseException] = []

    def _tracked(self, version: int, pairs):
        """The tensors of an update; the first is taken inside the update's call, which
        runs alone: the order of these marks is the order the updates ran in."""
        with self.lock:
            self.ran.append(version)
        yield from pairs

    def _call(self, kind: str, version: int | None, fn) -> None:
        def run():
            try:
                fn()
                how = "done"
            except ConnectionResetError:  # the trainer went away midway
                how = "failed"
            except BackendReleasedError:  # the weights are released: refused, nothing done
                how = "refused"
            except BaseException as exc:  # noqa: BLE001 - reported at the end
                self.errors.append(exc)
                how = "error"
            if kind == "update":
                with self.lock:
                    self.ended[version] = how

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        self.calls.append(thread)

    @rule(count=st.integers(1, 4), tokens=st.integers(1, 200), n=st.integers(1, 2),
          constrained=st.booleans())
    def start_requests(self, count, tokens, n, constrained):
        sampling = {"temperature": 1.0, "max_tokens": tokens, "n": n, "ignore_eos": True}
        if constrained:  # held by no keep update: the update waits for it
            sampling["structured_outputs"] = {"regex": "[a-z ]{1,80}"}
        for _ in range(count):
            rid = f"r{len(self.sent)}"
            self.sent.append(asyncio.run_coroutine_threadsafe(self.ro.agenerate(
                {"id": rid, "prompt": "the ka lo", "sampling": {**sampling, "seed": 1}}),
                self.ro._loop))

    @rule(pause=st.sampled_from(["wait", "abort", "keep", "keep_kv"]),
          fails=st.integers(0, 3).map(lambda k: k == 0))  # a quarter fail midway
    def update(self, pause, fails):
        version = next(self.versions)
        weights = self._tracked(version, trainer_that_dies(self.weights) if fails
                                else self.weights.items())
        self._call("update", version, lambda: self.ro.update_weights(
            weights, version=version, pause=pause, bucket_bytes=4096))

    @rule(ms=st.integers(5, 60), pause=st.sampled_from(["abort", "keep", "keep_kv"]))
    def update_while_requests_run(self, ms, pause):
        """The case the version rules are for: tokens made before the update, and (keep,
        keep_kv) after it, in one result."""
        self.start_requests(count=2, tokens=200, n=1, constrained=False)
        time.sleep(ms / 1000)
        self.update(pause, fails=False)

    @rule(pause=st.sampled_from(["wait", "abort"]))
    def load_adapter(self, pause):
        tensors, config = self.adapter
        self._call("adapter", None, lambda: self.ro.load_adapter(
            "policy", tensors.items(), config, version=1, pause=pause))

    @rule()
    def release(self):
        self._call("release", None, self.ro.release)

    @rule()
    def resume(self):
        self._call("resume", None, self.ro.resume)

    @rule(ms=st.integers(1, 60))
    def time_passes(self, ms):  # requests make tokens before the next call comes
        time.sleep(ms / 1000)

    @rule(which=st.integers(0, 1000))
    def abort(self, which):
        self.ro.abort([f"r{which % max(1, len(self.sent))}"])

    def teardown(self):
        for thread in self.calls:
            thread.join(ENDS_WITHIN_S)
            assert not thread.is_alive(), "a lifecycle call never ended"
        assert not self.errors, self.errors
        order = {v: i for i, v in enumerate(self.ran) if self.ended[v] == "done"}
        for future in self.sent:
            try:
                completion = future.result(ENDS_WITHIN_S)
            except (WeightsDirtyError, BackendReleasedError):
                continue  # refused by name: dirty weights, or released memory
            assert completion.error is None or isinstance(completion.error, RolloutError)
            for result in completion.results:
                spans = result.weight_versions
                assert [s.start for s in spans] == [0, *(s.end for s in spans)][:len(spans)]
                assert (spans[-1].end if spans else 0) == len(result.token_ids)
                ranks = [order[s.version] for s in spans]  # (a KeyError: never loaded)
                assert ranks == sorted(ranks), spans
        assert self.ro.weights_dirty == (self.ended[self.ran[-1]] == "failed")
        assert self.ro.weight_version == max(order, key=order.get)  # the last full update
        if self.ro.released:
            self.ro.resume()


def test_lifecycle_interleavings_on_the_real_engine(backend):
    Interleavings.ro, Interleavings.weights, Interleavings.adapter = backend
    run_state_machine_as_test(Interleavings, settings=settings(
        max_examples=20, stateful_step_count=12, deadline=None))
