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
    python -m benchmarks.lab.ab --a-tree ../base --b default --only P1-bwd   # a change against another checkout

``--a-tree DIR`` imports A's ``pallas_attn`` and ``benchmarks`` from the checkout ``DIR`` (``git worktree add DIR
REV``) in the same process, so a kernel change is timed against the code before it in the same interleaved rounds.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
import time

import jax

from benchmarks import workloads as wl
from benchmarks.lab import common
from pallas_attn.testing import relative_l2

ROUND_S = 0.08
PACKAGES = ("pallas_attn", "benchmarks")


@contextlib.contextmanager
def imported_from(tree: str):
    """Within: ``pallas_attn`` and ``benchmarks`` imported afresh from the checkout ``tree`` (yields its
    ``benchmarks.lab.common``); after: this checkout's modules back in ``sys.modules``. Functions prepared within
    keep the other checkout's modules (their globals), so both versions run side by side."""
    if not tree:
        yield common
        return
    ours_ = {k: sys.modules.pop(k) for k in list(sys.modules) if k.split(".")[0] in PACKAGES}
    sys.path.insert(0, tree)
    try:
        import pallas_attn
        from benchmarks.lab import common as theirs
        print(f"A: pallas_attn from {pallas_attn.__file__}", flush=True)
        yield theirs
    finally:
        sys.path.remove(tree)
        for k in [k for k in sys.modules if k.split(".")[0] in PACKAGES]:
            del sys.modules[k]
        sys.modules.update(ours_)


def _difference(out, ref) -> float:
    """Relative L2 of B's output against A's; the largest over the leaves (a training step's dq, dk, dv)."""
    return max(float(relative_l2(o, r)) for o, r in zip(jax.tree.leaves(out), jax.tree.leaves(ref), strict=True))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--a", default="default", help="variant A (a --variant body, or 'default')")
    p.add_argument("--b", required=True, help="variant B")
    p.add_argument("--only", default="", help="workload ids, comma-separated")
    p.add_argument("--family", default="", help="workload families, comma-separated")
    p.add_argument("--unroll", type=int, default=1, help="N calls in one jitted function: GPU time a call")
    p.add_argument("--reps", type=int, default=9, help="rounds")
    p.add_argument("--json", default="ab.json", help="file name under $OUT")
    p.add_argument("--a-tree", default="", help="import A's pallas_attn and benchmarks from this checkout")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (checks the script on a CPU)")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    specs = [common.spec(i, args.tiny) for i in args.only.split(",") if i]
    specs += wl.family_specs([f for f in args.family.split(",") if f], tiny=args.tiny)
    rows = []
    for s in specs:
        b = common.batch(s)
        with imported_from(args.a_tree) as a_common:
            a_fn = a_common.prepared(b, args.a)
            xa = a_fn.args[0]
            jax.block_until_ready(a_fn.fn(*xa))  # traced and compiled with A's modules
        b_fn = common.prepared(b, args.b)
        xb = b_fn.args[0]
        # a model-family key changes what B computes: then B's output is not A's, and no difference is recorded
        err = (_difference(b_fn.canonical(b_fn.fn(*xb)), a_fn.canonical(a_fn.fn(*xa)))
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
        # after every row: a run cut by its time limit keeps what it measured
        common.write_json(args.json, dict(a=args.a, a_tree=args.a_tree or None, b=args.b, rows=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
