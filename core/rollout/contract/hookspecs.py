"""The rollout contract: the hooks a backend implements.

A backend is an object whose methods carry `@rollout.hookimpl`; each instance is registered
in its own plugin manager, so one answer per hook is wanted (`firstresult`). Required hooks:
`capabilities` and `generate`; the others may be left out when `capabilities()` lists them
as unsupported.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

    from rollout.kit.buckets import Bucket
    from rollout.contract.errors import RolloutError
    from rollout.contract.schemas import Capabilities, Request, Result

PROJECT = "rollout"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

REQUIRED = ("capabilities", "generate")


@hookspec(firstresult=True)
def capabilities() -> Capabilities:
    """Say what this backend supports here (and why not, for what it lacks)."""


@hookspec(firstresult=True)
def generate(requests: Sequence[Request]) -> list[list[Result] | RolloutError]:
    """Generate for a batch of valid requests.

    :param requests: validated requests; ids are unique within the batch.
    :return: one entry per request, in order: its `n` results in index order, or the
        RolloutError that stopped that request alone.
    """


@hookspec(firstresult=True)
def release(tags: tuple[str, ...]) -> None:
    """Free memory: `weights`, `kv_cache` or both. Called only while not generating."""


@hookspec(firstresult=True)
def resume(tags: tuple[str, ...]) -> None:
    """Bring released memory back; called with `weights` before `kv_cache`."""


@hookspec(firstresult=True)
def update_weights(buckets: Iterable[Bucket]) -> None:
    """Replace weights in place from buckets packed by `rollout.kit.buckets`.

    :param buckets: an iterator; each bucket holds whole tensors, in the trainer's order.
    """


@hookspec(firstresult=True)
def abort(request_ids: Sequence[str] | None) -> None:
    """Stop these running requests (all when None); they finish with reason `abort` and
    return what they generated so far. Unknown ids are ignored. May be called from
    another thread while `generate` runs."""


@hookspec(firstresult=True)
def close() -> None:
    """Stop the engine and free everything; the backend is not used again."""
