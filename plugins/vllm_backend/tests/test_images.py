"""Images in prompts on vLLM's engine, on a real tiny Qwen2-VL built offline (float32, eager).

The reference is the HF backend on the same model (tested against transformers' own
`model.generate` in plugins/hf_backend/tests/test_hf_images.py): greedy tokens, and the
collapsed prompt ids (one `<|image_pad|>` per image), must be the same.
"""

from __future__ import annotations

import pytest

import rollout
from rollout.kit.tiny_vlm import build_tiny_vlm
from rollout.testing.images import CASES, ask, greedy, picture

from conftest import ENGINE



@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    return build_tiny_vlm(tmp_path_factory.mktemp("tiny-vlm"))


@pytest.fixture(scope="module")
def hf(vlm_dir):
    backend = rollout.load_backend("hf", model=str(vlm_dir), dtype="float32")
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def ro(vlm_dir):
    backend = rollout.load_backend("vllm", model=str(vlm_dir), max_model_len=1024, **ENGINE)
    yield backend
    backend.close()


def test_a_text_model_refuses_images(tiny_model):
    # First in this file: its engine is closed before the vision model's starts.
    with rollout.load_backend("vllm", model=str(tiny_model), **ENGINE) as text_only:
        assert "text-only" in text_only.capabilities.unsupported["images"]
        completion = text_only.generate([greedy([ask(picture(0), "what?")])])[0]
        assert completion.error.field == "messages"
        assert "does not support images" in completion.error.detail


def test_greedy_equals_the_hf_backend(ro, hf):
    assert ro.capabilities.supports("images")
    requests = list(CASES.values())
    ours, theirs = ro.generate(requests), hf.generate(requests)
    image_token = ro.encoder.image_token_id
    for name, a, b in zip(CASES, ours, theirs, strict=True):
        a, b = a.unwrap()[0], b.unwrap()[0]
        assert a.prompt_token_ids == b.prompt_token_ids, name
        assert a.token_ids == b.token_ids, name
    assert ours[1].unwrap()[0].prompt_token_ids.count(image_token) == 2


def test_token_ids_with_images_continue_a_turn(ro, hf):
    """A later turn as tokens: the first turn's prompt and output, then a new user turn with
    a second image; both images go in `images`, in placeholder order."""
    first = ro.generate([CASES["one image"]])[0].unwrap()[0]
    tokenizer = ro.encoder.tokenizer
    turn = tokenizer.apply_chat_template([ask(picture(6), "and now?")], tokenize=False,
                                         add_generation_prompt=True)
    ids = (list(first.prompt_token_ids) + list(first.token_ids)
           + tokenizer("<|im_end|>\n" + turn, add_special_tokens=False).input_ids)
    request = {"prompt_token_ids": ids, "images": [picture(0), picture(6)],
               "sampling": {"temperature": 0, "max_tokens": 12, "ignore_eos": True}}
    ours, theirs = ro.generate([request])[0].unwrap()[0], hf.generate([request])[0].unwrap()[0]
    assert ours.prompt_token_ids == tuple(ids) == theirs.prompt_token_ids
    assert ours.token_ids == theirs.token_ids
    # The same turn again gives the same tokens (the images now come from vLLM's caches).
    assert ro.generate([request])[0].unwrap()[0].token_ids == ours.token_ids


def test_a_bad_image_fails_its_own_request(ro):
    bad, ok = ro.generate([greedy([ask(b"not an image", "what?")], 4),
                           greedy([ask(picture(8), "fine")], 4)])
    assert ok.ok
    assert isinstance(bad.error, rollout.InvalidRequestError)
    assert bad.error.field == "messages[0].content[0]"


def test_a_repeated_image_is_processed_once(ro):
    """vLLM's multimodal processor cache, keyed by our image ids: a later turn that repeats
    an earlier image and adds one runs the image processor on the new one only."""
    cache = ro._backend.engine.engine.renderer.mm_processor_cache
    # Cumulative (vLLM reads the deltas itself, per request): (hits, images looked up).
    before = cache.make_stats()
    history = [ask(picture(20), "first"), {"role": "assistant", "content": "ok"}]
    ro.generate([greedy(history, 4)])[0].unwrap()
    middle = cache.make_stats()
    assert (middle.hits - before.hits, middle.total - before.total) == (0, 1)
    ro.generate([greedy(history + [ask(picture(21), "second")], 4)])[0].unwrap()
    after = cache.make_stats()
    assert (after.hits - middle.hits, after.total - middle.total) == (1, 2)


@pytest.fixture(scope="module")
def ro_async(vlm_dir, ro):
    ro.close()  # one vLLM engine at a time
    backend = rollout.load_backend("vllm", model=str(vlm_dir), mode="async",
                                   max_model_len=1024, **ENGINE)
    yield backend
    backend.close()


def test_async_mode_equals_the_hf_backend(ro_async, hf):
    """AsyncLLM renders image prompts in this process and runs the model in its core's."""
    assert ro_async.capabilities.supports("images")
    requests = [CASES["two images"], CASES["an image in a tool message"], CASES["text only"]]
    for a, b in zip(ro_async.generate(requests), hf.generate(requests), strict=True):
        a, b = a.unwrap()[0], b.unwrap()[0]
        assert (a.prompt_token_ids, a.token_ids) == (b.prompt_token_ids, b.token_ids)


def test_server_mode_reports_images_unsupported(vlm_dir):
    """Server mode sends token ids to /v1/completions, which takes none with images."""
    from transformers import AutoConfig

    from rollout_vllm.backend import _images_reason

    config = AutoConfig.from_pretrained(vlm_dir)
    assert "/v1/completions" in _images_reason(config, "server", None)
