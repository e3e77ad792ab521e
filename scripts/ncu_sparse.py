"""Run the S1 sparse kernel twice for a profiler (GPU only):

    ncu --section WarpStateStats --kernel-name regex:sparse --launch-skip 1 --launch-count 1 \
        python3 scripts/ncu_sparse.py prev:64:64:8:2     # or new:64:64:8:2, mosaic
"""
import importlib.util, os, sys
import jax
sys.path.insert(0, ".")
from benchmarks import workloads
from pallas_attn.core import config as config_lib
import pallas_attn.ops.sparse_mla as new_mod

name, *rest = sys.argv[1].split(":")
mod = new_mod
if name == "prev":
    path = os.path.join(os.path.dirname(__file__), "_sparse_prev.py")  # a copy of the kernel before a change
    s = importlib.util.spec_from_file_location("sparse_prev", path)
    mod = importlib.util.module_from_spec(s); s.loader.exec_module(mod)
a = workloads.build_arrays(workloads.build_host(workloads.get_specs(["S1"])[0]), jax.random.key(0)).arrays
if name == "mosaic":  # note: ncu's source counters hit an illegal address with this kernel (2026-11-30)
    fn = jax.jit(lambda *x: mod.sparse_mla_attention(*x, backend="mosaic"))
else:
    bn, bh, w, st = map(int, rest)
    cfg = config_lib.SparseConfig(block_n=bn, block_h=bh, num_warps=w, num_stages=st)
    fn = jax.jit(lambda *x: mod.sparse_mla_attention(*x, config=cfg))
for _ in range(2):
    jax.block_until_ready(fn(a["q"], a["kv_cache"], a["block_tables"], a["topk_indices"]))
