"""A trainer and the HF engine sharing the cores of one process over time
(`rollout.kit.cores`, the `cores` option): each computes on every core while the other is
idle and on its share while both run, and a change of share reaches a pass under way."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import rollout
from rollout.kit.cores import CoreShare
from rollout.contract.errors import InvalidRequestError

REQUEST = {"prompt": "def add", "sampling": {"max_tokens": 4, "ignore_eos": True}}


@pytest.fixture(autouse=True)
def _restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_the_engine_computes_on_the_cores_the_trainer_leaves(tiny_model):
    cores = CoreShare(cores=2)
    seen: list[int] = []  # the engine thread's torch threads at each forward pass
    with rollout.load_backend("hf", model=str(tiny_model), cores=cores) as ro:
        ro._backend.model.register_forward_pre_hook(
            lambda *_: seen.append(torch.get_num_threads()))
        ro.generate([REQUEST])[0].unwrap()
        alone, seen[:] = seen[:], []
        with cores.busy("trainer"):
            ro.generate([REQUEST])[0].unwrap()
        beside = seen[:]
        # The engine, idle again, leaves the trainer every core (at its next turn).
        deadline = time.monotonic() + 30
        while cores.threads("trainer") != 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert cores.threads("trainer") == 2
    assert alone and set(alone) == {2}
    assert beside and set(beside) == {1}


def test_a_trainer_that_follows_the_share_takes_a_change_within_a_pass():
    cores = CoreShare(cores=2)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    cores.follow(model, "trainer")
    seen: list[int] = []

    def engine_starts(*_):  # as the engine thread takes its share when work arrives
        starts = threading.Thread(target=cores.take, args=("engine",))
        starts.start()
        starts.join()

    model[0].register_forward_hook(engine_starts)
    model[1].register_forward_hook(lambda *_: seen.append(torch.get_num_threads()))
    with cores.busy("trainer"):
        assert torch.get_num_threads() == 2
        loss = model(torch.ones(2, 4)).sum()
        assert seen == [1]  # the second layer already ran on the trainer's half
        cores.leave("engine")
        loss.backward()  # the gradients' hooks give the trainer every core back
        assert torch.get_num_threads() == 2


def test_cores_must_be_a_core_share(tiny_model):
    with pytest.raises(InvalidRequestError) as caught:
        rollout.load_backend("hf", model=str(tiny_model), cores=2)
    assert caught.value.field == "cores"
