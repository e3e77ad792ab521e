"""Config sweep of our kernels on the standard workloads (GPU only). Writes JSON rows to $OUT/sweep.json.

Timing: jit, 3 warm-up calls, then the median over 7 repeats of (20 back-to-back calls, one block_until_ready) / 20.
"""
import json, os, sys, time, itertools
import numpy as np, jax, jax.numpy as jnp
sys.path.insert(0, ".")
from pallas_attn import varlen_attention, paged_decode_attention, paged_attention, sparse_mla_attention
from pallas_attn.core.config import PrefillConfig, DecodeConfig, SparseConfig

OUT = os.environ.get("OUT", "/tmp")
rows = []
def timeit(f, *a, reps=7, inner=20):
    for _ in range(3): jax.block_until_ready(f(*a))
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(inner): r = f(*a)
        jax.block_until_ready(r); ts.append((time.perf_counter() - t) / inner)
    return float(np.median(ts)) * 1e3

def rec(workload, impl, cfg, ms, metric, unit):
    rows.append(dict(workload=workload, impl=impl, config=str(cfg), median_ms=ms, metric=metric, unit=unit))
    print(f"{workload:4s} {impl:28s} {ms:9.3f} ms {metric:9.1f} {unit}  {cfg}", flush=True)

key = jax.random.key(0)
def rnd(shape, k):
    return jax.random.normal(jax.random.fold_in(key, k), shape, jnp.bfloat16)

# ceilings
a = rnd((8192, 8192), 1); b = rnd((8192, 8192), 2)
ms = timeit(jax.jit(lambda a, b: a @ b), a, b, inner=5); rec("CEIL", "matmul_bf16", "", ms, 2 * 8192**3 / ms / 1e9, "TFLOP/s")
x = rnd((1 << 30,), 3)
ms = timeit(jax.jit(lambda x: x * 1), x, inner=5); rec("CEIL", "copy", "", ms, 2 * 2 * (1 << 30) / ms / 1e6, "GB/s")
del a, b, x

which = sys.argv[1].split(",") if len(sys.argv) > 1 else ["P1", "P2", "D1", "D2", "V1", "M1", "S1"]
Hq, Hkv, D = 32, 8, 128
def prefill(lens, name, cfgs):
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32); T = int(sum(lens))
    q, k, v = rnd((T, Hq, D), 10), rnd((T, Hkv, D), 11), rnd((T, Hkv, D), 12)
    flops = sum(4 * (l * (l + 1) / 2) * D * Hq for l in lens)
    for cfg in cfgs:
        try:
            f = jax.jit(lambda q, k, v, cu: varlen_attention(q, k, v, cu, max_seqlen=max(lens), config=cfg))
            ms = timeit(f, q, k, v, cu); rec(name, "pallas_attn", cfg, ms, flops / ms / 1e9, "TFLOP/s")
        except Exception as e:
            print(name, cfg, "FAILED", type(e).__name__, str(e)[:300], flush=True)

