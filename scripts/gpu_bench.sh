#!/usr/bin/env bash
# The benchmark harness on a GPU machine: installs the wheels carried in .whl/ (jax-triton for the naive_triton
# anchor, tokamax for tokamax_mosaic: run scripts/fetch_wheels.sh where pip works), then runs every workload with a
# time budget.
# Usage: bash scripts/gpu_bench.sh OUT_DIR [BUDGET_S (default 540)] [more benchmarks.run flags ...]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: gpu_bench.sh OUT_DIR [BUDGET_S] [benchmarks.run flags ...]}
budget=${2:-540}
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
if ls .whl/*.whl >/dev/null 2>&1; then
  site=$(mktemp -d)
  python3 -m pip install -q --no-index --no-deps --target "$site" .whl/*.whl
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
python3 -m benchmarks.run --out "$out" --budget "$budget" "${@:3}"
