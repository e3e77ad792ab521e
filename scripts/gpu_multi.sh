#!/usr/bin/env bash
# The 2-GPU session (device kind nvidia-h200-x2, ~2 minutes): the tensor- and context-parallel checks compiled
# in one process (a "CHECK <name> ok|FAIL" line each), then D2's longest request split across the two GPUs.
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi -L
timeout "${1:-150}" python3 -m tests.test_parallel 2>&1 | tee "$OUT/parallel_checks.log" | grep -E "^CHECK|Error" | head -20
timeout "${2:-120}" python3 examples/multi_gpu.py --target-s 0.3 --json "$OUT/multi_gpu.json" 2>&1 | tail -9
timeout "${2:-120}" python3 examples/multi_gpu.py --target-s 0.3 --merge psum --json "$OUT/multi_gpu_psum.json" 2>&1 \
  | tail -9
