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
        ("messages[0].content[0]", "a.png"), ("messages[0].content[2]", b"b"),
        ("messages[2].content[0]", "data:;base64,Yw==")]
    tokens = Request(prompt_token_ids=[1, 2], images=[b"x", PICTURE])
    assert images.image_sources(tokens) == [("images[0]", b"x"), ("images[1]", PICTURE)]


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
    assert message["content"][0] == {"type": "image", "image": url}
    for refused in ("http://example.com/cat.png", "/etc/hosts"):
        with pytest.raises(openai_api.ApiError) as info:
            openai_api._message({"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": refused}}]}, "messages[0]")
        assert info.value.param == "messages[0].content[0].image_url"
        assert "data: URL" in info.value.message
