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
# The HF environment also holds Ray and the OpenAI Agents SDK; the SDK's Python is the
# client of the other engines' servers too.
HF_EXTRAS="requirements/test.txt requirements/ray.txt requirements/agents.txt"

# The core, the HF backend (transformers) and the example backend of
# docs/writing-a-backend.md.
(
  source scripts/env.sh hf $HF_EXTRAS
  pip install -q --no-deps -e . -e plugins/hf_backend -e plugins/example_backend
  python -m pytest tests plugins/hf_backend/tests plugins/example_backend/tests --durations=50 "$@"
)

# verl's own rollout interfaces driving rollout (rollout.integrations.verl) on a local Ray
# cluster, in an environment of its own: verl pins transformers below 5.11.
(
  source scripts/env.sh verl requirements/test.txt
  pip install -q --no-deps -e . -e plugins/hf_backend
  python -m pytest tests/test_integrations_verl.py --durations=50 "$@"
)

# The vLLM backend on the real engine (CPU build), in its own environment; the HF backend
# is installed beside it for the cross-engine comparison, TRL for its vLLM client and
# its trainer through rollout.integrations.trl, and Ray for vLLM replicas on a cluster.
(
  ROLLOUT_AGENTS_PYTHON=$(source scripts/env.sh hf $HF_EXTRAS && command -v python)
  export ROLLOUT_AGENTS_PYTHON
  source scripts/env.sh vllm requirements/test.txt requirements/trl.txt requirements/ray.txt requirements/peft.txt
  pip install -q --no-deps -e . -e plugins/hf_backend -e plugins/vllm_backend
  python -m pytest plugins/vllm_backend/tests --durations=50 "$@"
)

# The SGLang backend on the real engine (the PyPI wheel, a CUDA build, run on CPU with the
# test-only driver stub and start-up shim in plugins/sglang_backend/tests/cpu/, which need gcc), in its
# own environment; the HF backend is installed beside it for the cross-engine comparison,
# and TRL for its trainer through rollout.integrations.trl.
(
  # vLLM's serving benchmark runs against the SGLang backend from the vLLM environment.
  ROLLOUT_VLLM_PYTHON=$(source scripts/env.sh vllm requirements/test.txt requirements/trl.txt requirements/ray.txt requirements/peft.txt && command -v python)
  ROLLOUT_AGENTS_PYTHON=$(source scripts/env.sh hf $HF_EXTRAS && command -v python)
  export ROLLOUT_VLLM_PYTHON ROLLOUT_AGENTS_PYTHON
  source scripts/env.sh sglang requirements/test.txt requirements/trl.txt
  pip install -q --no-deps -e . -e plugins/hf_backend -e plugins/sglang_backend
  python -m pytest plugins/sglang_backend/tests --durations=50 "$@"
)
