"""What `strict` promises, and how it is kept: a strict tool's call (and a JSON structured
output) validates against its schema, or the schema is refused up front.

Every built-in backend hands JSON schemas to xgrammar, whose grammar is not exact for every
schema. `prepare` runs before a schema reaches the grammar engine:

- what the grammar would get wrong and can be said another way is rewritten: a string
  bounded by `minLength`/`maxLength` alone compiles (xgrammar 0.2.7-0.2.8) to a rule that
  lets raw control characters through, so the string is invalid JSON; it becomes a
  `pattern` of the same lengths over the characters a JSON string may hold unescaped
  (no control character, `"` or backslash) and whose bytes the grammar matches exactly
  (the Basic Multilingual Plane less U+D000-U+DFFF), a subset of what the schema allows;
  `format: ipv4` (whose grammar takes leading zeros) an exact pattern;
- what the grammar would ignore or get wrong and cannot be said another way is refused, a
  400 naming the keyword (`REFUSED`, `FORMATS`, and the combinations in `_check`).

After sampling, `validate` checks every strict call against the tool's own schema
(`jsonschema`, with format checks); the parsers read arguments leniently (a raw control
character inside a string is read as that character) and write them back as canonical JSON.
"""

from __future__ import annotations

import functools
import json
import re

from rollout.contract.errors import InvalidRequestError

# Keywords the grammar engine ignores or treats as something else: refused in strict schemas.
REFUSED = {
    "oneOf": "the grammar treats oneOf as anyOf (it cannot hold a value to exactly one "
             "branch); use anyOf",
    "not": "the grammar ignores not",
    "if": "the grammar ignores if/then/else",
    "then": "the grammar ignores if/then/else",
    "else": "the grammar ignores if/then/else",
    "dependentRequired": "the grammar ignores dependentRequired",
    "dependentSchemas": "the grammar ignores dependentSchemas",
    "dependencies": "the grammar ignores dependencies",
    "contains": "the grammar does not enforce contains",
    "minContains": "the grammar does not enforce minContains",
    "maxContains": "the grammar does not enforce maxContains",
    "unevaluatedItems": "not supported",
}
# String formats the grammar writes (vLLM's xgrammar backend's list), less those it gets
# wrong: "date" and "date-time" take impossible days (2020-02-30), "ipv6" an embedded IPv4
# part with leading zeros (::ffff:1.2.3.04). "ipv4" (leading zeros too) becomes a pattern.
FORMATS = ("email", "time", "duration", "ipv4", "hostname", "uuid", "uri", "uri-reference",
           "uri-template", "json-pointer", "relative-json-pointer")
_WRONG = {"date": "the grammar takes impossible days (2020-02-30)",
          "date-time": "the grammar takes impossible days (2020-02-30)",
          "ipv6": "the grammar takes an embedded IPv4 part with leading zeros "
                  "(::ffff:1.2.3.04)"}
