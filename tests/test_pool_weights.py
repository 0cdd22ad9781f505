"""Weights pushed into two replica processes of a pool (HF backend, tiny model): both
update in parallel, and a replica killed between two updates is restarted by the pool and
serves no request on its checkpoint's weights: the pool first pushes it the weights it kept
from the last update."""

import os
import signal
import time

import pytest

from rollout import load_backend
from rollout.service.served import ServedRollout
from rollout.testing.contract import probe_requests
from rollout.testing.model_folders import load_weights, perturbed_copy
from rollout.testing.waiting import wait_for


def served_by(trainer) -> dict[str, object]:
    return {r["url"]: r.get("weight_version") for r in trainer.health()["replicas"]
            if r["healthy"] and "behind" not in r}


def kill_and_wait_for_restart(trainer, victim) -> None:
    os.killpg(victim.process.proc.pid, signal.SIGKILL)
    old_url = victim.service.url
    wait_for(lambda: victim.service.url != old_url, 120, "the pool to restart the replica")


def test_a_restarted_replica_is_brought_to_the_pool_version_before_it_serves(tiny_model,
                                                                              tmp_path):
    other = perturbed_copy(tiny_model, tmp_path / "other")
    weights = {"base": load_weights(tiny_model), "other": load_weights(other)}
    with load_backend("hf", str(other)) as engine:
        fresh_other = [c.unwrap()[0].token_ids for c in engine.generate(probe_requests())]
    with load_backend("hf", str(tiny_model)) as engine:
        fresh_base = [c.unwrap()[0].token_ids for c in engine.generate(probe_requests())]
    many = probe_requests() * 4  # enough to reach both replicas

    def served_equal(version, fresh):
        for completion, expected in zip(trainer.generate(many), fresh * 4):
            [result] = completion.unwrap()
            assert result.weight_version == version and result.token_ids == expected

    with ServedRollout.start("hf", str(tiny_model), replicas=2) as trainer:
        trainer.update_weights(weights["other"].items(), version=1)
        assert list(served_by(trainer).values()) == [1, 1]

        victim = trainer.service.replicas[0]
        kill_and_wait_for_restart(trainer, victim)
        # Restarted on the checkpoint, it serves nothing until the pool has pushed it the
        # weights it kept from update 1; then it serves them.
        while served_by(trainer) != {r.service.url: 1 for r in trainer.service.replicas}:
            served_equal(1, fresh_other)
            time.sleep(0.2)
        served_equal(1, fresh_other)

        # An update through a gloo group of the trainer, both replicas and the pool's copy;
        # a restart after it brings the replica to that version.
        trainer.update_weights(weights["base"].items(), version=2, transport="gloo")
        assert list(served_by(trainer).values()) == [2, 2]
        kill_and_wait_for_restart(trainer, victim)
        wait_for(lambda: served_by(trainer) == {r.service.url: 2
                                               for r in trainer.service.replicas}, 120,
                 "the restarted replica to be brought to version 2")
        served_equal(2, fresh_base)
        assert {r.weight_version for c in trainer.generate(many) for r in c.unwrap()} == {2}


def test_without_kept_weights_a_restarted_replica_waits_for_the_next_update(tiny_model,
                                                                           tmp_path):
    other = perturbed_copy(tiny_model, tmp_path / "other")
    weights = load_weights(other)
    with load_backend("hf", str(other)) as engine:
        fresh = [c.unwrap()[0].token_ids for c in engine.generate(probe_requests())]
    with ServedRollout.start("hf", str(tiny_model), replicas=2, keep_weights=False) as trainer:
        assert trainer.service.kept is None  # no copy of the model in this process
        trainer.update_weights(weights.items(), version=1)
        victim = trainer.service.replicas[0]
        kill_and_wait_for_restart(trainer, victim)
        # Back on its checkpoint, it answers health checks but serves nothing...
        wait_for(lambda: victim.healthy, 120, "the restarted replica to answer")
        time.sleep(1.0)  # (a pool that kept weights would have brought it back by now)
        assert list(served_by(trainer)) == [trainer.service.replicas[1].service.url]
        for completion, expected in zip(trainer.generate(probe_requests() * 4), fresh * 4):
            assert completion.unwrap()[0].token_ids == expected
        # ... until the next update reaches it.
        trainer.update_weights(weights.items(), version=2)
        assert list(served_by(trainer).values()) == [2, 2]


def test_a_replica_killed_during_a_keep_update(tiny_model):
    """Requests run on both replicas while an update with pause="keep" is under way; one
    replica is killed in the middle of it. Every request ends (on the survivor, or with a
    clear error), none hangs; the update names the dead replica; the restarted one is
    brought to the new version before it serves."""
    import concurrent.futures

    from rollout import RolloutError

    weights = load_weights(tiny_model)
    long = [{"id": f"long-{i}", "prompt": "the ka lo",
             "sampling": {"max_tokens": 300, "ignore_eos": True, "temperature": 1.0}}
            for i in range(4)]
    with ServedRollout.start("hf", str(tiny_model), replicas=2,
                             options={"max_model_len": 512}) as trainer:
        victim = trainer.service.replicas[0]

        def tensors_killing_halfway():
            items = list(weights.items())
            yield from items[: len(items) // 2]
            os.killpg(victim.process.proc.pid, signal.SIGKILL)
            victim.process.proc.wait()
            yield from items[len(items) // 2:]

        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            running = pool.submit(trainer.generate, long)
            wait_for(lambda: trainer.health()["running"] >= 2, 60, "requests on both replicas")
            dead_url = victim.service.url
            with pytest.raises(RolloutError, match=dead_url):  # its part failed, by name
                trainer.update_weights(tensors_killing_halfway(), version=1, pause="keep")
            completions = running.result(timeout=300)
        for completion in completions:  # each ran to its end somewhere, or says why not
            assert completion.ok or isinstance(completion.error, RolloutError)
            if completion.ok:
                assert completion.unwrap()[0].completion_tokens == 300
        assert any(c.ok for c in completions)
        wait_for(lambda: victim.healthy and victim.weight_version == 1, 120,
                 "the restarted replica at the new version")
        assert {r.weight_version for c in trainer.generate(probe_requests() * 4)
                for r in c.unwrap()} == {1}
