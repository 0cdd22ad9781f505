"""Weight updates into a vLLM server through vLLM's weight-transfer routes and a gloo group
(`weight_transport="gloo"`), where they fail: the trainer stops after some layers, the
server refuses a chunk while its bytes are being broadcast, a group name comes back. Each
fails within seconds and leaves the weights dirty; a following full update brings back the
model's own outputs. Versions reach vLLM's own /weight_info."""

import json
import time
import urllib.request

import pytest
from conftest import ENGINE

import rollout
from rollout import GenerationError, WeightsDirtyError
from rollout.testing.contract import probe
from rollout.testing.model_folders import load_weights, perturbed_copy
from rollout.testing.weight_streams import trainer_that_dies

from rollout_vllm import transport


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    other = perturbed_copy(tiny_model, tmp_path_factory.mktemp("other"))
    # One group per layer: a failure can come after some layers were loaded.
    with rollout.load_backend("vllm", model=str(tiny_model), mode="server",
                              weight_transport="gloo", weight_group_bytes=1,
                              weight_group_timeout=30, **ENGINE) as backend:
        baseline = probe(backend)
        yield backend, load_weights(tiny_model), load_weights(other), baseline


def repaired(backend, base, baseline) -> None:
    with pytest.raises(WeightsDirtyError):
        backend.generate([{"prompt": "the", "sampling": {"max_tokens": 1}}])
    backend.update_weights(base.items(), version=2)
    assert probe(backend) == baseline


def weight_version(backend) -> str:
    with urllib.request.urlopen(backend._backend.engine.url + "/weight_info", timeout=10) as r:
        return json.loads(r.read())["weight_version"]


def test_updates_go_through_the_group_and_stamp_vllms_version(server):
    backend, base, other, baseline = server
    before = weight_version(backend)
    backend.update_weights(other.items(), version=1)
    first = weight_version(backend)
    assert probe(backend) != baseline and first != before
    backend.update_weights(base.items(), version=2)
    assert probe(backend) == baseline
    assert int(weight_version(backend)) == int(first) + 1  # one per full update


def test_a_trainer_that_stops_after_some_layers(server):
    backend, base, other, baseline = server
    group = backend._backend.gloo.group
    with pytest.raises(ConnectionResetError):
        backend.update_weights(trainer_that_dies(other), bucket_bytes=4096)
    assert backend._backend.gloo.group is group  # nothing was mid-broadcast: group kept
    repaired(backend, base, baseline)


def test_a_chunk_the_server_refuses_mid_broadcast(server, monkeypatch):
    backend, base, other, baseline = server
    group = backend._backend.gloo.group
    sent, announce = [], transport.update_info

    def refused_second(chunk):
        info = announce(chunk)
        sent.append(info)
        if len(sent) == 2:  # a dtype our engine refuses, after the broadcasts began
            info = {**info, "dtype_names": ["int8"] * len(info["names"])}
        return info

    monkeypatch.setattr(transport, "update_info", refused_second)
    # vLLM's refusal of the chunk is what ends the broadcast, not the group's timeout (that
    # would raise a TimeoutError): the cause, which no slow machine changes.
    with pytest.raises(GenerationError, match="on /update_weights"):
        backend.update_weights(other.items())
    assert len(sent) == 2
    assert backend._backend.gloo.group is None  # dropped: the next update opens a new one
    monkeypatch.undo()
    repaired(backend, base, baseline)
    assert backend._backend.gloo.group is not group


def test_a_group_name_used_before_is_refused_at_once(server, monkeypatch):
    backend, base, other, baseline = server
    gloo = backend._backend.gloo
    monkeypatch.setattr(transport.collective, "unique_group_name", lambda: "rollout-reused")
    gloo.drop()
    backend.update_weights(base.items(), version=2)  # first use of the name: joined
    gloo.drop()
    # A join timeout far past the bound: a refusal that waited it out cannot pass.
    monkeypatch.setattr(transport, "JOIN_TIMEOUT_S", 600.0)
    started = time.monotonic()
    with pytest.raises(GenerationError, match="used before"):
        backend.update_weights(base.items())
    assert time.monotonic() - started < 60
    monkeypatch.undo()
    repaired(backend, base, baseline)