_OCTET = "(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_IPV4 = f"^({_OCTET}\\.){{3}}{_OCTET}$"
# Keys whose value is one subschema, a map of them, or a list of them.
_ONE = ("additionalProperties", "items", "propertyNames", "not", "if", "then", "else",
        "contains", "unevaluatedProperties", "unevaluatedItems", "additionalItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_LIST = ("anyOf", "allOf", "oneOf", "prefixItems", "items")
# What constrains a value besides enum/const (annotations and `type` aside).
_ANNOTATIONS = {"title", "description", "default", "examples", "$comment", "deprecated",
                "readOnly", "writeOnly", "enum", "const", "type", "$schema", "$id",
                "$defs", "definitions"}
UNKEPT = ", so what comes back could not be held to the schema"
# A literal quote or backslash in a pattern: the grammar writes it unescaped in the string.
_QUOTE_OR_BACKSLASH = re.compile(r'"|\\\\|\\x22|\\x5[cC]|\\u0022|\\u005[cC]')
# A character a JSON string holds unescaped: not a control character, quote or backslash;
# and one whose UTF-8 bytes the grammar matches exactly. A class spanning U+0800 (or the
# astral planes) takes overlong encodings too (E0 80 80), and a surrogate's bytes (ED A0
# 80): the text decodes them to three replacement characters, not one. So: the Basic
# Multilingual Plane, U+0800-U+0FFF as a branch of its own, less U+D000-U+DFFF (lead byte
# ED: xgrammar 0.2.7 takes it and then no continuation, a dead end).
_JSON_TEXT_CHAR = ('(?:[ !#-\\[\\]-~\\u0080-\\u07ff\\u1000-\\ucfff\\ue000-\\uffff]'
                   '|[\\u0800-\\u0fff])')
# Pattern parts that match any character, overlong encodings included, and a bound on how
# many: the grammar would count one malformed character where the text holds three.
_ANY_CHARACTER = re.compile(r"(?<!\\)\.|\[\^|\\[SWD]")


def prepare(schema: dict, where: str, refuse: bool = True) -> dict:
    """`schema` as the grammar engine should get it (rewritten where the grammar would let
    invalid JSON through); with `refuse`, an InvalidRequestError naming `where` + the
    keyword's path for what the grammar cannot hold a value to exactly."""
    try:  # (keys in their order: the model writes properties in the schema's order)
        key = json.dumps(schema)
    except (TypeError, ValueError):
        return schema  # not JSON: the engine refuses it, naming the field
    result = _prepared(key, refuse)
    if isinstance(result, tuple):
        path, message, allowed = result
        raise InvalidRequestError(where + path, message, allowed)
    return json.loads(result)


@functools.lru_cache(maxsize=256)  # an agent's turns send the same tools again and again
def _prepared(key: str, refuse: bool):
    schema = json.loads(key)
    try:
        return json.dumps(_walk(schema, "", refuse, schema))
    except _Refused as exc:
        return exc.args


class _Refused(Exception):
    pass


def _walk(node, path: str, refuse: bool, root):
    if not isinstance(node, dict):
        return node
    if refuse:
        _check(node, path, root)
    out = dict(node)
    for key in _ONE:
        if isinstance(node.get(key), dict):
            out[key] = _walk(node[key], f"{path}.{key}", refuse, root)
    for key in _MAP:
        if isinstance(node.get(key), dict):
            out[key] = {name: _walk(sub, f"{path}.{key}.{name}", refuse, root)
                        for name, sub in node[key].items()}
    for key in _LIST:
        if isinstance(node.get(key), list):
            out[key] = [_walk(sub, f"{path}.{key}[{i}]", refuse, root)
                        for i, sub in enumerate(node[key])]
    return _bounded_string(out)


def _types(node: dict) -> set:
    kind = node.get("type")
    return {kind} if isinstance(kind, str) else set(kind) if isinstance(kind, list) else set()


def _bounded_string(node: dict) -> dict:
    """A string held to lengths alone, as a pattern of those lengths over plain characters;
    an IPv4 address as a pattern without leading zeros."""
    if node.get("format") == "ipv4" and "string" in _types(node) and not any(
            k in node for k in ("pattern", "minLength", "maxLength", "enum", "const")):
        return {**{k: v for k, v in node.items() if k != "format"}, "pattern": _IPV4}
    bounded = "minLength" in node or "maxLength" in node
    if not bounded or any(k in node for k in ("pattern", "format", "enum", "const")):
        return node
    if "string" not in _types(node):
        return node  # lengths apply to strings only (a pattern too, so a type list is fine)
    low, high = node.get("minLength", 0), node.get("maxLength")
    if not isinstance(low, int) or not (high is None or isinstance(high, int)):
        return node  # the engine refuses it, naming it
    rest = {k: v for k, v in node.items() if k not in ("minLength", "maxLength")}
    return {**rest, "pattern": f"^{_JSON_TEXT_CHAR}{{{low},{'' if high is None else high}}}$"}


def _check(node: dict, path: str, root) -> None:
    """A _Refused for the first thing in `node` the grammar cannot hold a value to."""
    _check_keywords(node, path)
    _check_string(node, path)
    _check_object(node, path)
    _check_values(node, path)


def _refuse(path: str, key: str, message: str, allowed: str) -> None:
    raise _Refused(f"{path}.{key}", message, allowed)


def _check_keywords(node: dict, path: str) -> None:
    """Keywords the grammar ignores, or enforces only in part."""
    for key, why in REFUSED.items():
        if key in node:
            _refuse(path, key, f"{why}{UNKEPT}", f"a schema without {key}")
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        _refuse(path, "allOf", f"the grammar does not intersect several allOf branches"
                f"{UNKEPT}", "one branch, or the branches merged into one schema")
    if node.get("uniqueItems") is True:
        _refuse(path, "uniqueItems", f"the grammar does not enforce uniqueItems{UNKEPT}",
                "false, or left out")
    if "multipleOf" in node and _types(node) != {"integer"}:
        _refuse(path, "multipleOf", f"the grammar enforces multipleOf on integers only"
                f"{UNKEPT}", 'type "integer"')
    if node.get("unevaluatedProperties") not in (None, False):
        _refuse(path, "unevaluatedProperties", "not supported", "false, or left out")


def _check_string(node: dict, path: str) -> None:
    """A string's format, and its pattern: what the grammar writes for them must be valid
    JSON, and held to the lengths."""
    if "format" in node and node["format"] not in FORMATS:
        why = _WRONG.get(node["format"], "the grammar does not know it")
        _refuse(path, "format", f"format {node['format']!r}: {why}{UNKEPT}",
                ", ".join(FORMATS) + "; or a pattern")
    for key in ("pattern", "format"):
        if key in node and ("minLength" in node or "maxLength" in node):
            _refuse(path, key, f"the grammar ignores minLength/maxLength next to {key}",
                    f"{key} alone (with the lengths in the pattern), or the lengths alone")
    pattern = node.get("pattern")
    if isinstance(pattern, str) and _QUOTE_OR_BACKSLASH.search(pattern):
        _refuse(path, "pattern", "a literal quote or backslash in a pattern is written "
                "unescaped by the grammar (invalid JSON)", "a pattern without \" or \\\\")
    if isinstance(pattern, str) and "{" in pattern and _ANY_CHARACTER.search(pattern):
        _refuse(path, "pattern", "the grammar matches a malformed multi-byte character as "
                "one character of `.`, `[^...]`, `\\S`, `\\W` or `\\D` where the text holds "
                "three, so a bounded count could be broken", "explicit character classes "
                "([a-z], [0-9], ...) where a count is bounded")


def _check_object(node: dict, path: str) -> None:
    """Property keywords in combinations the grammar does not write."""
    if "patternProperties" in node and ("properties" in node
                                        or len(node["patternProperties"] or {}) > 1):
        _refuse(path, "patternProperties", "the grammar supports one patternProperties "
                "entry, without properties", "one entry and no properties")
    if "propertyNames" in node and any(k in node for k in ("properties", "patternProperties")):
        _refuse(path, "propertyNames", "the grammar does not combine propertyNames with "
                "properties", "propertyNames alone")
    required = node.get("required")
    if isinstance(required, list) and required:
        properties = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        missing = [name for name in required if name not in properties]
        if missing:
            _refuse(path, "required", f"{missing[0]!r} is required but not among properties "
                    "(the grammar writes only the properties named)", "required names that "
                    "are in properties")


def _check_values(node: dict, path: str) -> None:
    """enum/const values the rest of the schema would refuse (the grammar writes any of
    them), and a $ref outside the schema."""
    if ("enum" in node or "const" in node) and set(node) - _ANNOTATIONS:
        values = node["enum"] if "enum" in node else [node["const"]]
        rest = {k: v for k, v in node.items() if k not in ("enum", "const")}
        key = "enum" if "enum" in node else "const"
        if "$ref" in rest or not isinstance(values, list):
            _refuse(path, key, f"{key} next to $ref", f"{key} alone")
        bad = [v for v in values if validate(v, rest) is not None]
        if bad:
            _refuse(path, key, f"{bad[0]!r} breaks the keywords next to {key} (the grammar "
                    f"writes any {key} value)", "values valid against the rest of the schema")
    ref = node.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        _refuse(path, "$ref", f"{ref!r} is not a reference inside the schema", "#/$defs/NAME")


def validate(value, schema: dict) -> str | None:
    """Why `value` does not validate against `schema` (formats checked), or None."""
    import jsonschema

    try:
        validator = _validator(json.dumps(schema, sort_keys=True))
    except jsonschema.SchemaError as exc:
        return f"the schema is invalid: {exc.message}"
    error = jsonschema.exceptions.best_match(validator.iter_errors(value))
    if error is None:
        return None
    where = "".join(f"[{p!r}]" for p in error.absolute_path)
    return f"{where or 'the value'}: {error.message}"


@functools.lru_cache(maxsize=256)
def _validator(key: str):
    import jsonschema

    schema = json.loads(key)
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


def loads(text: str):
    """JSON as a grammar may write it: a raw control character inside a string is read as
    itself (json.loads refuses it), which canonical JSON then writes escaped."""
    return json.loads(text, strict=False)
