"""Compile our Pallas kernels for the H200 (sm_90) on a CPU-only machine and report their resources.

Lowers a public function for CUDA through Pallas's Triton lowering (with a stand-in H200 device description), takes
the Triton IR of each ``pallas_call``, compiles it with the ``triton`` package (3.6, the GPU machine's version; its
wheel bundles ``ptxas`` and ``cuobjdump``) and prints registers, spill stack, shared memory and whether the PTX
uses wgmma. Costs no GPU time: use it before a device call to drop configs that spill or overflow shared memory
(e.g. 128×128 prefill tiles with 4 stages need 288 KB of the 227 KB an SM has).

    pip install triton==3.6.0
    python tools/offline_compile.py            # the default configs of every kernel on the standard shapes
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
from jax._src.pallas.triton import gpu_info, lowering, pallas_call_registration as registration
from ptx_schedule import triton_bin  # tools/ (this script's directory) is on sys.path

_H200 = gpu_info.GpuInfo(gpu_version=gpu_info.GpuVersion.H200, arch_name="sm_90", compute_capability=90)
registration.gpu_info_lib.get_gpu_info = lambda: _H200  # lower for an H200 without one
_lower = lowering.lower_jaxpr_to_triton_module
_modules: list[str] = []


def _capture(*args, **kwargs):
    result = _lower(*args, **kwargs)
    _modules.append(result.module.operation.get_asm(enable_debug_info=False))
    return result


registration.lowering.lower_jaxpr_to_triton_module = _capture


def report(fn, args, *, num_warps: int, num_stages: int, label: str, launches=None) -> list[dict]:
    """Resources of every pallas_call in ``jax.jit(fn)(*args)`` (abstract args: ShapeDtypeStructs).

    ``launches``: per-pallas_call ``(num_warps, num_stages)`` when the calls differ (paged_attention's two
    launches); otherwise every call uses ``num_warps`` / ``num_stages``."""
    import triton
    from triton.backends.compiler import GPUTarget

    _modules.clear()
    jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    print(f"{label}: {len(_modules)} pallas_call(s) lowered", flush=True)
    rows = []
    for i, ttir in enumerate(_modules):
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "kernel.ttir")
            open(path, "w").write(ttir)
            warps, stages = launches[i] if launches else (num_warps, num_stages)
            compiled = triton.compile(path, target=GPUTarget("cuda", 90, 32),
                                      options=dict(num_warps=warps, num_stages=stages))
            cubin = os.path.join(tmp, "kernel.cubin")
            open(cubin, "wb").write(compiled.asm["cubin"])
            usage = subprocess.run([triton_bin("cuobjdump"), "-res-usage", cubin], capture_output=True,
                                   text=True).stdout
        regs, stack = re.search(r"REG:(\d+).*?STACK:(\d+)", usage).groups()
        row = dict(label=f"{label}[{i}]", regs=int(regs), spill_stack=int(stack), smem=compiled.metadata.shared,
                   wgmma="wgmma" in compiled.asm["ptx"])
        print(f"{row['label']:48s} regs={row['regs']:3d} stack={row['spill_stack']:4d} B  smem={row['smem']:6d} B  "
              f"wgmma={row['wgmma']}", flush=True)
        rows.append(row)
    return rows


def main():
    from pallas_attn import paged_attention, paged_decode_attention, sparse_mla_attention, varlen_attention
    from pallas_attn.core import config as cfg

    S, bf16, i32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.int32
    p = cfg.default_prefill_config(128)
    report(lambda q, k, v, cu: varlen_attention(q, k, v, cu, max_seqlen=8192, interpret=False),
           (S((29184, 32, 128), bf16), S((29184, 8, 128), bf16), S((29184, 8, 128), bf16), S((17,), i32)),
           num_warps=p.num_warps, num_stages=p.num_stages, label=f"prefill {p}")
    d = cfg.default_decode_config(128, 16)
    cache = S((16384, 16, 8, 128), bf16)
    report(lambda q, kc, vc, bt, cl: paged_decode_attention(q, kc, vc, bt, cl, num_splits=1, interpret=False),
           (S((64, 32, 128), bf16), cache, cache, S((64, 512), i32), S((64,), i32)),
           num_warps=d.num_warps, num_stages=d.num_stages, label=f"decode {d}")
    report(lambda q, kc, vc, bt, sl, cu: paged_attention(q, kc, vc, bt, sl, cu, max_query_len=8, num_splits=1,
                                                          interpret=False),
           (S((256, 32, 128), bf16), cache, cache, S((32, 1024), i32), S((32,), i32), S((33,), i32)),
           num_warps=d.num_warps, num_stages=d.num_stages, label=f"ragged {d}")
    c = cfg.default_chunk_config(128, 16)  # M1-like: prefill chunks beside decodes, two launches
    report(lambda q, kc, vc, bt, sl, cu: paged_attention(q, kc, vc, bt, sl, cu, max_query_len=512, num_splits=1,
                                                          interpret=False),
           (S((2152, 32, 128), bf16), cache, cache, S((68, 512), i32), S((68,), i32), S((69,), i32)),
           num_warps=d.num_warps, num_stages=d.num_stages, label=f"ragged short + chunk {c}",
           launches=[(d.num_warps, d.num_stages), (c.num_warps, c.num_stages)])
    s = cfg.default_sparse_config(128)
    report(lambda q, kv, bt, idx: sparse_mla_attention(q, kv, bt, idx, interpret=False),
           (S((64, 128, 576), bf16), S((32768, 64, 576), bf16), S((64, 512), i32), S((64, 2048), i32)),
           num_warps=s.num_warps, num_stages=s.num_stages, label=f"sparse {s}")


if __name__ == "__main__":
    main()
