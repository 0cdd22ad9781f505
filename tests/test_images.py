"""Images in requests without a model: the schemas, JSON, loading and its limits.

The HF backend's tests (plugins/hf_backend/tests/test_hf_images.py) generate from images on a
real tiny Qwen2-VL."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from rollout import ImagePart, InvalidRequestError, Message, Request
from rollout.apps.serving import openai_api
from rollout.contract import convert
from rollout.kit import images


def png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


PICTURE = Image.new("RGB", (30, 20), (200, 10, 50))


def test_every_source_loads_the_same_rgb_image(tmp_path):
    data = png(PICTURE)
    path = tmp_path / "p.png"
    path.write_bytes(data)
    sources = [PICTURE, PICTURE.convert("RGBA"), data, bytearray(data), str(path),
               images.data_url(data), images.data_url(PICTURE)]
    loaded = [images.load_image(s, "x") for s in sources]
    assert {im.id for im in loaded} == {loaded[0].id}
    assert all(im.image.mode == "RGB" and im.image.size == (30, 20) for im in loaded)
    other = images.load_image(Image.new("RGB", (30, 20), (0, 0, 0)), "x")
    assert other.id != loaded[0].id


@pytest.mark.parametrize("source, detail", [
    ("http://example.com/cat.png", "images are not fetched"),
    ("https://example.com/cat.png", "images are not fetched"),
    ("file:///etc/hosts", "images are not fetched"),
    ("data:image/png,rawtext", "not base64"),
    ("data:image/png;base64,!!!!", "bad base64"),
    (b"GIF89a but not really", "not a readable image"),
    ("/no/such/file.png", "cannot read the file"),
])
def test_bad_sources_name_their_field(source, detail):
    with pytest.raises(InvalidRequestError) as info:
        images.load_image(source, "messages[2].content[1]")
    assert info.value.field == "messages[2].content[1]"
    assert detail in info.value.detail
    assert "data: URL" in info.value.allowed


def test_limits_are_checked_before_decoding(monkeypatch):
    wide = Image.new("1", (4097, 4097))  # compresses to a few kB; 16.8 M pixels
    with pytest.raises(InvalidRequestError, match="4097x4097 pixels is too large"):
        images.load_image(png(wide), "images[0]")
    monkeypatch.setattr(images, "MAX_IMAGE_BYTES", 100)
    with pytest.raises(InvalidRequestError, match="bytes is too large"):
        images.load_image(png(PICTURE) + b"\0" * 100, "images[0]")
    with pytest.raises(InvalidRequestError, match="too large"):
        images.load_image(images.data_url(b"\0" * 1000), "images[0]")


def test_sources_in_prompt_order():
    request = convert.structure({"messages": [
        {"role": "user", "content": [{"type": "image", "image": "a.png"},
                                     {"type": "text", "text": "and"},
                                     {"type": "image", "image": b"b"}]},
        {"role": "assistant", "content": "ok"},
        {"role": "tool", "content": [{"type": "image", "image": "data:;base64,Yw=="}],
         "tool_call_id": "c1"}]}, Request)
    assert images.image_sources(request) == [
        ("messages[0].content[0]", "a.png", None), ("messages[0].content[2]", b"b", None),
        ("messages[2].content[0]", "data:;base64,Yw==", None)]
    tokens = Request(prompt_token_ids=[1, 2], images=[b"x", PICTURE])
    assert images.image_sources(tokens) == [("images[0]", b"x", None),
                                            ("images[1]", PICTURE, None)]
    named = Request(prompt_token_ids=[1, 2], images=[None, PICTURE], image_uuids=["a", None])
    assert images.image_sources(named) == [("images[0]", None, "a"),
                                           ("images[1]", PICTURE, None)]


def test_schemas_check_images():
    with pytest.raises(InvalidRequestError, match="image"):
        ImagePart(image=3)
    with pytest.raises(InvalidRequestError) as info:
        convert.structure({"prompt": "hi", "images": ["a.png"]}, Request)
    assert info.value.field == "images" and "prompt_token_ids" in info.value.allowed
    with pytest.raises(InvalidRequestError) as info:
        convert.structure({"prompt_token_ids": [1], "images": ["a.png", 7]}, Request)
    assert info.value.field == "images[1]"
    with pytest.raises(InvalidRequestError) as info:
        convert.structure({"messages": [{"role": "user", "content": [
            {"type": "image", "image": ""}]}]}, Request)
    assert info.value.field == "messages[0].content[0].image"


def test_bytes_and_pil_images_travel_as_data_urls():
    request = Request(messages=[Message("user", [ImagePart(png(PICTURE)), ImagePart(PICTURE)])])
    data = convert.unstructure(request)
    sent = [p["image"] for p in data["messages"][0]["content"]]
    assert all(s.startswith("data:") for s in sent)
    again = convert.from_json(convert.to_json(request), Request)
    loaded = images.load_images(again)
    assert loaded[0].id == loaded[1].id == images.load_image(PICTURE, "x").id


def test_openai_image_url_parts_take_data_urls_only():
    url = images.data_url(png(PICTURE))
    message = openai_api._message({"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "what?"}]},
        "messages[0]")
    assert message["content"][0] == {"type": "image", "image": url, "uuid": None}
    for refused in ("http://example.com/cat.png", "/etc/hosts"):
        with pytest.raises(openai_api.ApiError) as info:
            openai_api._message({"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": refused}}]}, "messages[0]")
        assert info.value.param == "messages[0].content[0].image_url"
        assert "data: URL" in info.value.message


def test_openai_image_parts_take_vllms_uuid():
    url = images.data_url(png(PICTURE))
    sent = openai_api._message({"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}, "uuid": "cat"},
        {"type": "image_url", "uuid": "dog"}]}, "messages[0]")["content"]
    assert sent == [{"type": "image", "image": url, "uuid": "cat"},
                    {"type": "image", "image": None, "uuid": "dog"}]
    for part, param in (({"type": "image_url", "uuid": ""}, "uuid"),
                        ({"type": "image_url"}, "image_url"),
                        ({"type": "image_url", "image_url": {"url": url}, "detail": "x"},
                         "detail")):
        with pytest.raises(openai_api.ApiError) as info:
            openai_api._message({"role": "user", "content": [part]}, "messages[0]")
        assert info.value.param == f"messages[0].content[0].{param}"


def test_an_image_sent_once_is_named_by_its_uuid_later():
    store = images.ImageStore()
    first = Request(prompt_token_ids=[1, 2], images=[png(PICTURE)], image_uuids=["cat"])
    (loaded,) = store.load(first)
    assert loaded.id == "cat"  # the caller's uuid names it, as in vLLM
    later = Request(prompt_token_ids=[1, 2, 3], images=[None, PICTURE],
                    image_uuids=["cat", None])
    again, new = store.load(later)
    assert again is loaded and new.id == images.load_image(PICTURE, "x").id
    # By its content hash as well, in messages.
    message = Request(messages=[Message("user", [ImagePart(None, uuid=new.id)])])
    assert store.load(message)[0] is new
    with pytest.raises(images.UnknownImageError) as info:
        store.load(Request(prompt_token_ids=[1], images=[None], image_uuids=["dog"]))
    assert info.value.field == "images[0]" and "dog" in info.value.detail
    assert isinstance(info.value, InvalidRequestError)


def test_the_image_store_forgets_the_least_recently_used_first():
    size = PICTURE.size[0] * PICTURE.size[1] * 3
    store = images.ImageStore(max_bytes=2 * size)
    pictures = [Image.new("RGB", PICTURE.size, (k, 0, 0)) for k in range(3)]
    for k, picture in enumerate(pictures):
        store.load(Request(prompt_token_ids=[1], images=[picture], image_uuids=[f"p{k}"]))
        if k == 1:  # p0 used again: p1 is now the oldest
            store.load(Request(prompt_token_ids=[1], images=[None], image_uuids=["p0"]))
    store.load(Request(prompt_token_ids=[1], images=[None], image_uuids=["p0"]))
    with pytest.raises(images.UnknownImageError):
        store.load(Request(prompt_token_ids=[1], images=[None], image_uuids=["p1"]))
    assert store.held_bytes <= 2 * size


def test_unknown_image_errors_keep_their_kind_over_http():
    from rollout.service.client import _typed_refusal
    from rollout.contract.errors import from_dict

    error = images.UnknownImageError("images[1]", "no image with uuid 'x'", "send it")
    assert type(from_dict(error.to_dict())) is images.UnknownImageError
    body = openai_api.api_error(error).body()
    again = _typed_refusal("http://replica", 400, body)
    assert type(again) is images.UnknownImageError and again.field == "images[1]"


def test_encoded_images_are_kept_by_id_within_their_bound():
    pictures = [images.load_image(Image.new("RGB", (30, 20), (k, 9, 9)), "x") for k in range(3)]
    one = len(images.data_url(pictures[0].image))
    encoded = images.EncodedImages(max_bytes=2 * one)
    first = encoded.url(pictures[0])
    assert encoded.url(pictures[0]) is first  # encoded once
    assert images.load_image(first, "x").id == pictures[0].id  # lossless
    encoded.url(pictures[1])
    encoded.url(pictures[2])  # the oldest goes
    assert encoded.url(pictures[0]) is not first
