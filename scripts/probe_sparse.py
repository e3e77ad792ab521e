"""S1 probe for the sparse MLA kernel (issue 6): variants of the kernel and its config on the harness's S1 batch,
each checked against the reference (f32, relative L2) and timed like the harness. GPU only.

    VARIANTS="prev:64:64:8:2,new:64:64:8:2,mosaic" python scripts/probe_sparse.py   # rows to $OUT/sparse_probe.json

``new`` is the package's Triton kernel (``block_n:block_h:warps:stages``), ``prev`` ``scripts/_sparse_prev.py`` (a
copy of the Triton kernel before a change, when present: put it there to compare), ``mosaic[:r:r:r[:score_cols]]``
the Mosaic kernel (registers of the score, value and memory warpgroups; value columns of the score warpgroup),
``mprev[:r:r...]`` ``scripts/_sparse_mosaic_prev.py`` (a copy of the Mosaic kernel before a change, likewise).
Hostile inputs (unused entries, NaN in unowned pages, padding tokens) are the compiled tests' job
(``tests/test_sparse.py``; ``scripts/gpu_sparse.sh`` runs them first).
"""
import importlib.util, json, os, sys
import numpy as np, jax, jax.numpy as jnp
sys.path.insert(0, ".")
from benchmarks import workloads, timing
from pallas_attn import config as config_lib
import pallas_attn.sparse as new_mod
import reference

spec = workloads.get_specs(["S1"], tiny=bool(os.environ.get("TINY")))[0]
host = workloads.build_host(spec)
batch = workloads.build_arrays(host, jax.random.key(0))
a = batch.arrays
args = (a["q"], a["kv_cache"], a["block_tables"], a["topk_indices"])
ref = np.asarray(reference.sparse_mla_attention(*[x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x
                                                 for x in args]), np.float32)
flops, gathered = host.flops(), host.bytes_moved()  # the harness's counts
mods = {"new": new_mod}
mosaic_mods = {"mosaic": new_mod.sparse_mosaic}
for key, table, file in (("prev", mods, "_sparse_prev.py"), ("mprev", mosaic_mods, "_sparse_mosaic_prev.py")):
    path = os.path.join(os.path.dirname(__file__), file)
    if os.path.exists(path):
        s = importlib.util.spec_from_file_location(file[:-3], path)
        table[key] = importlib.util.module_from_spec(s); s.loader.exec_module(table[key])


rows = []
for v in os.environ.get("VARIANTS", "new:64:64:8:2").split(","):
    kind, *rest = v.split(":")
    if kind in mosaic_mods:
        kw = dict(registers=tuple(map(int, rest[:3]))) if rest else {}
        if len(rest) > 3:
            kw["score_cols"] = int(rest[3])
        fn = jax.jit(lambda *x, m=mosaic_mods[kind], kw=kw: m.sparse_mla_mosaic(
            *x[:4], jnp.arange(x[0].shape[0], dtype=jnp.int32), kv_lora_rank=512, scale=576 ** -0.5, **kw)[0])
    else:
        name, bn, bh, w, st = v.split(":")
        cfg = config_lib.SparseConfig(block_n=int(bn), block_h=int(bh), num_warps=int(w), num_stages=int(st))
        fn = jax.jit(lambda *x, cfg=cfg, name=name: mods[name].sparse_mla_attention(*x, config=cfg))
    try:
        out = np.asarray(fn(*args), np.float32)
        err = float(np.linalg.norm(out - ref) / np.linalg.norm(ref)) if np.all(np.isfinite(out)) else float("nan")
        t = timing.time_fn(fn, [args])
    except Exception as e:  # a config that does not compile is a result too
        print(v, "FAILED", type(e).__name__, str(e)[:300], flush=True)
        rows.append(dict(variant=v, error=f"{type(e).__name__}: {str(e)[:300]}"))
        continue
    row = dict(workload="S1", variant=v, median_ms=t.median_s * 1e3, spread=t.spread, rel_l2=err,
               tflops=flops / t.median_s / 1e12, gathered_gbs=gathered / t.median_s / 1e9)
    rows.append(row)
    print(json.dumps(row), flush=True)
json.dump(dict(device=str(jax.devices()[0].device_kind), jax=jax.__version__, rows=rows),
          open(os.path.join(os.environ.get("OUT", "/tmp"), os.environ.get("PROBE_NAME", "sparse_probe") + ".json"),
               "w"), indent=1)
