"""Per-kernel device time of M1, mixed call vs its parts (GPU only; run under ncu):

    ncu --clock-control none --metrics gpu__time_duration.sum --csv python3 scripts/m1_kernels.py > kernels.csv

Each variant runs twice (compile, then the profiled call); NVTX-free: the kernel names tell the launches apart.
"""
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, ".")
from pallas_attn import paged_attention, paged_decode_attention  # noqa: E402

Hq, Hkv, D, BS = 32, 8, 128, 16
key = jax.random.key(0)
rng = np.random.default_rng(2)
groups = {"chunks": ([4608] * 4, 512), "decodes": (rng.integers(1024, 8193, 56).tolist(), 1),
          "verifs": (rng.integers(1024, 8193, 8).tolist(), 6)}
sl = sum((g[0] for g in groups.values()), [])
ql = sum(([g[1]] * len(g[0]) for g in groups.values()), [])
pages = [-(-c // BS) for c in sl]
perm = rng.permutation(sum(pages))
bt = np.zeros((len(sl), max(pages)), np.int32)
i = 0
for b, p in enumerate(pages):
    bt[b, :p] = perm[i:i + p]
    i += p
kc = jax.random.normal(jax.random.fold_in(key, 1), (sum(pages), BS, Hkv, D), jnp.bfloat16)
vc = jax.random.normal(jax.random.fold_in(key, 2), (sum(pages), BS, Hkv, D), jnp.bfloat16)
q = jax.random.normal(jax.random.fold_in(key, 3), (sum(ql), Hq, D), jnp.bfloat16)
cu = np.concatenate([[0], np.cumsum(ql)]).astype(np.int32)
bt, s = jnp.asarray(bt), jnp.asarray(sl, jnp.int32)

mode = sys.argv[1] if len(sys.argv) > 1 else "both"
if mode in ("both", "mixed"):
    f = jax.jit(lambda q, bt, s, cu: paged_attention(q, kc, vc, bt, s, cu, max_query_len=512))
    for _ in range(2):
        jax.block_until_ready(f(q, bt, s, jnp.asarray(cu)))
if mode in ("both", "parts"):
    start = 0
    for name, (lens, n) in groups.items():
        idx = np.arange(start, start + len(lens))
        start += len(lens)
        qq = q[int(cu[idx[0]]):int(cu[idx[-1] + 1])]
        cuu = jnp.asarray(np.concatenate([[0], np.cumsum([n] * len(lens))]), jnp.int32)
        if n == 1:
            f = jax.jit(lambda qq, btt, ss, cuu: paged_decode_attention(qq, kc, vc, btt, ss))
        else:
            f = jax.jit(lambda qq, btt, ss, cuu, n=n: paged_attention(qq, kc, vc, btt, ss, cuu, max_query_len=n))
        for _ in range(2):
            jax.block_until_ready(f(qq, bt[idx], s[idx], cuu))
if mode == "time":  # the short launch's config and split, timed (not under ncu)
    import itertools
    import time

    from pallas_attn import DecodeConfig
    from pallas_attn.core import config as config_lib
    from pallas_attn.ops import paged
    ccfg = config_lib.default_chunk_config(D, BS, 2)
    for cfg, ss in itertools.product(
            [DecodeConfig(block_n=128), DecodeConfig(block_n=64), DecodeConfig(block_n=128, num_stages=3),
             DecodeConfig(block_n=64, num_warps=2), DecodeConfig(block_n=128, num_warps=8)],
            [(1, None), (2, 4096), (4, 2048)]):
        f = jax.jit(lambda q, bt, s, cu: paged._ragged_call(
            q, kc, vc, bt, s, cu, max_query_len=512, scale=D ** -0.5, num_splits=1, split_size=None,
            interpret=False, cfg=cfg, chunk_cfg=ccfg, short_splits=ss)[0])
        args = (q, bt, s, jnp.asarray(cu))
        for _ in range(3):
            jax.block_until_ready(f(*args))
        ts = []
        for _ in range(9):
            t = time.perf_counter()
            for _ in range(20):
                r = f(*args)
            jax.block_until_ready(r)
            ts.append((time.perf_counter() - t) / 20)
        print(f"TIME {cfg} short_splits={ss}: {np.median(ts) * 1e3:.4f} ms", flush=True)
print("done")
