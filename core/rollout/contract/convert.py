"""Converting schemas to and from plain dicts and JSON, strictly.

Unknown keys and values of the wrong type are errors (a typo in a request must not be
silently ignored), reported as one InvalidRequestError naming the field path.
"""

from __future__ import annotations

import base64
import io
import json
from typing import Any, Literal, TypeVar

import attrs
import cattrs
import cattrs.gen
from cattrs.errors import (
    AttributeValidationNote,
    ForbiddenExtraKeysError,
    IterableValidationNote,
)

from rollout.contract import errors
from rollout.contract.schemas import PART_TYPES, Content, ContentPart, ImageSource, Result

T = TypeVar("T")

converter = cattrs.Converter(forbid_extra_keys=True)


def _strict(kind: type, allowed: str):
    def structure(value, _):
        if type(value) is bool and kind is not bool:
            raise TypeError(f"got {value!r}, expected {allowed}")
        if kind is float and isinstance(value, int):
            return float(value)
        if not isinstance(value, kind):
            raise TypeError(f"got {value!r}, expected {allowed}")
        return value

    return structure


for _kind, _allowed in ((int, "an integer"), (float, "a number"), (str, "a string"),
                        (bool, "true or false")):
    converter.register_structure_hook(_kind, _strict(_kind, _allowed))
converter.register_structure_hook(dict, _strict(dict, "a mapping"))


def _fast_int_tuple():
    """Token ids as plain ints, taken whole: cattrs' own hook checks them one call per
    token (most of a request's structuring time). Anything else goes to that hook, for its
    errors naming the item."""
    checked = converter.get_structure_hook(tuple[int, ...])

    def structure(value, cls):
        if type(value) in (list, tuple) and set(map(type, value)) <= {int}:
            return tuple(value)
        return checked(value, cls)

    return structure


converter.register_structure_hook_func(lambda t: t == tuple[int, ...], _fast_int_tuple())


def _structure_part(value, _) -> ContentPart:
    if not isinstance(value, dict) or value.get("type") not in PART_TYPES:
        raise errors.InvalidRequestError("type", f"got {value!r}", ", ".join(PART_TYPES))
    return converter.structure(value, PART_TYPES[value["type"]])


def _structure_content(value, _):
    if isinstance(value, str):
        return value
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"got {value!r}, expected text or a list of parts")
    parts = []
    for i, part in enumerate(value):
        try:
            parts.append(converter.structure(part, ContentPart))
        except Exception as exc:  # a part's own check comes wrapped by cattrs
            inner = _as_invalid(exc, [])
            raise errors.InvalidRequestError(
                f"[{i}].{inner.field}", inner.detail, inner.allowed) from None
    return tuple(parts)


def _structure_logit_bias(value, _) -> dict[int, float]:
    """Token id -> bias; JSON object keys are strings, so "42" is token 42."""
    if not isinstance(value, dict):
        raise TypeError(f"got {value!r}, expected a mapping of token id to bias")
    out = {}
    for key, bias in value.items():
        token = int(key) if isinstance(key, str) and key.isdigit() else key
        if type(token) is not int:
            raise errors.InvalidRequestError(str(key), "not a token id", "integers >= 0 as keys")
        if type(bias) is bool or not isinstance(bias, (int, float)):
            raise errors.InvalidRequestError(str(key), f"got {bias!r}", "a number")
        out[token] = float(bias)
    return out


def _unstructure_image(value) -> str | None:
    """Bytes and PIL images travel (to a server, in JSON) as data: URLs; text as it is;
    None (an image sent before, named by its uuid) as null."""
    if value is None or isinstance(value, str):
        return value
    return data_url(value)


def data_url(source: Any) -> str:
    """An image's bytes or a PIL image as a data: URL (PNG for a PIL image).

    It lives here, in the contract layer, because turning a request into JSON needs it;
    `rollout.kit.images` re-exports it for the code that loads and caches images."""
    if isinstance(source, (bytes, bytearray)):
        return "data:application/octet-stream;base64," + base64.b64encode(source).decode()
    buffer = io.BytesIO()
    source.save(buffer, format="PNG")  # a PIL image; PIL itself need not be imported here
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


