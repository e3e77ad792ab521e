"""A/B of two variants of our kernels in ABBA order inside every round (GPU).

Interleaved rounds cancel drift of the clocks; ABBA also cancels the position bias (under the 700 W power cap, the
row timed right after a lower-power one runs faster). Rounds of at least ~80 ms, sustained like the harness's. A
and B are ``--variant`` bodies (``backend=mosaic,config.p_chunks=4``; ``default`` for the plain call; a model-family
key such as ``softcap=50`` or ``sinks=1`` runs the workload with that feature on), on any workload ids of the
harness (standard or family). JSON to ``$OUT/ab.json`` (``--json``).

    python -m benchmarks.lab.ab --a backend=mosaic,config.p_chunks=4 --b backend=mosaic,config.p_chunks=2 \\
        --only P2,P1,R64,P1-unaligned
    python -m benchmarks.lab.ab --a backend=mosaic --b backend=triton --family prefill-rule --unroll 20
    python -m benchmarks.lab.ab --b softcap=50 --only P1,D1 --unroll 5    # a model-family feature's cost
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import jax

from benchmarks import workloads as wl
from benchmarks.lab import common
from pallas_attn.testing import relative_l2

ROUND_S = 0.08


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--a", default="default", help="variant A (a --variant body, or 'default')")
    p.add_argument("--b", required=True, help="variant B")
    p.add_argument("--only", default="", help="workload ids, comma-separated")
    p.add_argument("--family", default="", help="workload families, comma-separated")
    p.add_argument("--unroll", type=int, default=1, help="N calls in one jitted function: GPU time a call")
    p.add_argument("--reps", type=int, default=9, help="rounds")
    p.add_argument("--json", default="ab.json", help="file name under $OUT")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (checks the script on a CPU)")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    specs = [common.spec(i, args.tiny) for i in args.only.split(",") if i]
    specs += wl.family_specs([f for f in args.family.split(",") if f], tiny=args.tiny)
    rows = []
    for s in specs:
        b = common.batch(s)
        a_fn, b_fn = (common.prepared(b, v) for v in (args.a, args.b))
        xa, xb = a_fn.args[0], b_fn.args[0]
        # a model-family key changes what B computes: then B's output is not A's, and no difference is recorded
        err = (float(relative_l2(b_fn.canonical(b_fn.fn(*xb)), a_fn.canonical(a_fn.fn(*xa))))
               if not any(map(common.has_features, (args.a, args.b))) else None)
        fns = [a_fn.fn, b_fn.fn, b_fn.fn, a_fn.fn]
        xs = [xa, xb, xb, xa]
        if args.unroll > 1:
            fns = [common.unrolled(f, x, args.unroll) for f, x in zip(fns, xs)]
        jax.block_until_ready(fns[0](*xa))  # compiled
        t0 = time.perf_counter()
        jax.block_until_ready(fns[0](*xa))
        inner = max(10, math.ceil(ROUND_S / (time.perf_counter() - t0)))
        times = common.interleaved(fns, xs, reps=args.reps, inner=inner)
        ms = [common.median(t) * 1e3 / args.unroll for t in times]
        unit = s.units[0]
        metric = [b.host.metric(unit, m * 1e-3) for m in ms]
        a, bb = (metric[0] + metric[3]) / 2, (metric[1] + metric[2]) / 2
        rows.append(dict(workload=s.id, inner=inner, unroll=args.unroll, order="A,B,B,A", median_ms=ms, unit=unit,
                         metric=metric, a=a, b=bb, gain=bb / a - 1, rel_l2_b_vs_a=err))
        print(f"{s.id}: A {metric[0]:.4g}/{metric[3]:.4g}  B {metric[1]:.4g}/{metric[2]:.4g} {unit}  "
              f"B/A {100 * (bb / a - 1):+.2f}%  (inner {inner}, rel L2 {err if err is None else f'{err:.1e}'})",
              flush=True)
    common.write_json(args.json, dict(a=args.a, b=args.b, rows=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
