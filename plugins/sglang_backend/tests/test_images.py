"""Images in prompts on the SGLang backend, on a real tiny Qwen2-VL built offline (float32).

The reference is the HF backend (its own tests check it against transformers'
`model.generate`): greedy tokens of the same requests must be the same, in both modes.
SGLang expands each image's one placeholder to its run of tokens itself; a later turn that
repeats an earlier image finds the whole earlier prompt, image included, in SGLang's radix
cache (`cached_tokens`).

Agent trajectories with an image in each tool result (`rollout.testing.images.run_look`)
give HF's tokens, and SGLang's image preprocessing cache (the backend sizes it) runs the
image processor once per image, not on every earlier image again on each turn.

Test-only CPU scaffolding (tests/cpu/sitecustomize.py): placeholder kernel ops, without which
SGLang's Qwen-VL processor does not import on CPU. TORCHDYNAMO_DISABLE=1 for this module's
engines (their processes read it when they start) spares a compile of about 40 s on the first
image request.
"""

from __future__ import annotations

import itertools
import json
import os
import urllib.request

import pytest

import rollout
from rollout.kit.tiny_vlm import build_tiny_vlm
from rollout.testing.images import CASES, ask, check_against_the_processor, greedy, picture, \
    run_look

from conftest import ENGINE

FIRST_TURN = greedy([ask(picture(6), "what?")])
LATER_IMAGE = picture(7, (90, 90))


def later_turn(vlm_dir, first, pictures) -> dict:
    """The next turn as token ids (token-in/token-out): the first prompt, its answer, and a
    user message with a new image, with one image per placeholder."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(vlm_dir)
    more = tokenizer("<|im_end|>\n<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>"
                     "and this?<|im_end|>\n<|im_start|>assistant\n",
                     add_special_tokens=False).input_ids
    return {"prompt_token_ids": list(first.prompt_token_ids) + list(first.token_ids) + more,
            "images": pictures,
            "sampling": {"temperature": 0, "max_tokens": 12, "ignore_eos": True}}


@pytest.fixture(scope="module", autouse=True)
def no_dynamo():
    old = os.environ.get("TORCHDYNAMO_DISABLE")
    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    yield
    if old is None:
        del os.environ["TORCHDYNAMO_DISABLE"]
    else:
        os.environ["TORCHDYNAMO_DISABLE"] = old


@pytest.fixture(scope="session")
def vlm_dir(tmp_path_factory):
    return build_tiny_vlm(tmp_path_factory.mktemp("tiny-vlm"))


@pytest.fixture(scope="session")
def hf(vlm_dir):
    """What the HF backend answers: each case, the first turn, and the later turn."""
    with rollout.load_backend("hf", model=str(vlm_dir), dtype="float32") as backend:
        results = [c.unwrap()[0] for c in backend.generate(list(CASES.values()))]
        first = backend.generate([FIRST_TURN])[0].unwrap()[0]
        later = later_turn(vlm_dir, first, [picture(6), LATER_IMAGE])
        again = backend.generate([later])[0].unwrap()[0]
    return dict(zip(CASES, results, strict=True)), first, later, again


def test_a_text_model_refuses_images(tiny_model):
    """First in this file: its engine is gone before the vision model's starts."""
    with rollout.load_backend("sglang", model=str(tiny_model), mode="engine", dtype="float32",
                              max_total_tokens=4096) as text_only:
        reason = text_only.capabilities.unsupported["images"]
        assert "text-only" in reason and "qwen2_vl" in reason
        completion = text_only.generate([greedy([ask(picture(0), "what?")], 3)])[0]
        assert completion.error.field == "messages"
        assert "does not support images" in completion.error.detail


@pytest.fixture(scope="module", params=["engine", "server"])
def sglang(request, vlm_dir):
    with rollout.load_backend("sglang", model=str(vlm_dir), mode=request.param,
                              **{**ENGINE, "max_total_tokens": 8192}) as backend:
        yield backend


def test_greedy_equals_hf(sglang, hf):
    expected = hf[0]
    assert sglang.capabilities.supports("images")
    completions = sglang.generate(list(CASES.values()))  # one batch: mixed on the engine
    image_token = sglang.encoder.image_token_id
    for name, completion in zip(CASES, completions, strict=True):
        result = completion.unwrap()[0]
        assert list(result.prompt_token_ids) == list(expected[name].prompt_token_ids), name
        assert list(result.token_ids) == list(expected[name].token_ids), name
        images = sum(p["type"] == "image" for m in CASES[name]["messages"]
                     if not isinstance(m["content"], str) for p in m["content"])
        assert result.prompt_token_ids.count(image_token) == images, name


