"""Weights pushed into two replica processes of a pool (HF backend, tiny model): both
update in parallel, and a replica killed between two updates is restarted by the pool and
serves no request on its checkpoint's weights until the next update reaches it."""

import os
import signal
import time

import pytest

from rollout import load_backend
from rollout.apps.serving.remote import ServedRollout
from rollout.testing.contract import probe_requests
from rollout.testing.models import load_weights, perturbed_copy


def served_by(trainer) -> dict[str, object]:
    return {r["url"]: r.get("weight_version") for r in trainer.health()["replicas"]
            if r["healthy"] and "behind" not in r}


def wait_for(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            pytest.fail(f"waited {timeout:.0f} s for {what}")
        time.sleep(0.3)
    return value


def test_a_restarted_replica_serves_only_after_the_next_update(tiny_model, tmp_path):
    other = perturbed_copy(tiny_model, tmp_path / "other")
    weights = {"base": load_weights(tiny_model), "other": load_weights(other)}
    with load_backend("hf", str(other)) as engine:
        fresh_other = [c.unwrap()[0].token_ids for c in engine.generate(probe_requests())]
    many = probe_requests() * 4  # enough to reach both replicas
    with ServedRollout.start("hf", str(tiny_model), replicas=2) as trainer:
        trainer.update_weights(weights["other"].items(), version=1)
        assert list(served_by(trainer).values()) == [1, 1]

        victim = trainer.service.replicas[0]
        os.killpg(victim.process.proc.pid, signal.SIGKILL)
        old_url = victim.service.url
        # Restarted from the checkpoint: up, but behind the pool's version, so out of rotation.
        wait_for(lambda: victim.service.url != old_url and victim.failed_checks == 0
                 and victim.healthy, 120, "the pool to restart the replica")
        state = {r["url"]: r for r in trainer.health()["replicas"]}[victim.service.url]
        assert state["weight_version"] is None and "behind" in state
        for _ in range(2):
            for completion, fresh in zip(trainer.generate(many), fresh_other * 4):
                [result] = completion.unwrap()
                assert result.weight_version == 1 and result.token_ids == fresh

        # Reaches the new one too; through a gloo group of the trainer and both replicas.
        trainer.update_weights(weights["base"].items(), version=2, transport="gloo")
        assert list(served_by(trainer).values()) == [2, 2]
        assert {r.weight_version for c in trainer.generate(many) for r in c.unwrap()} == {2}
