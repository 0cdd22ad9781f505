#!/usr/bin/env bash
# Usage: source scripts/env.sh NAME [extra requirement files...]
# Makes (or reuses) the virtual environment NAME for this clone and activates it.
# Each engine pins its own torch, so each gets its own environment. Environments live
# outside the clone, keyed by the hash of what they install, so a fresh clone with the same
# pins reuses them; this clone's rollout packages are then installed into it with --no-deps,
# so no package index is ever asked for a rollout-* name.
set -euo pipefail
name=$1; shift
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
reqs=("$root/requirements/$name.txt" "$@")
post="$root/requirements/$name.post.sh"
key=$( (cat "${reqs[@]}"; if [ -f "$post" ]; then cat "$post"; fi) | sha256sum | cut -c1-12)
venvs=${ROLLOUT_VENVS:-$HOME/.cache/rollout/venvs}
venv="$venvs/$name-$key"
if [ ! -f "$venv/.complete" ]; then
  echo "building environment $venv" >&2
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip >&2
  args=()
  for r in "${reqs[@]}"; do args+=(-r "$r"); done
  "$venv/bin/pip" install -q "${args[@]}" >&2
  if [ -f "$post" ]; then (source "$venv/bin/activate" && source "$post") >&2; fi
  touch "$venv/.complete"
fi
# shellcheck disable=SC1091
source "$venv/bin/activate"