def test_token_ids_with_images_continue_a_turn(sglang, hf, vlm_dir):
    """A later turn as token ids with its images (the earlier one repeated, a new one) gives
    HF's tokens, and SGLang's radix cache holds the earlier prompt, its image included."""
    _, hf_first, later, hf_again = hf
    first = sglang.generate([FIRST_TURN])[0].unwrap()[0]
    assert first.token_ids == hf_first.token_ids
    again = sglang.generate([later])[0].unwrap()[0]
    assert again.token_ids == hf_again.token_ids
    assert again.prompt_token_ids == tuple(later["prompt_token_ids"])
    # Cached beyond the earlier prompt's placeholder: the image's run of tokens (12 for a
    # 100x80 picture) and what follows it came from the cache.
    image_at = first.prompt_token_ids.index(sglang.encoder.image_token_id)
    assert again.cached_tokens >= len(first.prompt_token_ids) - 1 + 11
    # The same tokens with another earlier picture: the cache stops at that image.
    other = sglang.generate([{**later, "images": [picture(8), LATER_IMAGE]}])[0].unwrap()[0]
    assert other.cached_tokens <= image_at


def test_bad_image_counts_fail_alone(sglang):
    image_token = sglang.encoder.image_token_id
    two_for_one = {"prompt_token_ids": [5, image_token, 7, image_token],
                   "images": [picture(1)], "sampling": {"max_tokens": 4}}
    out = sglang.generate([two_for_one, greedy([ask(picture(8), "fine")], 4)])
    assert out[1].ok
    assert out[0].error.field == "prompt_token_ids"


def test_rescored_logprobs_of_an_image_prompt(sglang):
    """Logprobs with min_tokens come from a scoring prefill of prompt + sample: with images,
    it starts where SGLang's expanded prompt ends, and gives the logprobs of decoding."""
    base = {"messages": [ask(picture(9), "describe")],
            "sampling": {"temperature": 0, "max_tokens": 6, "ignore_eos": True, "logprobs": 2}}
    rescored = {**base, "sampling": {**base["sampling"], "min_tokens": 3}}
    plain, scored = (c.unwrap()[0] for c in sglang.generate([base, rescored]))
    assert scored.token_ids == plain.token_ids
    assert scored.logprobs == pytest.approx(plain.logprobs, abs=1e-4)


@pytest.fixture(scope="session")
def hf_looked(vlm_dir):
    """The HF backend's greedy look_task trajectories (checked in its own tests)."""
    with rollout.load_backend("hf", model=str(vlm_dir), dtype="float32") as backend:
        return run_look(backend)


@pytest.fixture(scope="module")
def looked(sglang):
    """look_task's trajectories on this engine; the engine's counters around the run; and,
    in process, the images SGLang's image processor ran on per call (a spy on it): through
    the cache, and on the cache's fallback path, which the counters would not see."""
    llm = getattr(sglang._backend.engine, "llm", None)  # in process only
    processor = llm.tokenizer_manager.mm_processor if llm else None
    runs, uncached = [], []
    if processor is not None:
        prepare, fallback = processor.prepare_artifact_batch, processor._process_mm_data_uncached

        def spy(entries, **kwargs):
            runs.append(len(entries))
            return prepare(entries, **kwargs)

        async def spy_fallback(image_data, *args, **kwargs):
            uncached.append(len(image_data))
            return await fallback(image_data, *args, **kwargs)

        processor.prepare_artifact_batch, processor._process_mm_data_uncached = \
            spy, spy_fallback
    before = sglang.health().get("stats")
    try:
        done = run_look(sglang)
    finally:
        if processor is not None:
            del processor.prepare_artifact_batch, processor._process_mm_data_uncached
    after = sglang.health().get("stats")
    counted = after and {k: after[k] - before[k] for k in after}
    return done, counted, runs, uncached


def test_look_trajectories_equal_hf(looked, hf_looked, vlm_dir):
    done = looked[0]
    assert len(done) == len(hf_looked)
    for t, expected in zip(done, hf_looked):
        assert t.end_reason == "done", t.end_detail
        assert t.response_ids == expected.response_ids
        assert [turn.images_added for turn in t.turns] == \
            [turn.images_added for turn in expected.turns]
        check_against_the_processor(t, vlm_dir)


def test_later_turns_find_the_earlier_images_in_the_radix_cache(looked):
    """A turn's prompt is the last turn's prompt and sample, then the tool's message: cached
    at least up to the last turn's prompt (a cache stopped at an image would stop before the
    earlier turn's end: SGLang counts each image as its run of tokens, we as one)."""
    for t in looked[0]:
        for before, turn in zip(t.turns, t.turns[1:]):
            assert turn.cached_tokens >= before.prompt_tokens, (before, turn)


def test_each_image_is_processed_once(sglang, looked):
    done, counted, runs, uncached = looked
    new = {i.id for t in done for i in t.images}
    # Every turn sends all of its images; SGLang runs its processor on each image once, the
    # first time any trajectory sends it, and finds it in its cache after that.
    sent = sum(sum(itertools.accumulate(len(turn.images_added) for turn in t.turns))
               for t in done)
    assert sent > len(new)
    engine = sglang._backend.engine
    if not hasattr(engine, "llm"):  # server mode: no counter is exposed over HTTP
        assert counted is None
        with urllib.request.urlopen(engine.url + "/server_info", timeout=30) as answer:
            assert json.load(answer)["mm_preprocess_cache_size_mb"] == 256  # but it is on
        return
    assert counted == {"images_processed": len(new), "image_cache_hits": sent - len(new)}
    assert runs == [1] * len(new) and uncached == []  # each run: one request's new image
