"""Compile our Pallas kernels for the H200 (sm_90) on a CPU-only machine and report their resources.

Lowers a public function for CUDA through Pallas's Triton lowering (an abstract H200 device stands in for the GPU),
takes the Triton IR of each ``pallas_call``, compiles it with the ``triton`` package (3.6, the GPU machine's version;
its wheel bundles ``ptxas`` and ``cuobjdump``) with that call's own ``num_warps`` / ``num_stages``, and prints
registers, spill stack, shared memory and whether the PTX uses wgmma. Costs no GPU time: use it before a device call
to drop configs that spill or overflow shared memory (e.g. 128×128 prefill tiles with 4 stages need 288 KB of the
227 KB an SM has). The lowering, compile and parsers are :mod:`pallas_attn.inspection.compiled`'s; ``pallas-attn
inspect`` shows the same facts for one kernel with its instruction mix and fragment maps.

    pip install triton==3.6.0
    python tools/offline_compile.py            # the default configs of every kernel on the standard shapes
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pallas_attn.inspection import compiled  # noqa: E402


def report(fn, args, *, label: str) -> list[dict]:
    """Resources of every Pallas Triton launch in ``jax.jit(fn)(*args)`` (abstract args: ShapeDtypeStructs), each
    compiled with the ``num_warps`` / ``num_stages`` its ``pallas_call`` asks for."""
    launches = [launch for launch in compiled.lower_launches(fn, args) if launch.backend == "triton"]
    print(f"{label}: {len(launches)} pallas_call(s) lowered", flush=True)
    rows = []
    for i, launch in enumerate(launches):
        artifacts = compiled.compile_triton(launch)
        ptxas, _ = compiled.run_ptxas(artifacts.ptx, compiled.triton_bin("ptxas"))
        row = dict(label=f"{label}[{i}]", warps=launch.num_warps, stages=launch.num_stages, regs=ptxas.registers,
                   spill_stack=ptxas.stack_frame, smem=artifacts.shared, wgmma="wgmma" in artifacts.ptx)
        print(f"{row['label']:48s} warps={row['warps']} stages={row['stages']} regs={row['regs']:3d} "
              f"stack={row['spill_stack']:4d} B  smem={row['smem']:6d} B  wgmma={row['wgmma']}", flush=True)
        rows.append(row)
    return rows


def main():
    from pallas_attn import (
        mla_attention,
        paged_attention,
        paged_decode_attention,
        sparse_mla_attention,
        varlen_attention,
    )
    from pallas_attn.core import config as cfg

    S, bf16, i32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.int32
    p = cfg.default_prefill_config(128)
    report(lambda q, k, v, cu: varlen_attention(q, k, v, cu, max_seqlen=8192, interpret=False, backend="triton"),
           (S((29184, 32, 128), bf16), S((29184, 8, 128), bf16), S((29184, 8, 128), bf16), S((17,), i32)),
           label=f"prefill {p}")
    d = cfg.default_decode_config(128, 16)
    cache = S((16384, 16, 8, 128), bf16)
    report(lambda q, kc, vc, bt, cl: paged_decode_attention(q, kc, vc, bt, cl, num_splits=1, interpret=False),
           (S((64, 32, 128), bf16), cache, cache, S((64, 512), i32), S((64,), i32)), label=f"decode {d}")
    report(lambda q, kc, vc, bt, sl, cu: paged_attention(q, kc, vc, bt, sl, cu, max_query_len=8, num_splits=1,
                                                          interpret=False),
           (S((256, 32, 128), bf16), cache, cache, S((32, 1024), i32), S((32,), i32), S((33,), i32)),
           label=f"ragged {d}")
    c = cfg.default_chunk_config(128, 16)  # M1-like: prefill chunks beside decodes, two launches
    report(lambda q, kc, vc, bt, sl, cu: paged_attention(q, kc, vc, bt, sl, cu, max_query_len=512, num_splits=1,
                                                          interpret=False),
           (S((2152, 32, 128), bf16), cache, cache, S((68, 512), i32), S((68,), i32), S((69,), i32)),
           label=f"ragged short + chunk {c}")
    s = cfg.default_sparse_config(128)
    report(lambda q, kv, bt, idx: sparse_mla_attention(q, kv, bt, idx, interpret=False, backend="triton"),
           (S((64, 128, 576), bf16), S((32768, 64, 576), bf16), S((64, 512), i32), S((64, 2048), i32)),
           label=f"sparse {s}")
    for d in (64, 128, 256):  # the varlen backward (dK / dV, then dQ) after its forward, P1-like shapes
        def grads(q, k, v, cu):
            loss = lambda q, k, v: varlen_attention(q, k, v, cu, max_seqlen=8192, interpret=False,  # noqa: E731
                                                    backend="triton").astype(jnp.float32).sum()
            return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

        report(grads, (S((8192, 32, d), bf16), S((8192, 8, d), bf16), S((8192, 8, d), bf16), S((3,), i32)),
               label=f"varlen forward + backward d{d} {cfg.default_backward_config(d)}")
    latent = S((128 * 128, 64, 576), bf16)  # dense MLA: L1 (16 heads decoding) and L2 (128 heads, 2 tokens a step)
    report(lambda q, kv, bt, sl: mla_attention(q, kv, bt, sl, num_splits=1, interpret=False, backend="triton"),
           (S((128, 16, 576), bf16), latent, S((128, 128), i32), S((128,), i32)),
           label=f"mla L1 {cfg.default_mla_config(16, 1)}")
    report(lambda q, kv, bt, sl, cu: mla_attention(q, kv, bt, sl, cu, max_query_len=2, num_splits=1, interpret=False,
                                                   backend="triton"),
           (S((128, 128, 576), bf16), latent, S((64, 128), i32), S((64,), i32), S((65,), i32)),
           label=f"mla L2 {cfg.default_mla_config(128, 2)}")


if __name__ == "__main__":
    main()
