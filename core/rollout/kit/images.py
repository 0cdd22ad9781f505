"""Loading the images of a request: PIL images in RGB, each with a content hash.

An image comes as a file path, a `data:` URL (base64), its encoded bytes or a PIL image
(`rollout.contract.schemas.ImageSource`); URLs of any other scheme are refused, nothing is
fetched. Limits are checked before anything is decoded where they can be. A bad image
fails its own request with an `InvalidRequestError` naming where it sits in the request.

PIL is imported on the first image, never by `import rollout`.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import os
import re
import threading
from collections import OrderedDict
from typing import Any

import attrs

# data_url sits in the contract layer (encoding a request to JSON needs it); it stays
# importable from here, where the rest of the image code is.
from rollout.contract.convert import data_url
from rollout.contract.errors import InvalidRequestError, UnknownImageError
from rollout.contract.schemas import ImagePart, Request

MAX_IMAGE_BYTES = 20 * 2**20  # an encoded image (a file, decoded data: URL, bytes)
MAX_IMAGE_PIXELS = 4096 * 4096  # width x height, checked before decoding
ALLOWED = (f"a PNG, JPEG, WebP, GIF or BMP image of at most {MAX_IMAGE_BYTES // 2**20} MiB "
           f"and {MAX_IMAGE_PIXELS} pixels, as a file path, a data: URL (base64), bytes, or "
           "a PIL image; other URLs are not fetched")
_SCHEME = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")


@attrs.frozen
class PromptImage:
    """One loaded image of a prompt, as a backend gets it (the `images` of `generate`)."""

    image: Any = attrs.field(repr=False)  # a PIL.Image.Image in RGB
    # sha256 of its pixels: the same picture from a file, a data: URL or bytes has the same
    # id, for engines that cache images by id (vLLM's multi_modal_uuids, SGLang's radix cache).
    id: str


def image_sources(request: Request) -> list[tuple[str, Any, str | None]]:
    """(field, source, uuid) of every image of a request, in prompt order; the source is
    None for an image sent before under its uuid."""
    if request.messages is None:
        uuids = request.image_uuids or (None,) * len(request.images)
        return [(f"images[{k}]", source, uuid)
                for k, (source, uuid) in enumerate(zip(request.images, uuids))]
    return message_image_sources(request.messages)


def message_image_sources(messages) -> list[tuple[str, Any, str | None]]:
    """(field, source, uuid) of every image part of chat messages, in order."""
    return [(f"messages[{i}].content[{j}]", part.image, part.uuid)
            for i, message in enumerate(messages)
            if not isinstance(message.content, str)
            for j, part in enumerate(message.content) if isinstance(part, ImagePart)]


def refuse_paths(request: Request) -> Request:
    """A request from a client over HTTP: its images must come with it (`data:` URLs); a
    server reads no file of its own disk for a client."""
    for field, source, _ in image_sources(request):
        if isinstance(source, str) and not source.startswith("data:"):
            raise InvalidRequestError(field, "a file path or URL; a server reads no files "
                                      "for its clients", "a data: URL (base64)")
    return request


class ImageStore:
    """The images recently loaded here, by uuid, so that a later turn may name an earlier
    image by its uuid instead of sending its pixels again. Least recently used first out,
    bounded by the decoded size (RGB bytes)."""

    def __init__(self, max_bytes: int = 1 << 30):
        self.max_bytes = max_bytes
        self._images: OrderedDict[str, PromptImage] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()  # loads run on worker threads

    def load(self, request: Request) -> tuple[PromptImage, ...]:
        """Every image of the request, loaded or found by its uuid (this decodes: call it
        off the event loop)."""
        loaded = []
        for field, source, uuid in image_sources(request):
            if source is None:
                loaded.append(self._get(uuid, field))
            else:
                image = load_image(source, field, uuid)
                self._put(image)
                loaded.append(image)
        return tuple(loaded)

    @property
    def held_bytes(self) -> int:
        return self._bytes

    def _get(self, uuid: str, field: str) -> PromptImage:
        with self._lock:
            image = self._images.get(uuid)
            if image is not None:
                self._images.move_to_end(uuid)
                return image
        raise UnknownImageError(field, f"no image with uuid {uuid!r} is held here (never "
                                "sent here, or evicted)", "the image itself with its uuid; "
                                "the uuid alone only for an image sent before")

    def _put(self, image: PromptImage) -> None:
        size = _size(image)
        if size > self.max_bytes:
            return
        with self._lock:
            old = self._images.pop(image.id, None)
            if old is not None:
                self._bytes -= _size(old)
            self._images[image.id] = image
            self._bytes += size
            while self._bytes > self.max_bytes:
                self._bytes -= _size(self._images.popitem(last=False)[1])


class EncodedImages:
    """Images as PNG data: URLs, kept by id (least recently used out, bounded in bytes):
    an engine behind HTTP that needs every image of every turn encodes each one once."""

    def __init__(self, max_bytes: int = 256 << 20):
        self.max_bytes = max_bytes
        self._urls: OrderedDict[str, str] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()  # encodings run on worker threads

    def url(self, image: PromptImage) -> str:
        with self._lock:
            url = self._urls.get(image.id)
            if url is not None:
                self._urls.move_to_end(image.id)
                return url
        url = data_url(image.image)  # outside the lock: encoding takes a while
        with self._lock:
            if image.id not in self._urls and len(url) <= self.max_bytes:
                self._urls[image.id] = url
                self._bytes += len(url)
                while self._bytes > self.max_bytes:
                    self._bytes -= len(self._urls.popitem(last=False)[1])
        return url


def _size(image: PromptImage) -> int:
    width, height = image.image.size
    return width * height * 3


def load_images(request: Request) -> tuple[PromptImage, ...]:
    """Every image of the request, loaded (this decodes: call it off the event loop). An
    image named by its uuid alone needs an `ImageStore`."""
    return ImageStore(0).load(request)


def load_image(source: Any, field: str, uuid: str | None = None) -> PromptImage:
    """One image; its id is `uuid` if given (the caller vouches that it names this
    picture, as vLLM's uuids), else the sha256 of its pixels."""
    from PIL import Image

    if isinstance(source, Image.Image):
        _check_pixels(source.size, field)
        image = source.convert("RGB")
    else:
        data = _read(source, field)
        try:
            with Image.open(io.BytesIO(data)) as opened:
                _check_pixels(opened.size, field)  # from the header, before decoding
                image = opened.convert("RGB")
        except InvalidRequestError:
            raise
        except Exception as exc:  # noqa: BLE001 - PIL raises many kinds on a bad file
            raise InvalidRequestError(field, f"not a readable image ({exc})", ALLOWED) from None
    if uuid is not None:
        return PromptImage(image, uuid)
    digest = hashlib.sha256(f"{image.mode}{image.size}".encode())
    digest.update(image.tobytes())
    return PromptImage(image, digest.hexdigest())


def _read(source: Any, field: str) -> bytes:
    if isinstance(source, (bytes, bytearray)):
        data = bytes(source)
    elif source.startswith("data:"):
        data = _from_data_url(source, field)
    elif match := _SCHEME.match(source):
        raise InvalidRequestError(field, f"a {match.group(1)}:// URL; images are not fetched",
                                  ALLOWED)
    else:
        data = _from_file(source, field)
    if len(data) > MAX_IMAGE_BYTES:
        raise InvalidRequestError(field, f"{len(data)} bytes is too large", ALLOWED)
    return data


def _from_data_url(url: str, field: str) -> bytes:
    header, comma, payload = url[len("data:"):].partition(",")
    if not comma or not header.endswith(";base64"):
        raise InvalidRequestError(field, "a data: URL that is not base64", ALLOWED)
    payload = "".join(payload.split())
    if len(payload) * 3 // 4 > MAX_IMAGE_BYTES + 2:  # too large, without decoding it
        raise InvalidRequestError(field, f"about {len(payload) * 3 // 4} bytes is too large",
                                  ALLOWED)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidRequestError(field, f"bad base64 in the data: URL ({exc})",
                                  ALLOWED) from None


def _from_file(path: str, field: str) -> bytes:
    try:
        size = os.path.getsize(path)
        if size > MAX_IMAGE_BYTES:
            raise InvalidRequestError(field, f"{size} bytes is too large", ALLOWED)
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise InvalidRequestError(field, f"cannot read the file {path!r} "
                                  f"({exc.strerror or exc})", ALLOWED) from None


def _check_pixels(size: tuple[int, int], field: str) -> None:
    width, height = size
    if width * height > MAX_IMAGE_PIXELS:
        raise InvalidRequestError(field, f"{width}x{height} pixels is too large", ALLOWED)
