"""Where a Mosaic prefill call's time goes (GPU only): the whole ``varlen_attention_mosaic`` call against its parts
jitted alone (the work list, the K/V staging copy, the kernel on precomputed inputs), timed in interleaved rounds.
The small parts alone are dispatch-bound, so they are also timed ``LOOP`` times inside one jitted ``fori_loop``
(their GPU time a call). Prints the launches of the whole call's optimised HLO. JSON to ``$OUT/prefill_breakdown.json``
and the HLO to ``$OUT/hlo_<workload>.txt``.

    python -m benchmarks.lab.breakdown [P2,P1]

It reaches into ``pallas_attn.kernels.mosaic.prefill`` (its work list, staging and kernel call), so it follows that
module's internals.
"""

from __future__ import annotations

import functools
import os
import pathlib
import re
import sys

import jax
import jax.numpy as jnp
from jax import lax

from benchmarks.lab import common
from pallas_attn import MosaicPrefillConfig
from pallas_attn.kernels.mosaic import prefill as pm

LOOP = 100


def looped(part):
    """``part(cu', *args)`` LOOP times in one jitted loop, ``cu' = cu + i // 2**30`` (0, but not provably so: nothing
    is hoisted out of the loop)."""
    def run(cu, *args):
        def body(i, acc):
            out = part(cu + i // (1 << 30), *args)
            return acc + sum(jnp.sum(x[:1].astype(jnp.float32)) for x in jax.tree.leaves(out))
        return lax.fori_loop(0, LOOP, body, jnp.float32(0))
    return jax.jit(run)


def launches(hlo: str) -> list[str]:
    """The entry computation's kernels in an optimised HLO text: its fusions, custom calls (the Pallas kernels) and
    sorts, in order (the instructions nested in them are not launches)."""
    entry = hlo[hlo.index("\nENTRY"):]
    entry = entry[:entry.index("\n}")]
    return re.findall(r"^\s*(?:ROOT )?%(\S+) = .*?[)}\]] (?:fusion|custom-call|sort)\(", entry, flags=re.M)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    rows = []
    for name in (argv[0].split(",") if argv else ["P2", "P1"]):
        s = common.spec(name)
        b = common.batch(s)
        q, k, v, cu = (b.arrays[x] for x in ("q", "k", "v", "cu_seqlens"))
        flops, causal, scale = b.host.flops(), True, s.head_dim ** -0.5
        max_seqlen, (num_tokens, hq, _), hkv = int(b.host.seq_lens.max()), q.shape, k.shape[1]
        group, wgs = hq // hkv, pm.compute_wgs(s.head_dim)
        num_slots = pm.num_work_slots(num_tokens, b.host.num_seqs, max_seqlen, group, wgs)
        cfg = MosaicPrefillConfig()
        full = jax.jit(functools.partial(pm.varlen_attention_mosaic, max_seqlen=max_seqlen, causal=causal,
                                         scale=scale, return_lse=False, interpret=False, cfg=cfg))
        work = jax.jit(lambda cu: pm._work_list(cu, num_slots, causal, max_seqlen, group, wgs))
        stage = jax.jit(lambda k, v, cu: pm._stage_kv(k, v, cu, cfg.block_kv, max_seqlen, interpret=False))
        kernel = jax.jit(functools.partial(
            pm._call_kernel, num_slots=num_slots, max_seqlen=max_seqlen, causal=causal, scale=scale, return_lse=False,
            interpret=False, cfg=cfg))
        req, first, _, _, tiles = work(cu)
        k_staged, v_staged, kv_stage = stage(k, v, cu)  # P1, P2: T in whole 8-row groups (no padding)
        work_loop = looped(lambda cu: pm._work_list(cu, num_slots, causal, max_seqlen, group, wgs))
        stage_loop = looped(lambda cu, k, v: pm._stage_kv(k, v, cu, cfg.block_kv, max_seqlen, interpret=False))

        @jax.jit
        def with_work(q, k, v, cu):  # staging precomputed
            req, first, _, _, tiles_ = pm._work_list(cu, num_slots, causal, max_seqlen, group, wgs)
            return kernel(q, k, v, k_staged, v_staged, cu, kv_stage, tiles_, req, first)

        @jax.jit
        def with_stage(q, k, v, cu):  # work list precomputed
            k_staged_, v_staged_, kv_stage_ = pm._stage_kv(k, v, cu, cfg.block_kv, max_seqlen, interpret=False)
            return kernel(q, k, v, k_staged_, v_staged_, cu, kv_stage_, tiles, req, first)

        hlo = full.lower(q, k, v, cu).compile().as_text()
        pathlib.Path(os.environ.get("OUT", "."), f"hlo_{name}.txt").write_text(hlo)
        print(name, "launches in the whole call:", launches(hlo), flush=True)
        parts = {"whole call": lambda: full(q, k, v, cu), "work list": lambda: work(cu),
                 "K/V staging": lambda: stage(k, v, cu),
                 "kernel": lambda: kernel(q, k, v, k_staged, v_staged, cu, kv_stage, tiles, req, first),
                 "work list, looped": lambda: work_loop(cu), "K/V staging, looped": lambda: stage_loop(cu, k, v),
                 "kernel + work list": lambda: with_work(q, k, v, cu),
                 "kernel + staging": lambda: with_stage(q, k, v, cu)}
        for part, times in zip(parts, common.interleaved(list(parts.values()), ())):
            sec = common.median(times) / (LOOP if part.endswith("looped") else 1)  # a call's GPU time
            rows.append(dict(workload=name, part=part, median_ms=sec * 1e3, tflops=flops / sec / 1e12))
            print(f"{name} {part:20s} {sec * 1e3:8.3f} ms  ({flops / sec / 1e12:6.1f} TFLOP/s of the call's flops)",
                  flush=True)
    common.write_json("prefill_breakdown.json", dict(rows=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
