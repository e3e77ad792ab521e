#!/usr/bin/env bash
# One GPU call: compiled tests, the benchmark harness (all workloads + anchors), the prefill variant sweep.
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p "$OUT/res"
bash scripts/gpu_tests.sh "${1:-230}" | tail -5
timeout "${2:-210}" python3 -m benchmarks.run --out "$OUT/res" --no-merge > "$OUT/res/bench.txt" 2>&1; tail -45 "$OUT/res/bench.txt"
timeout "${3:-110}" python3 scripts/quick_bench.py P1,P2 2>&1 | grep -v Warn > "$OUT/quick.txt"; tail -25 "$OUT/quick.txt"