converter.register_structure_hook(ContentPart, _structure_part)
# Checked by the schemas (`is_image_source`): a string from JSON, or bytes or a PIL image
# from Python.
converter.register_structure_hook(ImageSource, lambda value, _: value)
converter.register_unstructure_hook(ImageSource, _unstructure_image)
converter.register_structure_hook_func(lambda t: t == dict[int, float], _structure_logit_bias)
converter.register_structure_hook_func(lambda t: t == Content, _structure_content)
converter.register_unstructure_hook(errors.RolloutError, lambda e: e.to_dict())


def _as_is_or_structured(cls: type):
    """A schema object in a request given from Python (a Result to continue from) is taken
    as it is; a dict is structured."""
    structured = cattrs.gen.make_dict_structure_fn(cls, converter,
                                                   _cattrs_forbid_extra_keys=True)
    return lambda value, _: value if isinstance(value, cls) else structured(value, cls)


converter.register_structure_hook(Result, _as_is_or_structured(Result))
converter.register_structure_hook(
    errors.RolloutError, lambda d, _: errors.from_dict(d) if isinstance(d, dict) else d
)


def structure(data: Any, cls: type[T]) -> T:
    """Build `cls` from plain data; raise InvalidRequestError naming the bad field."""
    try:
        return converter.structure(data, cls)
    except Exception as exc:  # cattrs wraps field errors in exception groups
        raise _as_invalid(exc, []) from None


def unstructure(obj: Any) -> Any:
    return converter.unstructure(obj)


def to_json(obj: Any) -> str:
    return json.dumps(unstructure(obj))


def from_json(text: str | bytes, cls: type[T]) -> T:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise errors.InvalidRequestError("body", f"not valid JSON: {exc}") from None
    return structure(data, cls)


def _as_invalid(exc: BaseException, path: list[str]) -> errors.InvalidRequestError:
    if isinstance(exc, errors.InvalidRequestError):
        # A check on a whole nested object names the object itself: no "x.x".
        field = path if path[-1:] == [exc.field] else path + [exc.field]
        return errors.InvalidRequestError(_join(field), exc.detail, exc.allowed)
    if isinstance(exc, ForbiddenExtraKeysError):
        names = [a.name for a in attrs.fields(exc.cl)] if attrs.has(exc.cl) else []
        extra = sorted(exc.extra_fields)
        return errors.InvalidRequestError(
            _join(path + [extra[0]]), "unknown field", ", ".join(names) or None
        )
    if isinstance(exc, BaseExceptionGroup):
        # Report the first failing field; cattrs' notes on it say where it sits.
        inner = exc.exceptions[0]
        step = []
        for note in getattr(inner, "__notes__", []):
            if isinstance(note, AttributeValidationNote):
                step.append(note.name)
            elif isinstance(note, IterableValidationNote):
                step.append(f"[{note.index}]")
        return _as_invalid(inner, path + step)
    where = _join(path) or "request"
    if isinstance(exc, KeyError):
        key = str(exc.args[0])
        return errors.InvalidRequestError(_join(path if path[-1:] == [key] else path + [key]),
                                          "missing")
    if isinstance(exc, AttributeError) and not path:
        return errors.InvalidRequestError(where, "must be an object (a mapping of fields)")
    literal = getattr(exc, "__notes__", None) and _literal_values(exc)
    message = "not one of the allowed values" if literal else str(exc) or type(exc).__name__
    return errors.InvalidRequestError(where, message, literal or None)


def _literal_values(exc: BaseException) -> str:
    for note in exc.__notes__:
        values = getattr(getattr(note, "type", None), "__args__", ())
        if values and getattr(note.type, "__origin__", None) is Literal:
            return ", ".join(map(str, values))
    return ""


def _join(parts: list[str]) -> str:
    out = ""
    for part in parts:
        out += part if part.startswith("[") or not out else "." + part
    return out
