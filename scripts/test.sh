#!/usr/bin/env bash
# Install every test environment and run the whole test suite. Exits non-zero when a
# test fails. Pass pytest arguments after the script name to narrow a run.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# tests/test_operability.py scrapes the server with a real Prometheus server (Debian's).
if ! command -v prometheus >/dev/null; then
  sudo=$([ "$(id -u)" = 0 ] || echo sudo)
  $sudo apt-get update -qq
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    prometheus >/dev/null
fi

# One environment per engine, each pinning its own torch (scripts/env.sh). The HF one also
# holds Ray and the OpenAI Agents SDK, whose Python is the client of the other engines'
# servers too; the vLLM one holds TRL (its vLLM client and its trainer through
# rollout.integrations.trl), Ray and PEFT; verl's has its own because verl pins
# transformers below 5.11.
HF=(hf requirements/test.txt requirements/ray.txt requirements/agents.txt)
VERL=(verl requirements/test.txt)
VLLM=(vllm requirements/test.txt requirements/trl.txt requirements/ray.txt requirements/peft.txt)
SGLANG=(sglang requirements/test.txt requirements/trl.txt)

# Every environment is built and given this clone's packages (--no-deps: no index is asked
# for a rollout-* name) before any test runs, so the test steps below only read them.
python_of() { (source scripts/env.sh "$@" && command -v python); }
ROLLOUT_AGENTS_PYTHON=$(python_of "${HF[@]}")
ROLLOUT_VLLM_PYTHON=$(python_of "${VLLM[@]}")
# verifiers' own (it pins openai<3), run as a program by tests/test_harnesses_python.py.
ROLLOUT_VERIFIERS_PYTHON=$(python_of verifiers)
export ROLLOUT_AGENTS_PYTHON ROLLOUT_VLLM_PYTHON ROLLOUT_VERIFIERS_PYTHON
"$ROLLOUT_AGENTS_PYTHON" -m pip install -q --no-deps -e . -e plugins/hf_backend -e plugins/example_backend
"$(python_of "${VERL[@]}")" -m pip install -q --no-deps -e . -e plugins/hf_backend
"$ROLLOUT_VLLM_PYTHON" -m pip install -q --no-deps -e . -e plugins/hf_backend -e plugins/vllm_backend
"$(python_of "${SGLANG[@]}")" -m pip install -q --no-deps -e . -e plugins/hf_backend -e plugins/sglang_backend

# Claude Code and Codex CLI, pinned, from npm into ~/.cache/rollout/npm (once per pin; see
# tests/harnesses.py) for tests/test_harnesses_live.py, which is skipped without npm or node.
if command -v npm >/dev/null && command -v node >/dev/null; then
  "$ROLLOUT_AGENTS_PYTHON" tests/harnesses.py
else
  echo "npm or node missing: tests/test_harnesses_live.py will be skipped" >&2
fi

# The core; then the HF backend (transformers) and the example backend of
# docs/writing-a-backend.md.
core_tests() (
  source scripts/env.sh "${HF[@]}" &&
    python -m pytest tests --durations=30 "$@"
)
hf_tests() (
  source scripts/env.sh "${HF[@]}" &&
    python -m pytest plugins/hf_backend/tests plugins/example_backend/tests --durations=30 "$@"
)
# verl's own rollout interfaces driving rollout (rollout.integrations.verl) on a local Ray
# cluster.
verl_tests() (
  source scripts/env.sh "${VERL[@]}" &&
    python -m pytest tests/test_integrations_verl.py --durations=30 "$@"
)
# The vLLM backend on the real engine (CPU build); the HF backend beside it for the
# cross-engine comparison. In two steps of about equal length, so that neither worker
# waits for the other's one long step: the modules below, and the rest (which holds every
# module that shares the session's engines: conftest.shared_vllm).
VLLM_FIRST=(test_real_model.py test_server_contract.py test_trl_grpo.py test_grpo_example.py
            test_async_contract.py test_ray_cluster.py)
vllm_first_tests() (
  source scripts/env.sh "${VLLM[@]}" &&
    python -m pytest "${VLLM_FIRST[@]/#/plugins/vllm_backend/tests/}" --durations=30 "$@"
)
vllm_rest_tests() (
  source scripts/env.sh "${VLLM[@]}" &&
    python -m pytest plugins/vllm_backend/tests "${VLLM_FIRST[@]/#/--ignore=plugins/vllm_backend/tests/}" \
      --durations=30 "$@"
)
# The SGLang backend on the real engine (the PyPI wheel, a CUDA build, run on CPU with the
# test-only driver stub and start-up shim in plugins/sglang_backend/tests/cpu/, which need
# gcc); vLLM's serving benchmark runs against it from the vLLM environment.
sglang_tests() (
  source scripts/env.sh "${SGLANG[@]}" &&
    python -m pytest plugins/sglang_backend/tests --durations=30 "$@"
)

# Two workers side by side, each on its own half of the cores (taskset): a step keeps about
# one core busy on average, so the second would otherwise idle, and engines that bind or
# spin their threads on every core they may use would fight the other worker's for each.
# Each worker takes the next step nobody has taken (longest first) until none is left, so
# neither idles while the other has two to go. Every line is prefixed with its step's name.
STEPS=(sglang_tests core_tests vllm_rest_tests vllm_first_tests hf_tests verl_tests)
read -r first_cores second_cores < <(python3 -c '
import os
cores = sorted(os.sched_getaffinity(0))
half = max(1, len(cores) // 2)
print(",".join(map(str, cores[:half])), ",".join(map(str, cores[half:] or cores)))')
taken=$(mktemp)
echo 0 > "$taken"
take() {  # the index of the next step, under a lock on the count of those taken
  flock "$taken" bash -c 'read -r i < "$0"; echo $((i + 1)) > "$0"; echo "$i"' "$taken"
}
worker() {
  taskset -p -c "$1" "$BASHPID" >/dev/null
  local i rc=0
  while i=$(take) && [ "$i" -lt "${#STEPS[@]}" ]; do
    "${STEPS[$i]}" "${ARGS[@]}" 2>&1 | sed -u "s/^/[${STEPS[$i]%_tests}] /" || rc=$?
  done
  return "$rc"
}
ARGS=("$@")
worker "$first_cores" & first=$!
worker "$second_cores" & second=$!
rc=0
wait "$first" || rc=$?
wait "$second" || rc=$?
rm -f "$taken"
exit "$rc"
