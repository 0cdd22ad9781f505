#!/usr/bin/env bash
# Install the core and the HF backend, build the tiny model, and run the batch job on
# the shipped prompts. The output is out.parquet.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh hf
pip install -q --no-deps -e . -e plugins/hf_backend
[ -f tiny-model/model.safetensors ] || rollout tiny-model tiny-model
rollout generate --backend hf --model tiny-model --input examples/prompts.parquet \
  --output out.parquet --n 4 --temperature 0.8 --max-tokens 32 --seed 0
python -c "import pyarrow.parquet as pq; t = pq.read_table('out.parquet'); \
print(t.num_rows, 'rows'); print(t.select(['prompt', 'responses', 'finish_reasons']).slice(0, 2).to_pylist())"
