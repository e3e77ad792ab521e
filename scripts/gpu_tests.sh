#!/usr/bin/env bash
# GPU session, part 1: the whole test suite compiled on the GPU (JSON-able log under $OUT).
set -o pipefail
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/pytest.log"
python3 -c "import jax, jaxlib; print('jax', jax.__version__, jaxlib.__version__, jax.devices())" >> "$OUT/pytest.log"
timeout "${1:-400}" python3 -m pytest tests -q -p no:cacheprovider -n 8 --ignore=tests/test_benchmarks_smoke.py \
  --ignore=tests/test_demo.py --ignore=tests/test_notebooks.py "${@:2}" 2>&1 | tee -a "$OUT/pytest.log" | tail -40
