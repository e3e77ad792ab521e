"""GPU probe of pallas_attn/prefill_mosaic.py: P1/P2 timed against the Triton-backend varlen_attention in the same
run (and checked against it), JSON to $OUT/mosaic_probe.json. GPU only.

    python scripts/probe_prefill_mosaic.py [P1,P2]

``UNROLL=N``: each implementation is timed as N calls in one jitted function, JSON to $OUT/mosaic_probe_unrollN.json
(GPU time a call: the host's dispatch, ~0.1 ms a call, no longer hides it on the shortest workloads; what a call
costs inside a jitted model).
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_attn import varlen_attention  # noqa: E402
from pallas_attn.kernels.mosaic import prefill as prefill_mosaic
from pallas_attn.testing import relative_l2  # noqa: E402

P1 = [8192, 4096, 4096, 2048, 2048, 2048, 1024, 1024, 1024, 1024, 512, 512, 512, 512, 256, 256]
_rng = np.random.default_rng(0)
# name: (lens, head_dim, causal). Beyond P1/P2: what the default-backend rule must hold for (unaligned starts,
# many short requests, head_dim 64, non-causal).
WORKLOADS = {"P1": (P1, 128, True), "P2": ([32768], 128, True),
             "P1-unaligned": ([n + int(d) for n, d in zip(P1, _rng.integers(-7, 8, len(P1)))], 128, True),
             "R64": ([int(x) for x in _rng.integers(128, 4097, 64)], 128, True),
             "short-256x128": ([128] * 256, 128, True),
             "short-128x256": ([256] * 128, 128, True),
             "short-64x512": ([512] * 64, 128, True),
             "P1-d64": (P1, 64, True),
             "d64-64x512": ([512] * 64, 64, True),
             "d64-32x1024": ([1024] * 32, 64, True),
             "noncausal-4x8192": ([8192] * 4, 128, False),
             # shorter still, and single requests (a serving engine's prefill of one prompt)
             "short-512x64": ([64] * 512, 128, True),
             "short-1024x32": ([32] * 1024, 128, True),
             "mixed-128x1-256": ([int(x) for x in _rng.integers(1, 257, 128)], 128, True),
             "one-64": ([64], 128, True), "one-128": ([128], 128, True), "one-256": ([256], 128, True),
             "one-512": ([512], 128, True), "one-1024": ([1024], 128, True), "one-2048": ([2048], 128, True),
             "d64-16x2048": ([2048] * 16, 64, True), "d64-8x4096": ([4096] * 8, 64, True)}


# Mosaic tuning variants, timed on every workload asked for, e.g. VARIANTS="wgs=2,regs=240/24+bkv=128,base": the
# kernel's knobs, "+"-joined
VARIANTS = [v for v in os.environ.get("VARIANTS", "").split(",") if v]
UNROLL = int(os.environ.get("UNROLL", "1"))
KNOBS = {"bkv": "block_kv", "mcs": "max_concurrent_steps", "regs": "registers", "wgs": "compute_wgs",
         "pc": "p_chunks"}


def knobs(variant: str) -> dict:
    kw = {}
    for item in variant.split("+"):
        if item == "base" or item.startswith("mod:"):
            continue
        key, value = item.split("=")
        kw[KNOBS[key]] = tuple(int(x) for x in value.split("/")) if key == "regs" else int(value)
    return kw


def variant_impl(variant: str):
    """``varlen_attention_mosaic`` of a variant with its knobs bound; "base" in it: the committed kernel kept for
    A/B runs in ``scripts/_baseline_prefill_mosaic.py`` (uncommitted: ``git show HEAD:pallas_attn/prefill_mosaic.py``);
    "mod:NAME": another uncommitted copy, ``scripts/_NAME.py`` (a diagnostic change, e.g. one stage left out)."""
    module = prefill_mosaic
    for item in variant.split("+"):
        if item == "base":
            module = importlib.import_module("_baseline_prefill_mosaic")
        elif item.startswith("mod:"):  # an uncommitted copy of the kernel with a diagnostic change, scripts/_NAME.py
            module = importlib.import_module("_" + item[4:])
    return functools.partial(module.varlen_attention_mosaic, **knobs(variant))


def variant_fn(variant: str, lens, d: int, causal: bool):
    """A variant's ``out [T, Hq, D]`` on a workload's batch, jitted (the workload's scale, no LSE); a new jitted
    function each call, so that two calls give two separately timed rows."""
    impl = variant_impl(variant)
    return jax.jit(lambda q, k, v, cu: impl(q, k, v, cu, max_seqlen=max(lens), causal=causal, scale=d ** -0.5,
                                            return_lse=False, interpret=False)[0])


def inputs(lens, d: int, causal: bool, hq: int = 32, hkv: int = 8):
    """``(q, k, v, cu_seqlens, useful flops)`` of a packed batch of ``lens`` (bf16, normal, key 0)."""
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
    t = int(sum(lens))
    key = jax.random.key(0)
    q, k, v = (jax.random.normal(jax.random.fold_in(key, i), (t, h, d), jnp.bfloat16)
               for i, h in enumerate((hq, hkv, hkv)))
    flops = sum(4 * (n * (n + 1) / 2 if causal else n * n) * d * hq for n in lens)
    return q, k, v, cu, flops


def timeit(fs, *args, reps=7, inner=10):
    """Median seconds a call of each of ``fs``, timed in interleaved rounds: clocks drift with the GPU's power and
    temperature within a run, and a variant timed after another must not inherit a different clock."""
    for f in fs:
        for _ in range(2):
            jax.block_until_ready(f(*args))
    ts = [[] for _ in fs]
    for _ in range(reps):
        for f, t_f in zip(fs, ts):
            t = time.perf_counter()
            for _ in range(inner):
                r = f(*args)
            jax.block_until_ready(r)
            t_f.append((time.perf_counter() - t) / inner)
    return [float(np.median(t_f)) for t_f in ts]


def unrolled(f, n: int):
    """``f`` called ``n`` times in one jitted function, on ``cu + 0 · i`` (a traced zero: nothing is merged)."""
    def run(q, k, v, cu, zero):
        return sum(f(q, k, v, cu + zero * i)[:1, :1].astype(jnp.float32).sum() for i in range(n))
    run = jax.jit(run)
    return lambda q, k, v, cu: run(q, k, v, cu, jnp.int32(0))


def main() -> int:
    which = sys.argv[1].split(",") if len(sys.argv) > 1 else list(WORKLOADS)
    rows = []
    for name in which:
        lens, d, causal = WORKLOADS[name]
        q, k, v, cu, flops = inputs(lens, d, causal)
        t = int(sum(lens))
        triton = jax.jit(lambda q, k, v, cu: varlen_attention(q, k, v, cu, max_seqlen=max(lens), causal=causal,
                                                              backend="triton"))
        mosaic = jax.jit(lambda q, k, v, cu: varlen_attention(q, k, v, cu, max_seqlen=max(lens), causal=causal,
                                                              backend="mosaic"))
        ref = triton(q, k, v, cu)
        try:
            err = float(relative_l2(mosaic(q, k, v, cu), ref))
        except Exception as e:  # a compile failure must not cost the other workloads' rows
            print(f"{name} mosaic FAILED: {type(e).__name__}: {str(e)[:2000]}", flush=True)
            rows.append(dict(workload=name, impl="mosaic", error=f"{type(e).__name__}: {str(e)[:500]}"))
            continue
        impls = [("triton", triton), ("mosaic", mosaic)]
        errs = {"triton": 0.0, "mosaic": err}
        for variant in VARIANTS:
            f = variant_fn(variant, lens, d, causal)
            try:
                e = float(relative_l2(f(q, k, v, cu), ref))
                print(f"{name} mosaic/{variant} rel L2 vs triton {e:.2e}", flush=True)
                impls.append((f"mosaic/{variant}", f))
                errs[f"mosaic/{variant}"] = e
            except Exception as ex:
                print(f"{name} mosaic/{variant} FAILED: {type(ex).__name__}: {str(ex)[:1500]}", flush=True)
        if UNROLL > 1:
            impls = [(impl, unrolled(f, UNROLL)) for impl, f in impls]
        for (impl, f), s in zip(impls, timeit([f for _, f in impls], q, k, v, cu)):
            s /= UNROLL
            rows.append(dict(workload=name, impl=impl, head_dim=d, causal=causal, num_seqs=len(lens), tokens=t,
                             unroll=UNROLL,
                             median_ms=s * 1e3, tflops=flops / s / 1e12,
                             rel_l2_vs_triton=errs[impl]))
            print(f"{name} {impl:7s} {s * 1e3:8.3f} ms {flops / s / 1e12:7.1f} TFLOP/s  "
                  f"rel L2 vs triton {errs[impl]:.2e}", flush=True)
    out_dir = os.environ.get("OUT", "/tmp")
    out_name = "mosaic_probe.json" if UNROLL == 1 else f"mosaic_probe_unroll{UNROLL}.json"  # two runs, two files
    pathlib.Path(out_dir, out_name).write_text(json.dumps(dict(
        device=jax.devices()[0].device_kind, jax=jax.__version__, date=time.strftime("%Y-%m-%d"),
        commit=os.environ.get("COMMIT", "?"), rows=rows),
        indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
