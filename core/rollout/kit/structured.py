"""What every backend needs for structured outputs beyond its engine: a choice as a grammar,
and an engine's refusal of a constraint as the request's own error."""

from __future__ import annotations

import functools

from rollout.contract.errors import GenerationError, InvalidRequestError, RolloutError
from rollout.contract.schemas import StructuredOutputs

# An engine's refusal of a constraint says one of these (and names no field of ours).
CONSTRAINT_WORDS = ("grammar", "regex", "ebnf", "json", "schema", "choice", "structured",
                    "xgrammar")
_ESCAPES = {"\\": r"\\", '"': r"\"", "\n": r"\n", "\r": r"\r", "\t": r"\t"}


def choice_grammar(choices) -> str:
    """EBNF (xgrammar's GBNF dialect) whose language is exactly `choices`."""
    def escape(ch: str) -> str:
        if ch in _ESCAPES:
            return _ESCAPES[ch]
        return f"\\u{ord(ch):04x}" if ord(ch) < 0x20 or ord(ch) == 0x7F else ch

    return "root ::= " + " | ".join('"' + "".join(map(escape, c)) + '"' for c in choices)


def constraint_error(exc: RolloutError, structured: StructuredOutputs | None) -> RolloutError:
    """`exc` as an error naming the request's constraint field, when it is the engine's
    refusal of that constraint; otherwise `exc` itself."""
    if structured is None or not isinstance(exc, (InvalidRequestError, GenerationError)):
        return exc
    field = getattr(exc, "field", "")
    if not field.startswith("sampling.structured_outputs") and (
            field not in ("", "sampling")
            or not any(word in str(exc).lower() for word in CONSTRAINT_WORDS)):
        return exc
    message = str(exc).removeprefix(f"{field}: ") if field else str(exc)
    return InvalidRequestError(f"sampling.structured_outputs.{structured.kind}", message)


def structural_tag_grammar(tag: dict) -> str:
    """A structural tag (xgrammar's format) as EBNF in xgrammar's dialect, which every
    built-in backend compiles as a grammar. Its JSON schemas become compact JSON grammars
    first (a structural tag's own JSON allows any whitespace, on which a weak model loops).
    Raises the request's InvalidRequestError when xgrammar refuses the tag."""
    import json

    try:
        return _tag_grammar(json.dumps(tag, sort_keys=True))
    except Exception as exc:  # noqa: BLE001 - xgrammar raises its own, RuntimeError, ValueError
        message = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        raise InvalidRequestError("sampling.structured_outputs.structural_tag", message,
                                  "xgrammar's structural tag format") from None


@functools.lru_cache(maxsize=64)  # an agent's turns send the same tools again and again
def _tag_grammar(tag: str) -> str:
    import json

    import xgrammar

    return str(xgrammar.Grammar.from_structural_tag(json.dumps(_compact_json(json.loads(tag)))))


def _compact_json(node):
    """`node` with every plain JSON-schema part replaced by a compact JSON grammar."""
    if isinstance(node, list):
        return [_compact_json(item) for item in node]
    if not isinstance(node, dict):
        return node
    if node.get("type") == "json_schema" and node.get("style", "json") == "json" \
            and not node.get("any_order"):
        import json

        import xgrammar

        grammar = xgrammar.Grammar.from_json_schema(
            json.dumps(node["json_schema"]), any_whitespace=False, separators=(",", ":"))
        return {"type": "grammar", "grammar": str(grammar)}
    return {key: _compact_json(value) for key, value in node.items()}
