"""Finding backends: the entry-point group `rollout.backends`.

Only the chosen backend's module is imported. ROLLOUT_BLOCK_BACKENDS (comma-separated
names) hides backends, for example one whose import is broken.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from rollout.errors import PluginLoadError, UnknownBackendError

if TYPE_CHECKING:
    from importlib.metadata import EntryPoint

GROUP = "rollout.backends"
BLOCK_ENV = "ROLLOUT_BLOCK_BACKENDS"


def blocked() -> set[str]:
    return {name.strip() for name in os.environ.get(BLOCK_ENV, "").split(",") if name.strip()}


def available_backends() -> dict[str, list[EntryPoint]]:
    """Installed, unblocked backends by name (a name with two providers lists both)."""
    from importlib.metadata import entry_points

    found: dict[str, list[EntryPoint]] = {}
    for ep in entry_points(group=GROUP):
        if ep.name not in blocked():
            found.setdefault(ep.name, []).append(ep)
    return dict(sorted(found.items()))


def distribution_of(ep: EntryPoint) -> tuple[str, str]:
    dist = getattr(ep, "dist", None)
    return (dist.name, dist.version) if dist else ("?", "?")


def load_factory(name: str):
    """Import the backend called `name` and return its factory."""
    found = available_backends()
    if name not in found:
        installed = ", ".join(found) or "none"
        why = f" (blocked by {BLOCK_ENV})" if name in blocked() else ""
        raise UnknownBackendError(
            f"no backend named {name!r}{why}; installed backends: {installed}. "
            f'To add it: pip install "rollout-core[{name}]"'
        )
    providers = found[name]
    if len(providers) > 1:
        who = ", ".join(f"{distribution_of(ep)[0]} ({ep.value})" for ep in providers)
        raise PluginLoadError(f"backend {name!r} is provided twice: {who}; uninstall one")
    ep = providers[0]
    try:
        return ep.load()
    except Exception as exc:
        dist = distribution_of(ep)[0]
        raise PluginLoadError(
            f"backend {name!r} ({dist}, {ep.value}) failed to import: "
            f"{type(exc).__name__}: {exc}. Other backends are unaffected; "
            f"hide this one with {BLOCK_ENV}={name}"
        ) from exc
