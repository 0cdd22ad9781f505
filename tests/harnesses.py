"""Real agent harnesses for tests/test_harnesses_live.py: Claude Code and Codex CLI, pinned,
installed from npm into a cache folder outside the clone (keyed by the pins, so a second run
installs nothing). (The proxy that sees every call they make: rollout.testing.proxy.)

`python tests/harnesses.py` installs them (scripts/test.sh does) and prints the folder.
Standard library only."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

PACKAGES = {"@anthropic-ai/claude-code": "2.1.328", "@openai/codex": "0.169.0"}
CACHE = Path(os.environ.get("ROLLOUT_NPM_CACHE", Path.home() / ".cache" / "rollout" / "npm"))
INSTALL_TIMEOUT_S = 600
DONE = ".installed"  # written once every package is in place


class NoNpm(RuntimeError):
    """npm or node is not on PATH: the harnesses cannot be installed here."""


def folder() -> Path:
    specs = " ".join(f"{name}@{version}" for name, version in sorted(PACKAGES.items()))
    key = hashlib.sha256(f"{specs} {sys.platform} {platform.machine()}".encode()).hexdigest()
    return CACHE / key[:16]


def install() -> Path:
    """The folder holding both packages, installed on first use. NoNpm where npm or node is
    missing; a failed install raises (CalledProcessError, TimeoutExpired)."""
    target = folder()
    if (target / DONE).exists():
        return target
    missing = [tool for tool in ("npm", "node") if shutil.which(tool) is None]
    if missing:
        raise NoNpm(f"{' and '.join(missing)} not on PATH: cannot install "
                    f"{', '.join(f'{n}@{v}' for n, v in PACKAGES.items())}")
    CACHE.mkdir(parents=True, exist_ok=True)
    # Installed beside the target, then renamed: a run that dies half way leaves no folder
    # that looks installed, and two runs at once do not mix their files.
    staging = Path(tempfile.mkdtemp(prefix=f"{target.name}.", dir=CACHE))
    try:
        subprocess.run(["npm", "install", "--prefix", str(staging), "--no-audit", "--no-fund",
                        "--no-save", "--loglevel=error",
                        *(f"{name}@{version}" for name, version in PACKAGES.items())],
                       check=True, timeout=INSTALL_TIMEOUT_S, stdin=subprocess.DEVNULL)
        claude_binary(staging), codex_binary(staging)  # (each raises where it is absent)
        (staging / DONE).write_text(json.dumps(PACKAGES))
        try:
            staging.rename(target)
        except OSError:  # another run finished first
            if not (target / DONE).exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _one(pattern: str, root: Path) -> Path:
    found = sorted(p for p in root.glob(pattern) if p.is_file())
    if not found:
        raise FileNotFoundError(f"no {pattern} under {root}: the platform's package of the "
                                "CLI was not installed")
    return found[0]


def claude_binary(root: Path) -> Path:
    """Claude Code's native binary (its optional platform package; the wrapper's postinstall,
    which npm may not run, only links it)."""
    return _one("node_modules/@anthropic-ai/claude-code-*/claude", root)


def codex_binary(root: Path) -> Path:
    return _one("node_modules/@openai/codex-*/vendor/*/bin/codex", root)


if __name__ == "__main__":
    print(install())
