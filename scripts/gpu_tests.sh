#!/usr/bin/env bash
# The whole test suite compiled on a GPU. Verbose, so every test's name and verdict reach
# $OUT/pytest.log as it finishes, even if the time limit cuts the run before pytest's summary.
set -o pipefail
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/pytest.log"
python3 -c "import jax, jaxlib; print('jax', jax.__version__, jaxlib.__version__, jax.devices())" >> "$OUT/pytest.log"
# Usage: [WORKERS=n] gpu_tests.sh [seconds] [test files or -k ... to run instead of the whole tests/ directory]
targets=("${@:2}")
[ ${#targets[@]} -eq 0 ] && targets=(tests)
timeout "${1:-400}" python3 -m pytest "${targets[@]}" -v -rfE -p no:cacheprovider -n "${WORKERS:-8}" --timeout 150 \
  --ignore=tests/test_benchmarks_smoke.py --ignore=tests/test_demo.py --ignore=tests/test_notebooks.py \
  >> "$OUT/pytest.log" 2>&1
echo "pytest exit: $?"; grep -E "FAILED|ERROR" "$OUT/pytest.log" | head -30; tail -3 "$OUT/pytest.log"
