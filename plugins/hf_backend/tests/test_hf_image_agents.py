"""Agent trajectories with an image in each tool result, on the HF backend's real engine
(the tiny Qwen2-VL): each turn sends only its new images' pixels, the engine processes only
those, and the tokens and images built turn by turn are the processor's of the whole
conversation."""

from __future__ import annotations

import asyncio
import itertools

import pytest

import rollout
from rollout.kit import images as kit_images
from rollout.kit.tiny_vlm import build_tiny_vlm
from rollout.testing.images import LOOK_ROWS, check_against_the_processor, run_look, \
    run_look_async


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    return build_tiny_vlm(tmp_path_factory.mktemp("tiny-vlm"))


@pytest.fixture(scope="module")
def ro(vlm_dir):
    with rollout.load_backend("hf", model=str(vlm_dir), dtype="float32") as backend:
        yield backend


@pytest.fixture(scope="module")
def looked(ro):
    """The first run on a fresh engine: its trajectories and the engine's counters."""
    before = ro.health()["stats"]
    done = run_look(ro)
    after = ro.health()["stats"]
    return done, {k: after[k] - before[k] for k in after}


def test_each_turn_adds_the_images_its_tools_returned(looked, vlm_dir):
    done, _ = looked
    for t in done:
        assert t.end_reason == "done", t.end_detail
        first = len(t.turns[0].images_added)
        assert [len(turn.images_added) for turn in t.turns] == [first, 1, 1, 1]
        assert [i for turn in t.turns for i in turn.images_added] == [i.id for i in t.images]
        check_against_the_processor(t, vlm_dir)


def test_the_engine_processes_only_new_images(looked):
    done, counted = looked
    new = {i.id for t in done for i in t.images}
    # Every turn sends all of its images (by uuid where sent before); each is processed
    # once, the first time any trajectory sends it, and found in the cache after that.
    sent = sum(sum(itertools.accumulate(len(turn.images_added) for turn in t.turns))
               for t in done)
    assert sent > len(new)
    assert counted == {"images_processed": len(new), "image_cache_hits": sent - len(new)}


def test_a_later_turn_sends_only_its_new_images_pixels(ro, monkeypatch):
    decoded = []  # the pixels the engine's side received, as it loads them

    def spy(source, field, uuid=None, load=kit_images.load_image):
        decoded.append(field)
        return load(source, field, uuid)

    monkeypatch.setattr(kit_images, "load_image", spy)
    (t,) = run_look(ro, LOOK_ROWS[:1])
    assert len(decoded) == len(t.images) == 3  # one per image, not one per image per turn


def test_an_image_the_engine_no_longer_holds_is_sent_again(ro, looked):
    kept, ro.images = ro.images, kit_images.ImageStore(max_bytes=0)  # holds nothing
    try:
        again = run_look(ro)
    finally:
        ro.images = kept
    assert [t.response_ids for t in again] == [t.response_ids for t in looked[0]]


def test_over_a_replica_pool_each_image_travels_once_or_again_where_missing(vlm_dir, looked):
    """With sessions a trajectory keeps its replica, and each image's pixels travel once.
    A turn that reaches a replica which never saw the earlier images (here every turn goes
    to the other replica than the last one) is answered `unknown_image` there, and goes
    again with every image's pixels. Tokens are the same."""
    with rollout.ServedRollout.start("hf", str(vlm_dir), 2, {"dtype": "float32"}) as sampler:
        pool = sampler.service
        sends = [replica.service.generate for replica in pool.replicas]
        pixels, hop = [], [False]  # per request: the images sent with their pixels

        def record(request):
            pixels.append(sum(i is not None for i in request.images))
            return sends[len(pixels) % 2 if hop[0] else 0](request)

        for replica in pool.replicas:
            replica.service.generate = record
        runs = []
        for hopping in (True, False):  # on fresh replicas first
            pixels.clear()
            hop[0] = hopping
            done = asyncio.run(run_look_async(sampler, LOOK_ROWS[1:], tokenizer=str(vlm_dir)))
            runs.append((done, list(pixels)))
    (hopping, sent_hopping), (pinned, sent_pinned) = runs
    local = [t.response_ids for t in looked[0][1:]]
    assert [t.response_ids for t in pinned] == [t.response_ids for t in hopping] == local
    assert sent_pinned == [1, 1, 1, 1]  # each turn's new image only
    # Each later turn: its new image alone, refused for the old ones missing, then all.
    assert sent_hopping == [1, 1, 2, 1, 3, 1, 4]
