"""S1 probe for the sparse MLA kernel (issue 6): variants of the kernel and its config on the harness's S1 batch,
each checked against the reference (f32, relative L2) and timed like the harness. GPU only.

    VARIANTS="prev:64:64:8:2,new:64:64:8:2,mosaic" python scripts/probe_sparse.py   # rows to $OUT/sparse_probe.json
    SHAPES="1:8192:128:2048,256:8192:128:2048" VARIANTS=mosaic,new:64:64:8:2 python scripts/probe_sparse.py

``new`` is the package's Triton kernel (``block_n:block_h:warps:stages``), ``prev`` ``scripts/_sparse_prev.py`` (a
copy of the Triton kernel before a change, when present: put it there to compare), ``mosaic[:r:r:r[:score_cols]]``
the Mosaic kernel (registers of the score, value and memory warpgroups; value columns of the score warpgroup),
``mprev[:r:r...]`` ``scripts/_sparse_mosaic_prev.py`` (a copy of the Mosaic kernel before a change, likewise).
Hostile inputs (unused entries, NaN in unowned pages, padding tokens) are the compiled tests' job
(``tests/test_sparse.py``; ``scripts/gpu_sparse.sh`` runs them first).
"""
import dataclasses, importlib.util, json, os, sys, time
import numpy as np, jax, jax.numpy as jnp
sys.path.insert(0, ".")
from benchmarks import workloads, timing
from pallas_attn.core import config as config_lib
import pallas_attn.ops.sparse_mla as new_mod
import reference

mods = {"new": new_mod}
mosaic_mods = {"mosaic": new_mod.sparse_mosaic}
for key, table, file in (("prev", mods, "_sparse_prev.py"), ("mprev", mosaic_mods, "_sparse_mosaic_prev.py")):
    path = os.path.join(os.path.dirname(__file__), file)
    if os.path.exists(path):
        s = importlib.util.spec_from_file_location(file[:-3], path)
        table[key] = importlib.util.module_from_spec(s); s.loader.exec_module(table[key])


def specs():
    """S1 (or its tiny twin), or with ``SHAPES="requests:ctx:heads:topk,..."`` decode batches of other sizes (block
    size 64, top-k distinct positions of each request, as S1's)."""
    if not os.environ.get("SHAPES"):
        return workloads.get_specs(["S1"], tiny=bool(os.environ.get("TINY")))
    s1 = workloads.get_specs(["S1"])[0]
    out = []
    for shape in os.environ["SHAPES"].split(","):
        n, ctx, heads, topk = map(int, shape.split(":"))
        out.append(dataclasses.replace(s1, id=f"S1-{shape}", what=shape, groups=(workloads.Group((ctx,) * n, 1),),
                                       num_q_heads=heads, topk=topk))
    return out


def variant_fn(v):
    kind, *rest = v.split(":")
    if kind in mosaic_mods:
        kw = dict(registers=tuple(map(int, rest[:3]))) if rest else {}
        if len(rest) > 3:
            kw["score_cols"] = int(rest[3])
        return jax.jit(lambda *x, m=mosaic_mods[kind], kw=kw: m.sparse_mla_mosaic(
            *x[:4], jnp.arange(x[0].shape[0], dtype=jnp.int32), kv_lora_rank=512, scale=576 ** -0.5, **kw)[0])
    name, bn, bh, w, st = v.split(":")
    cfg = config_lib.SparseConfig(block_n=int(bn), block_h=int(bh), num_warps=int(w), num_stages=int(st))
    return jax.jit(lambda *x, cfg=cfg, name=name: mods[name].sparse_mla_attention(*x, config=cfg))


rows = []
for spec in specs():
    host = workloads.build_host(spec)
    # like the harness: inputs that fit in L2 rotate over several sets, so no call is served from a warm L2
    sets = [workloads.build_arrays(host, jax.random.key(i)).arrays for i in range(workloads.num_input_sets(host))]
    arg_sets = [(a["q"], a["kv_cache"], a["block_tables"], a["topk_indices"]) for a in sets]
    args = arg_sets[0]
    ref = np.asarray(reference.sparse_mla_attention(*[x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x
                                                     for x in args]), np.float32)
    flops, gathered = host.flops(), host.bytes_moved()  # the harness's counts
    for v in os.environ.get("VARIANTS", "new:64:64:8:2").split(","):
        try:
            fn = variant_fn(v)
            out = np.asarray(fn(*args), np.float32)
            err = float(np.linalg.norm(out - ref) / np.linalg.norm(ref)) if np.all(np.isfinite(out)) else float("nan")
            t = timing.time_fn(fn, arg_sets)
        except Exception as e:  # a config that does not compile is a result too
            print(v, "FAILED", type(e).__name__, str(e)[:300], flush=True)
            rows.append(dict(workload=spec.id, variant=v, error=f"{type(e).__name__}: {str(e)[:300]}"))
            continue
        row = dict(workload=spec.id, variant=v, median_ms=t.median_s * 1e3, spread=t.spread, rel_l2=err,
                   tflops=flops / t.median_s / 1e12, gathered_gbs=gathered / t.median_s / 1e9, input_sets=len(sets))
        rows.append(row)
        print(json.dumps(row), flush=True)
json.dump(dict(device=str(jax.devices()[0].device_kind), jax=jax.__version__, jaxlib=jax.lib.__version__,
               date=time.strftime("%Y-%m-%d"), rows=rows),
          open(os.path.join(os.environ.get("OUT", "/tmp"), os.environ.get("PROBE_NAME", "sparse_probe") + ".json"),
               "w"), indent=1)
