"""The gloo update group between the backend (rank 0) and its SGLang server (rank 1), and
what a transfer cut midway leaves: nothing served from half-new weights, and a next full
update that begins, in a new group, and loads."""

import time

import pytest
from conftest import ENGINE

import rollout
from rollout.testing.contract import probe
from rollout.weights.transports import collective
from rollout.testing.model_folders import load_weights, perturbed_copy
from rollout_sglang import transport


@pytest.fixture(scope="module")
def backend(tiny_model):
    with rollout.load_backend("sglang", model=str(tiny_model), mode="server",
                              **ENGINE) as backend:
        yield backend


def test_the_server_mode_default_is_the_update_group(backend, tiny_model, tmp_path):
    sender = backend._backend.weights
    assert isinstance(sender, transport.GlooSender)
    baseline = probe(backend)
    backend.update_weights(load_weights(perturbed_copy(tiny_model, tmp_path / "other")).items())
    assert probe(backend) != baseline
    name = sender.group.name
    backend.update_weights(load_weights(tiny_model).items(), bucket_bytes=4096)
    assert probe(backend) == baseline
    assert sender.group.name == name  # one group for every update


def test_a_transfer_cut_midway_is_not_served_and_the_next_update_loads(
        backend, tiny_model, tmp_path, monkeypatch):
    sender = backend._backend.weights
    baseline = probe(backend)
    backend.update_weights(load_weights(tiny_model).items())  # the group is open
    first = sender.group.name
    start = collective.start_broadcast

    def dies_midway(group, tensors):
        # Half the announced tensors go out, then the trainer's transfer fails, while
        # SGLang waits for the rest.
        collective.wait_all(group, start(group, tensors[: len(tensors) // 2]))
        raise ConnectionResetError("the transfer died")

    monkeypatch.setattr(collective, "start_broadcast", dies_midway)
    other = load_weights(perturbed_copy(tiny_model, tmp_path / "other"))
    started = time.monotonic()
    with pytest.raises(ConnectionResetError):
        backend.update_weights(other.items(), version=1)
    assert time.monotonic() - started < 60  # SGLang's receive failed: it waits 30 minutes
    with pytest.raises(rollout.WeightsDirtyError):
        backend.generate([{"prompt": "the ka lo"}])
    assert sender.group is None  # dropped, on both sides
    monkeypatch.undo()
    backend.update_weights(load_weights(tiny_model).items(), version=2)
    assert sender.group.name != first  # a group name is never used twice
    assert probe(backend) == baseline


def test_an_update_sglang_refuses_fails_at_once_with_its_reason(
        backend, tiny_model, monkeypatch):
    inner = backend._backend
    baseline = probe(backend)

    async def no_session():  # SGLang then refuses the update: nothing will receive
        pass

    monkeypatch.setattr(inner.engine, "begin_update", no_session)
    started = time.monotonic()
    with pytest.raises(rollout.GenerationError, match="begin_weight_update"):
        backend.update_weights(load_weights(tiny_model).items())
    assert time.monotonic() - started < 120  # not the group's timeout (600 s, the default)
    monkeypatch.undo()
    backend.update_weights(load_weights(tiny_model).items())
    assert probe(backend) == baseline
