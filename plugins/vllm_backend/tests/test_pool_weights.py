"""Weights pushed from a trainer process into two vLLM replica processes (`rollout serve`
each, behind a pool of this process) over shared memory: greedy output after the update
equals a fresh vLLM load of the new weights on both replicas, versions advance, and
updating back restores the original."""

from conftest import ENGINE

import rollout
from rollout.service.served import ServedRollout
from rollout.testing.contract import probe_requests
from rollout.testing.model_folders import load_weights, perturbed_copy


def greedy(sampler) -> list:
    # Each prompt twice, all at once: least-in-flight balancing spreads them over both.
    return [c.unwrap()[0].token_ids for c in sampler.generate(probe_requests() * 2)]


def test_two_replicas_update_in_parallel_and_match_a_fresh_load(tiny_model, tmp_path):
    other = perturbed_copy(tiny_model, tmp_path / "other")
    with rollout.load_backend("vllm", str(other), **ENGINE) as fresh:
        expected_other = greedy(fresh)
    with ServedRollout.start("vllm", str(tiny_model), replicas=2, options=ENGINE) as trainer:
        before = greedy(trainer)
        assert before != expected_other
        trainer.update_weights(load_weights(other).items(), version=1)
        assert greedy(trainer) == expected_other
        assert [r["weight_version"] for r in trainer.health()["replicas"]] == [1, 1]
        trainer.update_weights(load_weights(tiny_model).items(), version=2)
        assert greedy(trainer) == before
        served = trainer.generate(probe_requests() * 2)
        assert {r.weight_version for c in served for r in c.unwrap()} == {2}
