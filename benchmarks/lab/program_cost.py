"""A paged program's fixed cost against its cost a key tile (GPU).

``paged_decode_attention`` (``num_splits=1``) on batches whose programs all read the same number ``n`` of 64-key
tiles (every request's context ``64·n`` keys, pages of ``--block-size``), ``n`` = 1, 2, 4, ... 64, with as many
programs (requests × KV heads) as fill ``--waves`` waves at one program an SM. Each backend's times are timed in
interleaved rounds; a line through time against ``n`` gives, a wave, the fixed cost of a program (intercept /
waves: its query, its pipeline's fill and drain, its output) and the cost of a tile (slope / waves). Where one
program runs on an SM at a time (the Mosaic kernel at head dim 128), the fixed cost is what a program that loops
over items could save; at head dim 64 the Mosaic kernel's programs loop (docs/performance.md#persistent-programs),
so its intercept is an item's cost inside a loop. JSON to ``$OUT/program-cost.json`` as it goes.

    python -m benchmarks.lab.program_cost --backends mosaic,triton --head-dim 128 --group 4 --waves 4
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys

import numpy as np

import pallas_attn
from benchmarks import workloads as wl
from benchmarks.lab import common

TILE = 64  # keys a tile of both paged kernels' decode steps reads


def _batch(num_seqs: int, context: int, args) -> wl.Batch:
    """The harness's decode batch (D1's layout: shuffled pages, no page shared) of ``num_seqs`` requests of
    ``context`` keys each."""
    spec = dataclasses.replace(wl.WORKLOADS["D1"], id=f"cost-{context}", what=f"{num_seqs} requests of {context} keys",
                               groups=(wl.Group((context,) * num_seqs, 1),), num_kv_heads=args.kv_heads,
                               num_q_heads=args.kv_heads * args.group, head_dim=args.head_dim,
                               block_size=args.block_size)
    return common.batch(spec)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backends", default="mosaic,triton", help="comma-separated: mosaic, triton")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--group", type=int, default=4, help="query heads a KV head")
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--waves", type=int, default=4, help="programs = waves × SMs (one program an SM)")
    p.add_argument("--tiles", default="1,2,4,8,16,32,64", help="key tiles a program reads, comma-separated")
    p.add_argument("--unroll", type=int, default=5, help="calls in one jitted function: GPU time a call")
    p.add_argument("--reps", type=int, default=5, help="rounds")
    p.add_argument("--json", default="program-cost.json", help="file name under $OUT")
    p.add_argument("--tiny", action="store_true", help="tiny shapes, interpreted (checks the script on a CPU)")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    backends = [b for b in args.backends.split(",") if b]
    sms = pallas_attn.core.backend.num_sms()
    num_seqs = math.ceil(args.waves * sms / args.kv_heads)
    if args.tiny:  # two requests of one or two tiles (interpreted on a CPU)
        num_seqs, args.kv_heads, args.tiles, args.unroll, args.reps = 2, 2, "1,2", 1, 1
    rows, fits = [], {}
    for n in [int(t) for t in args.tiles.split(",")]:
        batch = _batch(num_seqs, n * TILE, args)
        prepared = [common.prepared(batch, f"backend={b},num_splits=1") for b in backends]
        fns, x = [p.fn for p in prepared], prepared[0].args[0]
        if args.unroll > 1:  # the first integer array gets the traced zero: XLA merges none of the calls
            fns = [common.unrolled(f, x, args.unroll) for f in fns]
        times = common.interleaved(fns, x, reps=args.reps, inner=2 if args.tiny else 10)
        for b, t in zip(backends, times):
            us = common.median(t) * 1e6 / args.unroll
            rows.append(dict(backend=b, tiles=n, keys=n * TILE, programs=num_seqs * args.kv_heads, median_us=us))
            print(f"{b:7s} n={n:3d}: {us:9.2f} µs", flush=True)
        for b in backends:
            pts = [(r["tiles"], r["median_us"]) for r in rows if r["backend"] == b]
            if len(pts) >= 2:
                slope, intercept = np.polyfit(*zip(*pts), 1)
                waves = num_seqs * args.kv_heads / sms
                fits[b] = dict(intercept_us=intercept, slope_us=slope, waves=waves,
                               program_fixed_us=intercept / waves, tile_us=slope / waves)
        common.write_json(args.json, dict(head_dim=args.head_dim, group=args.group, kv_heads=args.kv_heads,
                                          block_size=args.block_size, num_seqs=num_seqs, sms=sms, rows=rows,
                                          fits=fits))
    for b, f in fits.items():
        print(f"{b}: a program's fixed cost {f['program_fixed_us']:.2f} µs, a tile {f['tile_us']:.3f} µs "
              f"(a wave of {sms} programs; {f['waves']:.2f} waves)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
