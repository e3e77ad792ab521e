#!/usr/bin/env bash
# One GPU call for the sparse MLA kernels (issue 6): compiled tests, the probe (Mosaic vs Triton on S1, each checked
# against the reference first), the harness's S1 with its anchors, and an ncu source-level profile of the kernel.
# Usage (device): bash scripts/gpu_sparse.sh      env: VARIANTS (probe), NCU=<variant>
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p "$OUT/res"
bash scripts/gpu_tests.sh 150 tests/test_sparse.py
VARIANTS="${VARIANTS:-mosaic,new:64:64:8:2}" timeout 150 python3 scripts/probe_sparse.py > "$OUT/probe.txt" 2>&1
grep -v "^W\|^I0\|Warning\|lse_err=" "$OUT/probe.txt" | cut -c1-600 | tail -8
timeout 200 python3 -m benchmarks.run --only S1 --out "$OUT/res" --no-merge --no-plots > "$OUT/res/bench.txt" 2>&1
grep -v "it/s\]" "$OUT/res/bench.txt" | tail -14
if [ -n "$NCU" ]; then
  timeout 120 /usr/local/cuda/bin/ncu --section SourceCounters --section SpeedOfLight --page source --print-source sass \
    --csv -k regex:"sparse|mosaic" --launch-skip 1 --launch-count 1 python3 scripts/ncu_sparse.py "$NCU" \
    > "$OUT/ncu_sass.csv" 2>&1; echo "ncu rc=$?"
fi
