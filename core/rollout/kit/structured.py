"""What every backend needs for structured outputs beyond its engine: a choice as a grammar,
and an engine's refusal of a constraint as the request's own error."""

from __future__ import annotations

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
