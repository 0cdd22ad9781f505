"""Backend options checked the same way on every engine."""

from __future__ import annotations

from collections.abc import Mapping

from rollout.contract.errors import InvalidRequestError


def engine_args(value, engine: str) -> dict:
    """`engine_args` as a dict (None: empty); InvalidRequestError for anything but a mapping,
    such as YAML given where the command line's `-o` takes JSON."""
    if not isinstance(value, Mapping | None):
        raise InvalidRequestError("engine_args", f"got {value!r}",
                                  f"a mapping of {engine} engine arguments (on the command "
                                  "line JSON: -o 'engine_args={\"max_num_seqs\": 64}')")
    return dict(value or {})
