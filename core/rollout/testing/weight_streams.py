"""Weight streams for update tests: a trainer that goes away in the middle of an update."""

from __future__ import annotations

from collections.abc import Iterator, Mapping


def trainer_that_dies(weights: Mapping, sent: int | None = None) -> Iterator[tuple]:
    """The (name, tensor) pairs of `weights` as a trainer sends them, stopping with
    ConnectionResetError after `sent` of them (half by default): an update fails midway,
    after part of the model (some whole layers, in file order) went out."""
    pairs = list(weights.items())
    yield from pairs[: len(pairs) // 2 if sent is None else sent]
    raise ConnectionResetError("the trainer went away")
