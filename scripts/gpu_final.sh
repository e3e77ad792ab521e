#!/usr/bin/env bash
# One GPU call (~9 min): compiled tests, the benchmark harness (all workloads + anchors), the split sweep.
# Usage: here `bash scripts/fetch_wheels.sh`; on the device (carry [".whl"]) bash scripts/gpu_final.sh [test_s] [bench_s] [split_s]
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p "$OUT/res"
if ls .whl/*.whl >/dev/null 2>&1; then  # wheels carried from scripts/fetch_wheels.sh (jax-triton)
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
bash scripts/gpu_tests.sh "${1:-280}"
timeout "${2:-220}" python3 -m benchmarks.run --out "$OUT/res" --no-merge > "$OUT/res/bench.txt" 2>&1
grep -v "it/s\]" "$OUT/res/bench.txt" | tail -45
timeout "${3:-90}" python3 -m benchmarks.run --split-sweep --out "$OUT/res" > "$OUT/res/split.txt" 2>&1
tail -5 "$OUT/res/split.txt"
