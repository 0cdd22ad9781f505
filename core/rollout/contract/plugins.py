"""Finding plugins: backends in the entry-point group `rollout.backends`, judges in
`rollout.judges`, tool-call parsers in `rollout.tool_parsers`.

Only the chosen plugin's module is imported. ROLLOUT_BLOCK_BACKENDS (comma-separated
names) hides backends, for example one whose import is broken.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from rollout.contract.errors import PluginLoadError, UnknownBackendError

if TYPE_CHECKING:
    from importlib.metadata import EntryPoint

GROUP = "rollout.backends"
JUDGE_GROUP = "rollout.judges"
BLOCK_ENV = "ROLLOUT_BLOCK_BACKENDS"


def blocked() -> set[str]:
    return {name.strip() for name in os.environ.get(BLOCK_ENV, "").split(",") if name.strip()}


def installed(group: str) -> dict[str, list[EntryPoint]]:
    """Installed plugins of an entry-point group by name (a name with two providers lists both)."""
    from importlib.metadata import entry_points

    found: dict[str, list[EntryPoint]] = {}
    for ep in entry_points(group=group):
        found.setdefault(ep.name, []).append(ep)
    return dict(sorted(found.items()))


def available_backends() -> dict[str, list[EntryPoint]]:
    """Installed, unblocked backends by name."""
    return {name: eps for name, eps in installed(GROUP).items() if name not in blocked()}


def distribution_of(ep: EntryPoint) -> tuple[str, str]:
    dist = getattr(ep, "dist", None)
    return (dist.name, dist.version) if dist else ("?", "?")


def load_factory(name: str):
    """Import the backend called `name` and return its factory."""
    found = available_backends()
    if name not in found:
        names = ", ".join(found) or "none"
        why = f" (blocked by {BLOCK_ENV})" if name in blocked() else ""
        raise UnknownBackendError(
            f"no backend named {name!r}{why}; installed backends: {names}. "
            f'To add it: pip install "rollout-core[{name}]"'
        )
    return load_one("backend", name, found[name],
                    f"Other backends are unaffected; hide this one with {BLOCK_ENV}={name}")


def load_one(kind: str, name: str, providers: list[EntryPoint], hint: str = ""):
    """Import the one provider of plugin `name`; PluginLoadError if it fails or is not one."""
    if len(providers) > 1:
        who = ", ".join(f"{distribution_of(ep)[0]} ({ep.value})" for ep in providers)
        raise PluginLoadError(f"{kind} {name!r} is provided twice: {who}; uninstall one")
    ep = providers[0]
    try:
        return ep.load()
    except Exception as exc:
        dist = distribution_of(ep)[0]
        raise PluginLoadError(
            f"{kind} {name!r} ({dist}, {ep.value}) failed to import: "
            f"{type(exc).__name__}: {exc}. {hint}".rstrip()
        ) from exc
