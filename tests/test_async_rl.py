"""Asynchronous RL's sampler: the staleness bound under random schedules (Hypothesis, no
engine), and `GroupSampler` over the real HF backend and over a replica pool."""

from __future__ import annotations

import attrs
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import rollout
from rollout import InvalidRequestError
from rollout.apps.rl import Group, GroupSampler, Staleness, has_spread
from rollout.testing.model_folders import load_weights


@attrs.define
class _Made:
    oldest: int


class StalenessSchedules(RuleBasedStateMachine):
    """Groups start, end (kept or turned down) and are taken in batches, and the weights
    move on, in any order: the bound on what runs holds, and no batch holds a group over
    the bound unless the policy hands it over marked."""

    def __init__(self):
        super().__init__()
        self.bound: Staleness | None = None
        self.running: list[int] = []  # the version each running group started at

    @precondition(lambda self: self.bound is None)
    @rule(batch=st.integers(1, 4), eta=st.integers(0, 3), oversample=st.integers(0, 3),
          policy=st.sampled_from(["drop", "mask", "tag"]),
          max_running=st.none() | st.integers(1, 8), first=st.integers(0, 5))
    def configure(self, batch, eta, oversample, policy, max_running, first):
        self.bound = Staleness(batch, eta, policy, oversample, max_running, first)

    @precondition(lambda self: self.bound is not None and self.bound.capacity() > 0)
    @rule()
    def start(self):
        self.bound.start()
        self.running.append(self.bound.version)

    @precondition(lambda self: self.bound is not None and self.running)
    @rule(which=st.integers(0, 100), kept=st.booleans(), later=st.integers(0, 3))
    def finish(self, which, kept, later):
        started = self.running.pop(which % len(self.running))
        # Its oldest token came from the weights it started under or newer ones.
        oldest = min(started + later, self.bound.version)
        self.bound.finish(_Made(oldest), kept)

    @precondition(lambda self: self.bound is not None)
    @rule()
    def push(self):
        self.bound.advance()

    @precondition(lambda self: self.bound is not None)
    @rule()
    def take(self):
        b = self.bound
        batch = b.take()
        if batch is None:
            assert len(b.ready) < b.batch_size
            return
        assert len(batch) == b.batch_size
        for group, over in batch:
            assert over == (b.version - group.oldest > b.eta)
            if b.policy == "drop":
                assert not over, "a group over the bound reached the trainer"

    @invariant()
    def within_the_bound(self):
        b = self.bound
        if b is None:
            return
        assert b.running == len(self.running)
        updates = b.version - b.first
        assert b.accepted + b.running <= (b.eta + updates + 1) * b.batch_size + b.oversample
        if b.max_running is not None:
            assert b.running <= b.max_running
        assert b.capacity() >= 0


TestStalenessSchedules = StalenessSchedules.TestCase
TestStalenessSchedules.settings = settings(max_examples=200, stateful_step_count=60,
                                           deadline=None)


def test_eta_zero_samples_one_batch_per_version():
    bound = Staleness(batch_size=2, eta=0)
    assert bound.capacity() == 2
    for _ in range(2):
        bound.start()
    assert bound.capacity() == 0  # the synchronous loop: the next batch waits for an update
    for _ in range(2):
        bound.finish(_Made(0), kept=True)
    assert [over for _, over in bound.take()] == [False, False]
    assert bound.capacity() == 0
    bound.advance()
    assert bound.capacity() == 2


def test_a_turned_down_group_frees_its_place_and_stale_ones_are_dropped():
    bound = Staleness(batch_size=1, eta=1)
    bound.start()
    bound.start()
    bound.finish(_Made(0), kept=False)  # a filter turned it down
    assert bound.capacity() == 1
    bound.advance()
    bound.advance()
    bound.finish(_Made(0), kept=True)  # two versions old: over eta = 1
    assert bound.take() is None and bound.dropped == 1
    assert bound.capacity() == 4  # (eta + version + 1) * batch, none accepted or running


@pytest.mark.parametrize("field,value", [("batch_size", 0), ("eta", -1), ("stale", "later"),
                                         ("oversample", 1.5), ("max_running", 0)])
def test_bad_settings_are_refused_by_name(field, value):
    options = {"batch_size": 2, "eta": 1, "policy": "drop", "oversample": 0,
               "max_running": None, field if field != "stale" else "policy": value}
    with pytest.raises(InvalidRequestError, match=field):
        Staleness(**options)


# --- over the real engine -----------------------------------------------------------------

PROMPTS = ["the ka lo", "def x", "1 2 3 +", "mi ne su ta ri po", "ka ka", "lo mi"] * 3


def _prompts(max_tokens=24):
    return [{"id": f"p{i}", "prompt": p, "sampling": {"temperature": 1.0, "logprobs": 0,
                                                     "max_tokens": max_tokens,
                                                     "ignore_eos": True}}
            for i, p in enumerate(PROMPTS)]


def _letters(request, results):
    return [r.text.count("a") / 10 for r in results]


@pytest.fixture(scope="module")
def ro(tiny_model):
    with rollout.load_backend("hf", model=str(tiny_model), max_model_len=512) as ro:
        yield ro


@pytest.fixture(scope="module")
def replicas(tiny_model):
    with rollout.ServedRollout.start("hf", str(tiny_model), replicas=2,
                                     options={"max_model_len": 512}) as sampler:
        yield sampler


