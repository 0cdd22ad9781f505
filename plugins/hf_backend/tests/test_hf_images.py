"""Images in prompts on the HF backend, on a real tiny Qwen2-VL built offline.

The reference is transformers' own `model.generate` on the processor's rendering of the same
messages (each `<|image_pad|>` expanded to its image's run, pixels from the image processor,
M-RoPE positions computed by the model): greedy tokens must be the same.
"""

from __future__ import annotations

import io
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

import rollout
from rollout.kit import images as kit_images
from rollout.kit.tiny_vlm import build_tiny_vlm

TOOLS = [{"name": "look", "description": "Look at a picture.",
          "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}]


def picture(seed: int, size=(100, 80)) -> Image.Image:
    pixels = np.random.RandomState(seed).randint(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def image(source) -> dict:
    return {"type": "image", "image": source}


def ask(*parts, role="user") -> dict:
    """A message of text (str), images (PIL, bytes) and parts (dicts, e.g. `image(path)`)."""
    return {"role": role, "content": [
        p if isinstance(p, dict) else {"type": "text", "text": p} if isinstance(p, str)
        else image(p) for p in parts]}


@pytest.fixture(scope="session")
def vlm_dir(tmp_path_factory):
    return build_tiny_vlm(tmp_path_factory.mktemp("tiny-vlm"))


@pytest.fixture(scope="module")
def ro(vlm_dir):
    # Few rows: requests wait, then join a running batch of rows with other rope deltas.
    backend = rollout.load_backend("hf", model=str(vlm_dir), batch_size=3)
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def reference(vlm_dir):
    from transformers import (
        AutoImageProcessor,
        AutoTokenizer,
        Qwen2VLForConditionalGeneration,
    )

    model = Qwen2VLForConditionalGeneration.from_pretrained(vlm_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(vlm_dir)
    processor = AutoImageProcessor.from_pretrained(vlm_dir)

    def generate(messages, pictures, max_tokens, tools=None):
        """What Qwen2VLProcessor + model.generate give (the processor object itself needs
        torchvision for its video part, absent here: its image steps are done as it does)."""
        text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                             tokenize=False)
        collapsed = tokenizer(text, add_special_tokens=False).input_ids
        inputs = {}
        if pictures:
            inputs = dict(processor(images=pictures, return_tensors="pt"))
            runs = iter((inputs["image_grid_thw"].prod(-1) // processor.merge_size**2).tolist())
            pieces = text.split("<|image_pad|>")
            text = pieces[0] + "".join("<|image_pad|>" * next(runs) + p for p in pieces[1:])
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
        if pictures:
            inputs["mm_token_type_ids"] = (ids == model.config.image_token_id).int()
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **inputs,
                                 max_new_tokens=max_tokens, do_sample=False)
        return collapsed, out[0, ids.shape[1]:].tolist()

    return generate


def greedy(messages, max_tokens=12, **fields) -> dict:
    return {"messages": messages, **fields,
            "sampling": {"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True}}


def test_greedy_equals_model_generate_in_a_mixed_batch(ro, reference):
    cases = [
        ([ask(picture(0), "what is this?")], [picture(0)], 12),
        ([{"role": "user", "content": "hello there"}], [], 20),
        ([ask("compare", picture(1, (112, 112)), "and", picture(2, (60, 140)))],
         [picture(1, (112, 112)), picture(2, (60, 140))], 9),
        ([{"role": "system", "content": "be brief"}, ask(picture(3, (300, 200)), "then?")],
         [picture(3, (300, 200))], 15),
        ([{"role": "user", "content": "one more text"}], [], 6),
    ]
    completions = ro.generate([greedy(m, n) for m, _, n in cases])
    image_token = ro.encoder.image_token_id
    for (messages, pictures, n), completion in zip(cases, completions, strict=True):
        result = completion.unwrap()[0]
        prompt, tokens = reference(messages, pictures, n)
        assert list(result.token_ids) == tokens, messages
        # What the engine was given: the template's rendering, one placeholder per image.
        assert list(result.prompt_token_ids) == prompt
        assert result.prompt_token_ids.count(image_token) == len(pictures)


def test_pixels_change_the_output(ro):
    first = [ro.generate([{**greedy([ask(picture(seed), "what is this?")], 1),
                           "sampling": {"temperature": 0, "max_tokens": 1, "logprobs": 5}}])[0]
             .unwrap()[0].top_logprobs[0] for seed in (10, 11)]
    assert first[0] != first[1]


def test_seeded_samples_of_an_image_prompt_reproduce(ro):
    """n rows of one request each prefill the request's pixels, alone or with others."""
    request = {"messages": [ask(picture(12), "tell me")],
               "sampling": {"temperature": 1.0, "n": 4, "seed": 3, "max_tokens": 8}}
    alone = ro.generate([request])[0].unwrap()
    crowd = ro.generate([greedy([ask(picture(13), "x")]), request,
                         greedy([{"role": "user", "content": "text"}])])[1].unwrap()
    assert [r.token_ids for r in alone] == [r.token_ids for r in crowd]
    assert len({r.token_ids for r in alone}) > 1


def test_every_source_of_one_picture_is_the_same_image(ro, tmp_path):
    data = png(picture(4))
    path = tmp_path / "p.png"
    path.write_bytes(data)
    url = kit_images.data_url(data)
    sources = [picture(4), data, str(path), url]
    outputs = ro.generate([greedy([ask(image(s), "what?")]) for s in sources])
    assert len({c.unwrap()[0].token_ids for c in outputs}) == 1
    ids = {kit_images.load_image(s, "x").id for s in sources}
    assert len(ids) == 1


def test_an_image_in_a_tool_message(ro, reference):
    messages = [
        {"role": "user", "content": "look at it"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"id": "c1", "name": "look", "arguments": "{\"x\": 1}"}]},
        {**ask(picture(5), "here it is", role="tool"), "tool_call_id": "c1"},
    ]
    result = ro.generate([greedy(messages, tools=TOOLS)])[0].unwrap()[0]
    openai_messages = [messages[0], {**messages[1], "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "look", "arguments": {"x": 1}}}]},
        {"role": "tool", "tool_call_id": "c1",
         "content": [{"type": "image"}, {"type": "text", "text": "here it is"}]}]
    tools = [rollout.Tool(**t).as_openai() for t in TOOLS]
    prompt, tokens = reference(openai_messages, [picture(5)], 12, tools)
    assert list(result.prompt_token_ids) == prompt
    assert list(result.token_ids) == tokens


def test_token_ids_with_images_continue_a_turn(ro):
    """A later turn sent as tokens (token-in/token-out) carries its images along."""
    first = ro.generate([greedy([ask(picture(6), "what?")])])[0].unwrap()[0]
    again = ro.generate([{"prompt_token_ids": list(first.prompt_token_ids),
                          "images": [png(picture(6))],
                          "sampling": {"temperature": 0, "max_tokens": 12,
                                       "ignore_eos": True}}])[0].unwrap()[0]
    assert again.token_ids == first.token_ids
    assert again.prompt_token_ids == first.prompt_token_ids


def test_a_bad_image_fails_its_own_request(ro, tmp_path, monkeypatch):
    monkeypatch.setattr(kit_images, "MAX_IMAGE_BYTES", 10_000)
    big = png(picture(7, (200, 200)))  # > 10 kB
    assert len(big) > 10_000
    cases = {
        "undecodable": (b"not an image at all", "messages[1].content[0]"),
        "too many bytes": (big, "messages[1].content[0]"),
        "an http URL": ("http://example.com/cat.png", "messages[1].content[0]"),
        "a missing file": (str(tmp_path / "missing.png"), "messages[1].content[0]"),
        "not base64": ("data:image/png;base64,@@@", "messages[1].content[0]"),
    }
    good = greedy([ask(picture(8), "fine")], 4)
    for name, (source, field) in cases.items():
        messages = [{"role": "user", "content": "hi"}, ask(image(source), "and this?")]
        bad, ok = ro.generate([greedy(messages, 4), good])
        assert ok.ok, name
        assert isinstance(bad.error, rollout.InvalidRequestError), name
        assert bad.error.field == field, name
        assert "data: URL" in bad.error.allowed, name

    monkeypatch.setattr(kit_images, "MAX_IMAGE_PIXELS", 50 * 50)
    small = greedy([ask(picture(8, (40, 40)), "fine")], 4)
    bad, ok = ro.generate([greedy([ask(picture(9), "big")], 4), small])
    assert ok.ok and bad.error.field == "messages[0].content[0]"
    assert "100x80 pixels is too large" in bad.error.detail


def test_placeholders_must_match_images(ro):
    image_token = ro.encoder.image_token_id
    good = greedy([ask(picture(8), "fine")], 4)
    two_for_one = {"prompt_token_ids": [5, image_token, 7, image_token],
                   "images": [png(picture(1))], "sampling": {"max_tokens": 4}}
    none_for_one = {"prompt_token_ids": [5, 7], "images": [png(picture(1))]}
    bad_image = {"prompt_token_ids": [5, image_token], "images": [b"junk"]}
    out = ro.generate([two_for_one, good, none_for_one, bad_image])
    assert out[1].ok
    assert out[0].error.field == "prompt_token_ids" and "2 image placeholders" in out[0].error.detail
    assert out[2].error.field == "prompt_token_ids"
    assert out[3].error.field == "images[0]"
    # A text prompt that holds the placeholder without an image is refused too.
    text = ro.generate([{"prompt": "look: <|image_pad|>"}])[0]
    assert text.error.field == "prompt" and "1 image placeholders" in text.error.detail


def test_a_text_model_refuses_images(tiny_model):
    with rollout.load_backend("hf", model=str(tiny_model)) as text_only:
        assert "text-only" in text_only.capabilities.unsupported["images"]
        completion = text_only.generate([greedy([ask(picture(0), "what?")])])[0]
        assert completion.error.field == "messages"
        assert "does not support images" in completion.error.detail
        assert "stats" not in text_only.health()  # no image counters to give


def test_cli_builds_a_vision_model_that_loads(tmp_path):
    out = tmp_path / "vlm"
    subprocess.run([sys.executable, "-m", "rollout", "tiny-model", "--vision", str(out)],
                   check=True, capture_output=True)
    with rollout.load_backend("hf", model=str(out)) as backend:
        assert backend.capabilities.supports("images")
        assert backend.generate([greedy([ask(picture(0), "what?")], 3)])[0].ok


# --- the image cache: processor outputs per image id -------------------------------------

def stats_since(ro, before: dict) -> dict:
    return {k: v - before[k] for k, v in ro.health()["stats"].items()}


def two_turns(ro, first_seed: int, second_seed: int) -> tuple[list, list]:
    """A first turn with one image, then a turn that repeats it and adds one (its counters)."""
    turn = [ask(picture(first_seed), "what is this?")]
    before = ro.health()["stats"]
    answer = ro.generate([greedy(turn)])[0].unwrap()[0]
    first = stats_since(ro, before)
    later = turn + [{"role": "assistant", "content": answer.text},
                    ask(picture(second_seed, (112, 112)), "and this one?")]
    before = ro.health()["stats"]
    result = ro.generate([greedy(later)])[0].unwrap()[0]
    return later, [answer.token_ids, result.token_ids], [first, stats_since(ro, before)]


def test_a_later_turn_processes_only_its_new_image(ro, reference):
    later, (_, tokens), (first, second) = two_turns(ro, 20, 21)
    assert first == {"images_processed": 1, "image_cache_hits": 0}
    assert second == {"images_processed": 1, "image_cache_hits": 1}
    # The cached image's pixels and run are the ones the processor makes.
    assert list(tokens) == reference(later, [picture(20), picture(21, (112, 112))], 12)[1]


def test_greedy_is_the_same_without_the_cache(ro, vlm_dir):
    _, cached, _ = two_turns(ro, 22, 23)
    twice = greedy([ask("one", picture(24), "two", picture(24))])  # one image, twice
    cached.append(ro.generate([twice])[0].unwrap()[0].token_ids)
    with rollout.load_backend("hf", model=str(vlm_dir), image_cache_mb=0) as uncached:
        _, plain, counts = two_turns(uncached, 22, 23)
        before = uncached.health()["stats"]
        plain.append(uncached.generate([twice])[0].unwrap()[0].token_ids)
        counts.append(stats_since(uncached, before))
    assert plain == cached
    assert counts == [{"images_processed": n, "image_cache_hits": 0} for n in (1, 2, 1)]


def test_the_cache_evicts_within_its_bound(vlm_dir):
    # A 100x80 picture is 48 rows of 1176 float32 values (226 kB), a 112x112 one 64 rows
    # (301 kB): 0.25 MiB holds one of the first kind, none of the second.
    with rollout.load_backend("hf", model=str(vlm_dir), image_cache_mb=0.25) as ro:
        vision = ro._backend.vision
        seen = []
        for seed, size in [(30, (100, 80)), (31, (100, 80)), (30, (100, 80)),
                           (32, (112, 112)), (30, (100, 80))]:
            before = ro.health()["stats"]
            assert ro.generate([greedy([ask(picture(seed, size), "?")], 2)])[0].ok
            seen.append(stats_since(ro, before)["image_cache_hits"])
            assert 0 < vision._held <= 0.25 * 2**20 and len(vision._cache) == 1
        assert seen == [0, 0, 0, 0, 1]  # 31 pushed 30 out; the big one pushed nothing out
        assert ro.health()["stats"] == {"images_processed": 4, "image_cache_hits": 1}


@pytest.mark.parametrize("value", [-1, "big", True, float("nan"), float("inf")])
def test_a_bad_image_cache_size_is_refused(vlm_dir, value):
    with pytest.raises(rollout.InvalidRequestError) as info:
        rollout.load_backend("hf", model=str(vlm_dir), image_cache_mb=value)
    assert info.value.field == "image_cache_mb" and "MiB" in info.value.allowed
