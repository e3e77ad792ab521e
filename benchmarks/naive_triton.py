"""The anchor ``naive_triton``: naive Triton varlen prefill (one program per request tile, no tile classes), called
through jax-triton.

The textbook design (vLLM's ``triton_prefill_attention``): grid ``(batch, num_heads, cdiv(max_input_len,
BLOCK_M))``; each program reads its request's ``start_loc``/``seq_len``, exits when its tile starts past the request,
loads ``Q[start + offs_m]``, loops over key tiles up to the causal end, masks every tile with
``offs_m >= start_n + offs_n`` (full tiles pay for the mask too), ``tl.where(mask, qk * sm_scale, -1.0e8)``, and
keeps the online-softmax state in registers. It measures what the plain design gives without tile classes, GQA row
packing, exp2 with a folded scale or tuned tiles.

Needs the `triton` extra (jax-triton 0.3.1, the release that accepts triton 3.6); `scripts/fetch_wheels.sh` brings
the wheel for a GPU machine without internet. Without jax-triton the anchor records an error row.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.impls import Options, Prepared, identity
from benchmarks.workloads import Batch

BLOCK_M, BLOCK_N = 128, 64


def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def naive_prefill_kernel(Q, K, V, B_Start_Loc, B_Seqlen, Out, sm_scale,
                            stride_qbs, stride_qh, stride_kbs, stride_kh,
                            kv_group_num: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_DMODEL: tl.constexpr,
                            BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr):
        cur_batch = tl.program_id(0)
        cur_head = tl.program_id(1)
        start_m = tl.program_id(2)
        cur_kv_head = cur_head // kv_group_num
        cur_batch_seq_len = tl.load(B_Seqlen + cur_batch)
        cur_batch_start = tl.load(B_Start_Loc + cur_batch)
        if start_m * BLOCK_M >= cur_batch_seq_len:  # the tile starts past the request: exit at once
            return
        offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_DMODEL)
        q_ptrs = Q + (cur_batch_start + offs_m[:, None]) * stride_qbs + cur_head * stride_qh + offs_d[None, :]
        q = tl.load(q_ptrs, mask=offs_m[:, None] < cur_batch_seq_len, other=0.0)
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DMODEL], dtype=tl.float32)
        end_n = tl.minimum((start_m + 1) * BLOCK_M, cur_batch_seq_len) if IS_CAUSAL else cur_batch_seq_len
        for start_n in range(0, end_n, BLOCK_N):
            k_pos = start_n + offs_n
            kv_off = (cur_batch_start + k_pos[:, None]) * stride_kbs + cur_kv_head * stride_kh + offs_d[None, :]
            k = tl.load(K + kv_off, mask=k_pos[:, None] < cur_batch_seq_len, other=0.0)
            qk = tl.dot(q, tl.trans(k))
            mask = k_pos[None, :] < cur_batch_seq_len
            if IS_CAUSAL:
                mask = mask & (offs_m[:, None] >= k_pos[None, :])
            qk = tl.where(mask, qk * sm_scale, -1.0e8)
            m_ij = tl.maximum(m_i, tl.max(qk, 1))
            p = tl.exp(qk - m_ij[:, None])
            alpha = tl.exp(m_i - m_ij)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]
            v = tl.load(V + kv_off, mask=k_pos[:, None] < cur_batch_seq_len, other=0.0)
            acc += tl.dot(p.to(v.dtype), v)
            m_i = m_ij
        acc = acc / l_i[:, None]
        o_ptrs = Out + (cur_batch_start + offs_m[:, None]) * stride_qbs + cur_head * stride_qh + offs_d[None, :]
        tl.store(o_ptrs, acc.to(Out.dtype.element_ty), mask=offs_m[:, None] < cur_batch_seq_len)

    return naive_prefill_kernel


def prepare_naive_triton(batches: list[Batch], options: Options) -> Prepared:
    if options.interpret:
        raise RuntimeError("naive_triton needs a GPU (jax-triton has no interpret mode)")
    import jax_triton as jt  # the `triton` extra

    kernel = _kernel()
    host = batches[0].host
    spec = host.spec
    hq, hkv, d = spec.num_q_heads, spec.num_kv_heads, spec.head_dim
    starts = jnp.asarray(host.cu_query_lens[:-1], jnp.int32)
    lens = jnp.asarray(host.q_lens, jnp.int32)
    grid = (host.num_seqs, hq, math.ceil(int(np.max(host.q_lens)) / BLOCK_M))

    @jax.jit
    def fn(q, k, v, starts, lens):
        return jt.triton_call(
            q, k, v, starts, lens, kernel=kernel, out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype), grid=grid,
            num_warps=8 if d >= 128 else 4, num_stages=2,
            sm_scale=1.0 / math.sqrt(d), stride_qbs=hq * d, stride_qh=d, stride_kbs=hkv * d, stride_kh=d,
            kv_group_num=hq // hkv, BLOCK_M=BLOCK_M, BLOCK_DMODEL=d, BLOCK_N=BLOCK_N, IS_CAUSAL=True)

    args = [(b.arrays["q"], b.arrays["k"], b.arrays["v"], starts, lens) for b in batches]
    return Prepared(fn, args, identity, note=f"plain Triton via jax-triton, BLOCK_M={BLOCK_M} BLOCK_N={BLOCK_N}")
