"""A/B of two Mosaic prefill variants on the GPU, in ABBA order inside every round: the probe's interleaved rounds
cancel drift, and ABBA also cancels the position bias (the row timed right after a lower-power one runs faster
under the 700 W power cap). Rounds of at least ~80 ms, sustained like the harness's. JSON to $OUT/ab.json.

    A=pc=1 B=pc=2 python scripts/ab_prefill_mosaic.py P2,P1,R64,P1-unaligned

A and B: variants as in ``probe_prefill_mosaic.py``'s VARIANTS (knobs "+"-joined, "base", "mod:NAME").
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import jax  # noqa: E402

from pallas_attn.testing import relative_l2  # noqa: E402
from probe_prefill_mosaic import WORKLOADS, inputs, timeit, variant_fn  # noqa: E402

ROUND_S = 0.08


def main() -> int:
    a_name, b_name = os.environ.get("A", "pc=1"), os.environ.get("B", "pc=2")
    rows = []
    for name in sys.argv[1].split(","):
        lens, d, causal = WORKLOADS[name]
        q, k, v, cu, flops = inputs(lens, d, causal)
        fs = [variant_fn(variant, lens, d, causal) for variant in (a_name, b_name, b_name, a_name)]
        err = float(relative_l2(fs[1](q, k, v, cu), fs[0](q, k, v, cu)))
        t0 = time.perf_counter()
        jax.block_until_ready(fs[0](q, k, v, cu))
        inner = max(10, math.ceil(ROUND_S / (time.perf_counter() - t0)))
        tflops = [flops / t / 1e12 for t in timeit(fs, q, k, v, cu, reps=9, inner=inner)]
        a, b = (tflops[0] + tflops[3]) / 2, (tflops[1] + tflops[2]) / 2
        rows.append(dict(workload=name, inner=inner, order=[a_name, b_name, b_name, a_name], tflops=tflops,
                         a=a, b=b, gain=b / a - 1, rel_l2_b_vs_a=err))
        print(f"{name}: A {tflops[0]:.1f}/{tflops[3]:.1f}  B {tflops[1]:.1f}/{tflops[2]:.1f}  "
              f"B/A {100 * (b / a - 1):+.2f}%  (inner {inner}, rel L2 {err:.1e})", flush=True)
    pathlib.Path(os.environ.get("OUT", "/tmp"), "ab.json").write_text(json.dumps(dict(
        device=jax.devices()[0].device_kind, jax=jax.__version__, date=time.strftime("%Y-%m-%d"), a=a_name,
        b=b_name, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