@pytest.mark.parametrize("pause", ["keep", "abort"])
@pytest.mark.parametrize("where", ["in_process", "replicas"])
def test_groups_run_across_updates_and_reach_the_trainer_whole(request, tiny_model, where,
                                                               pause):
    sampler = request.getfixturevalue("ro" if where == "in_process" else "replicas")
    weights = load_weights(tiny_model)
    start = sampler.weight_version or 0
    with GroupSampler(sampler, _prompts(), group_size=3, batch_size=2, eta=1,
                      score=_letters, pause=pause) as groups:
        for step in range(4):
            batch = groups.next_batch(timeout=300)
            assert len(batch) == 2
            for group in batch:
                assert isinstance(group, Group) and len(group.results) == 3
                assert group.version == start + step and group.staleness <= 1
                assert len(group.rewards) == 3
                for r in group.results:
                    # Nothing lost to an update: every sample ran to its end.
                    assert r.finish_reason == "length" and r.completion_tokens == 24
                    spans = r.weight_versions
                    assert spans[0].start == 0 and spans[-1].end == 24
                    versions = [start if x.version is None else x.version for x in spans]
                    assert all(group.oldest <= v <= group.version for v in versions)
            assert groups.update_weights(weights.items()) == start + step + 1
        stats = groups.stats()
    assert stats["version"] == start + 4  # (a group that ended past the bound was dropped)
    assert sampler.weight_version == start + 4


def test_adapter_pushes_age_adapter_samples_by_their_adapter_version(ro, tiny_model):
    """A trainer of a LoRA adapter pushes only it: its samples are as old as the adapter
    version that made them (the base weights' spans never move), so none is dropped as
    stale and each batch is of the version just pushed; eta > 0 is refused by name."""
    from rollout.testing.adapters import lora_adapter

    tensors, config = lora_adapter(tiny_model, rank=4, seed=3)
    start = ro.weight_version or 0  # where the group sampler's versions start (earlier tests)
    ro.load_adapter("trained", tensors.items(), config, version=start)
    prompts = [{**p, "adapter": "trained"} for p in _prompts(4)]
    try:
        with GroupSampler(ro, prompts, group_size=2, batch_size=2, eta=0) as groups:
            for step in range(start, start + 3):
                batch = groups.next_batch(timeout=300)
                assert {(g.version, g.staleness) for g in batch} == {(step, 0)}
                assert {(r.adapter, r.adapter_version) for g in batch
                        for r in g.results} == {("trained", step)}
                assert groups.load_adapter("trained", tensors.items(), config) == step + 1
            assert groups.stats()["dropped_stale"] == 0
        with GroupSampler(ro, prompts, group_size=2, batch_size=2, eta=1) as groups:
            with pytest.raises(InvalidRequestError, match="eta"):
                groups.load_adapter("trained", tensors.items(), config)
    finally:
        ro.unload_adapter("trained")


def test_a_group_filter_and_oversampling_fill_batches_with_kept_groups(ro):
    turned_down = []

    def spread_or_count(group):
        kept = has_spread(group)
        turned_down.append(not kept)
        return kept

    def first_sample_only(request, results):  # one prompt in three gets no spread
        return [1.0] + [0.0 if request.id[1:] in ("0", "3", "6") else 1.0] * (len(results) - 1)

    with GroupSampler(ro, _prompts(4), group_size=2, batch_size=2, eta=0, oversample=2,
                      score=first_sample_only, keep=spread_or_count) as groups:
        batch = groups.next_batch(timeout=300)
        assert all(has_spread(g) for g in batch)
        assert groups.stats()["filtered"] == sum(turned_down)


def test_the_prompts_running_out_and_a_bad_prompt_are_told_not_waited_on(ro):
    with GroupSampler(ro, _prompts(4)[:1], group_size=2, batch_size=2) as groups:
        with pytest.raises(rollout.RolloutError, match="prompts ran out"):
            groups.next_batch(timeout=300)
    with GroupSampler(ro, [{"prompt": "x", "sampling": {"top_p": 7}}], group_size=2,
                      batch_size=1) as groups:
        with pytest.raises(InvalidRequestError, match="top_p"):
            groups.next_batch(timeout=300)


def _trainer_logprobs(model, results):
    """Each output token's logprob under `model`, from one forward pass per result."""
    import torch

    rows = []
    with torch.no_grad():
        for r in results:
            ids = torch.tensor([list(r.prompt_token_ids) + list(r.token_ids)])
            logits = model(input_ids=ids).logits[0, len(r.prompt_token_ids) - 1:-1].float()
            picked = torch.log_softmax(logits, -1).gather(1, torch.tensor(r.token_ids)[:, None])
            rows.append(picked[:, 0].tolist())
    return rows


def test_each_token_has_its_versions_logprob_and_a_span_off_by_one_shows(ro, tiny_model,
                                                                        tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from rollout.apps.rl import largest_gap
    from rollout.testing.contract import across_a_keep
    from rollout.testing.model_folders import perturbed_copy

    other = perturbed_copy(tiny_model, tmp_path / "other")
    trainers = {v: AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
                for v, d in ((None, tiny_model), (1, other))}
    start = ro.weight_version
    trainers[start] = trainers.pop(None)
    request = {"prompt": "the ka lo", "sampling": {"temperature": 0.0, "ignore_eos": True,
                                                   "logprobs": 0, "max_tokens": 400}}

    try:  # a keep update lands while the request runs
        [result] = across_a_keep(ro, ro, request, load_weights(other), 1).unwrap()
    finally:
        ro.update_weights(load_weights(tiny_model).items(), version=start)
    first, second = result.weight_versions

    def under(version, holding):
        return _trainer_logprobs(trainers[version], holding)

    assert largest_gap([result], under) < 1e-3
    for shift in (-1, 1):  # the edge one token early, or late
        edge = first.end + shift
        spans = (attrs.evolve(first, end=edge), attrs.evolve(second, start=edge))
        off = attrs.evolve(result, weight_versions=[x for x in spans if x.start < x.end])
        assert largest_gap([off], under) > 1e-2, shift
