#!/usr/bin/env bash
# One GPU call for the Mosaic prefill (issue 10): compiled correctness, compiled tests, the probe against the
# Triton kernel on P1/P2 and the shapes the default-backend rule needs, then the harness's P1/P2 with the anchors.
# Usage (device, carry [".whl"]): bash scripts/gpu_mosaic.sh [test_s] [test targets ...]
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p "$OUT/res"
if ls .whl/*.whl >/dev/null 2>&1; then  # jax-triton for the seed_triton anchor (scripts/fetch_wheels.sh)
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
[ "${CHECKS:-1}" = 1 ] && {
  for case in "64,70 --d 128 --hq 4 --hkv 2" "1,64,65,130 --hq 4 --hkv 2 --d 128" "200,3 --causal 0" \
              "127,1,0,64 --hq 4 --hkv 2 --d 128" "3,70,61,600 --hq 8 --hkv 2"; do
    echo "== $case"; timeout 60 python3 scripts/check_prefill_mosaic.py $case 2>&1 | tail -2
  done
} > "$OUT/check.log" 2>&1
cat "$OUT/check.log"
targets=("${@:2}")
[ ${#targets[@]} -eq 0 ] && targets=(tests/test_prefill_mosaic.py)
bash scripts/gpu_tests.sh "${1:-150}" "${targets[@]}"
timeout "${PROBE_S:-240}" python3 scripts/probe_prefill_mosaic.py "${PROBE:-P1,P2,P1-unaligned,R64,short-256x128,short-128x256,short-64x512,P1-d64,noncausal-4x8192}" \
  > "$OUT/probe.txt" 2>&1; grep -v "^W\|^I0" "$OUT/probe.txt" | tail -20
[ -n "$BENCH" ] && timeout "$BENCH" python3 -m benchmarks.run --only P1,P2 --out "$OUT/res" --no-merge --no-plots \
  > "$OUT/res/bench.txt" 2>&1; grep -v "it/s\]" "$OUT/res/bench.txt" 2>/dev/null | tail -25
