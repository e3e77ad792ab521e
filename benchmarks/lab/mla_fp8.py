"""Dense MLA over an FP8 latent cache (FlashMLA's 656-byte rows) against the bf16 cache, in one process (GPU).

Per workload (L1, L2, any ``mla-shapes`` id) four rows timed in interleaved rounds: the bf16 cache on the default
kernel (Mosaic on Hopper) and on the Triton kernel, the FP8 cache on the Triton kernel (the one that reads it),
and the bf16 default again. GB/s counts the bytes each cache holds for the keys read (Σ seq_len · 1,152 or 656);
``rel_l2_fp8_vs_bf16`` is what FP8 costs in accuracy on the workload's random rows. JSON to ``$OUT/mla-fp8.json``.

    python -m benchmarks.lab.mla_fp8 --only L1,L2,mla-b64-c8192-h16-q2
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import jax

import pallas_attn
from benchmarks import impls
from benchmarks.lab import common
from pallas_attn.testing import relative_l2


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default="L1,L2", help="MLA workload ids, comma-separated")
    p.add_argument("--reps", type=int, default=7, help="rounds")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (checks the script on a CPU)")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    interpret = not pallas_attn.core.backend.on_gpu()
    rows = []
    for workload in args.only.split(","):
        s = common.spec(workload, args.tiny)
        b = common.batch(s)
        a = b.arrays
        kv8 = pallas_attn.quantize_latent(a["kv_cache"], s.kv_lora_rank)
        cu = impls.mla_cu_query_lens(b)

        def call(backend=None):
            return jax.jit(lambda q, kv, bt, sl, cu: pallas_attn.mla_attention(
                q, kv, bt, sl, cu, max_query_len=b.host.max_query_len, kv_lora_rank=s.kv_lora_rank, backend=backend,
                interpret=interpret or None))

        fns = [call(None), call("triton"), call("triton"), call(None)]
        xs = [(a["q"], c, a["block_tables"], a["seq_lens"], cu) for c in (a["kv_cache"], a["kv_cache"], kv8,
                                                                           a["kv_cache"])]
        outs = [jax.block_until_ready(f(*x)) for f, x in zip(fns, xs)]
        err = float(relative_l2(outs[2], outs[0]))
        t0 = time.perf_counter()
        jax.block_until_ready(fns[0](*xs[0]))
        inner = max(3, math.ceil(0.08 / (time.perf_counter() - t0)))
        times = common.interleaved(fns, xs, reps=args.reps, inner=inner)
        ms = [common.median(t) * 1e3 for t in times]
        keys = int(sum(b.host.seq_lens))
        gbps = [keys * row_bytes / (m * 1e-3) / 1e9 for m, row_bytes in zip(ms, (1152, 1152, 656, 1152))]
        rows.append(dict(workload=s.id, rows=["bf16 default", "bf16 triton", "fp8 triton", "bf16 default"],
                         median_ms=ms, gb_per_s=gbps, fp8_over_bf16_default=ms[2] / ((ms[0] + ms[3]) / 2),
                         fp8_over_bf16_triton=ms[2] / ms[1], rel_l2_fp8_vs_bf16=err, inner=inner))
        print(f"{s.id}: bf16 {ms[0]:.4f}/{ms[3]:.4f} ms, bf16 triton {ms[1]:.4f}, fp8 {ms[2]:.4f} ms "
              f"({gbps[2]:.0f} GB/s of FP8 bytes); rel L2 fp8 vs bf16 {err:.2e}", flush=True)
    common.write_json("mla-fp8.json", dict(rows=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