def paged_cache(ctx, bs, rng, dtype=jnp.bfloat16, heads=Hkv, dim=D):
    pages = [-(-c // bs) for c in ctx]; nb = sum(pages); perm = rng.permutation(nb)
    mb = max(pages); bt = np.full((len(ctx), mb), -1, np.int32); i = 0
    for b, p in enumerate(pages): bt[b, :p] = perm[i:i + p]; i += p
    shape = (nb, bs, heads, dim) if heads else (nb, bs, dim)
    return rnd(shape, 20), rnd(shape, 21), jnp.asarray(bt)

def decode(ctx, name, cfgs, split_opts):
    rng = np.random.default_rng(0)
    kc, vc, bt = paged_cache(ctx, 16, rng); cl = jnp.asarray(ctx, jnp.int32); q = rnd((len(ctx), Hq, D), 30)
    nbytes = sum(ctx) * Hkv * D * 2 * 2 + 2 * q.size * 2
    for cfg, sp in itertools.product(cfgs, split_opts):
        try:
            f = jax.jit(lambda q, kc, vc, bt, cl: paged_decode_attention(q, kc, vc, bt, cl, config=cfg, **sp))
            ms = timeit(f, q, kc, vc, bt, cl); rec(name, f"pallas_attn{sp}", cfg, ms, nbytes / ms / 1e6, "GB/s")
        except Exception as e:
            print(name, cfg, sp, "FAILED", type(e).__name__, str(e)[:300], flush=True)
    return q, kc, vc, bt, cl, nbytes

PCFGS = [PrefillConfig(block_m=bm, block_n=bn, num_warps=w, num_stages=st)
         for (bm, bn, w, st) in [(128, 128, 8, 3), (128, 64, 8, 4), (128, 64, 8, 3)]]
if "P1" in which:
    prefill([8192, 4096, 4096, 2048, 2048, 2048, 1024, 1024, 1024, 1024, 512, 512, 512, 512, 256, 256], "P1", PCFGS)
if "P2" in which:
    prefill([32768], "P2", PCFGS)
DCFGS = [DecodeConfig(block_n=bn, num_warps=w, num_stages=st) for bn, w, st in [(128, 4, 2), (64, 4, 2), (128, 4, 3), (128, 8, 2)]]
if "D1" in which:
    ctx = np.random.default_rng(0).integers(1024, 8193, 64).tolist()
    q, kc, vc, bt, cl, nbytes = decode(ctx, "D1", DCFGS, [dict(), dict(split_size=2048), dict(split_size=4096)])
    cu = jnp.arange(65, dtype=jnp.int32)
    for cfg in DCFGS[:2]:
        f = jax.jit(lambda q, kc, vc, bt, cl, cu: paged_attention(q, kc, vc, bt, cl, cu, max_query_len=1, config=cfg))
        ms = timeit(f, q, kc, vc, bt, cl, cu); rec("D1", "pallas_attn/paged", cfg, ms, nbytes / ms / 1e6, "GB/s")
    del kc, vc
if "D2" in which:
    decode([20000, 35000, 65536, 131072], "D2", DCFGS, [dict(), dict(num_splits=1), dict(num_splits=16), dict(num_splits=32)])
if "V1" in which:
    rng = np.random.default_rng(1); sl = rng.integers(4096, 16385, 32).tolist()
    kc, vc, bt = paged_cache(sl, 16, rng); q = rnd((32 * 6, Hq, D), 40)
    cu = jnp.arange(0, 33 * 6, 6, dtype=jnp.int32); s = jnp.asarray(sl, jnp.int32)
    nbytes = sum(sl) * Hkv * D * 4 + 2 * q.size * 2
    for cfg, sp in itertools.product(DCFGS[:4], [dict(), dict(num_splits=1), dict(num_splits=4)]):
        f = jax.jit(lambda q, kc, vc, bt, s, cu: paged_attention(q, kc, vc, bt, s, cu, max_query_len=6, config=cfg, **sp))
        ms = timeit(f, q, kc, vc, bt, s, cu); rec("V1", f"pallas_attn{sp}", cfg, ms, nbytes / ms / 1e6, "GB/s")
    del kc, vc
if "M1" in which:  # DESIGN.md §4 M1: 4 chunks of 512 over 4096 + 56 decodes 1k..8k + 8 verifications q=6
    rng = np.random.default_rng(2)
    groups = {"chunks": ([4608] * 4, 512), "decodes": (rng.integers(1024, 8193, 56).tolist(), 1),
              "verifs": (rng.integers(1024, 8193, 8).tolist(), 6)}
    sl = sum((g[0] for g in groups.values()), []); ql = sum(([g[1]] * len(g[0]) for g in groups.values()), [])
    kc, vc, bt = paged_cache(sl, 16, rng); T = sum(ql); q = rnd((T, Hq, D), 60)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(ql)]), jnp.int32); s = jnp.asarray(sl, jnp.int32)
    nbytes = sum(sl) * Hkv * D * 4 + 2 * q.size * 2
    flops = sum(4 * D * Hq * sum(c - n + i + 1 for i in range(n)) for c, n in zip(sl, ql))
    print(f"M1: {T} tokens, {nbytes / 1e9:.3f} GB of K/V, {flops / 1e9:.1f} GFLOP", flush=True)
    CHUNK = [None]
    for cc in CHUNK:
        f = jax.jit(lambda q, kc, vc, bt, s, cu: paged_attention(q, kc, vc, bt, s, cu, max_query_len=512, chunk_config=cc))
        ms = timeit(f, q, kc, vc, bt, s, cu); rec("M1", "pallas_attn", cc, ms, nbytes / ms / 1e6, "GB/s")
    from pallas_attn import paged, config as config_lib  # the short launch's own split, forced (chunks unsplit)
    cfg0, ccfg = config_lib.default_decode_config(D, 16, 2), config_lib.default_chunk_config(D, 16, 2)
    for ss, sr in itertools.product([(2, 4096), (4, 2048)], [32, 16]):  # short_rows 16: decodes in 16-row tiles
        f = jax.jit(lambda q, kc, vc, bt, s, cu: paged._ragged_call(
            q, kc, vc, bt, s, cu, max_query_len=512, scale=D ** -0.5, num_splits=1, split_size=None, interpret=False,
            cfg=cfg0, chunk_cfg=ccfg, short_splits=ss, short_rows=sr)[0])
        ms = timeit(f, q, kc, vc, bt, s, cu)
        rec("M1", f"pallas_attn short_splits={ss} short_rows={sr}", "", ms, nbytes / ms / 1e6, "GB/s")
    start = 0  # each group alone (the parts), with the default chunk config
    for name, (lens, n) in groups.items():
        idx = np.arange(start, start + len(lens)); start += len(lens)
        sel = slice(int(cu[idx[0]]), int(cu[idx[-1] + 1])); qq = q[sel]; btt = bt[idx]; ss = s[idx]
        cuu = jnp.asarray(np.concatenate([[0], np.cumsum([n] * len(lens))]), jnp.int32)
        part_bytes = sum(lens) * Hkv * D * 4
        if n == 1:
            f = jax.jit(lambda qq, btt, ss: paged_decode_attention(qq, kc, vc, btt, ss))
            ms = timeit(f, qq, btt, ss); rec("M1", f"part:{name} (decode kernel)", "", ms, part_bytes / ms / 1e6, "GB/s")
            f = jax.jit(lambda qq, btt, ss, cuu: paged_attention(qq, kc, vc, btt, ss, cuu, max_query_len=1))
            ms = timeit(f, qq, btt, ss, cuu); rec("M1", f"part:{name} (paged)", "", ms, part_bytes / ms / 1e6, "GB/s")
        else:
            for cc in (CHUNK if n > 16 else [None]):
                f = jax.jit(lambda qq, btt, ss, cuu: paged_attention(qq, kc, vc, btt, ss, cuu, max_query_len=max(n, 1), chunk_config=cc))
                ms = timeit(f, qq, btt, ss, cuu)
                pf = sum(4 * D * Hq * sum(c - n + i + 1 for i in range(n)) for c in lens)
                rec("M1", f"part:{name}", cc, ms, pf / ms / 1e9, "TFLOP/s")
    del kc, vc
if "S1" in which:
    rng = np.random.default_rng(0); B, H, topk = 64, 128, 2048
    kv, _, bt = paged_cache([32768] * B, 64, rng, heads=None, dim=576); q = rnd((B, H, 576), 50)
    idx = jnp.asarray(np.stack([rng.choice(32768, topk, replace=False) for _ in range(B)]).astype(np.int32))
    flops = B * H * topk * (576 + 512) * 2
    for bn, bh, w, st, vs in [(64, 64, 8, 2, 1), (32, 64, 8, 2, 2), (64, 64, 8, 2, 2), (32, 64, 8, 3, 2)]:
        cfg = SparseConfig(block_n=bn, block_h=bh, num_warps=w, num_stages=st, value_splits=vs)
        try:
            f = jax.jit(lambda q, kv, bt, idx: sparse_mla_attention(q, kv, bt, idx, config=cfg))
            ms = timeit(f, q, kv, bt, idx); rec("S1", "pallas_attn", cfg, ms, flops / ms / 1e9, "TFLOP/s")
        except Exception as e:
            print("S1", cfg, "FAILED", type(e).__name__, str(e)[:300], flush=True)
json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__, rows=rows), open(f"{OUT}/sweep.json", "w"), indent=1)
