"""Packed varlen prefill attention (seed §1–§6, §11).

Requests are packed along the token axis: ``q [T, Hq, D]``, ``k, v [T, Hkv, D]``, request ``b`` owning rows
``[cu_seqlens[b], cu_seqlens[b+1])``. The grid is ``(q_tiles, Hkv * groups, batch + 1)``: program ``(m, h, b)``
owns one request × one KV head (``heads_per_program`` of its query heads, which share every K/V tile) × one query
tile. It reads ``seq_start``/``seq_len`` for ``b`` from ``cu_seqlens``, exits at once when its tile starts past the
request, touches only rows ``[seq_start, seq_start + seq_len)`` and builds the causal mask in registers from
request-local positions (``pos_q >= pos_k``). Full tiles (■) run with no mask code, diagonal tiles (△) are
masked element-wise, future tiles (·) are never loaded (see :mod:`pallas_attn.masks`). Query tiles are visited
longest-first (reversed ``m``) so the causal tail does not straggle.

The extra program row ``b == batch`` writes zeros into the padding rows ``[cu_seqlens[-1], T)``, so they are
finite without a second pass over the output.

Reference: :func:`pallas_attn.reference.varlen_attention`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_attn import backend as backend_lib, config as config_lib, masks, prefill_mosaic, softmax, tiles, validation


# ---------------------------------------------------------------------------------------------------- config
def _heads_per_program(group: int, requested: int | None, block_m: int) -> int:
    """Query heads of one KV group per program: the largest power of two dividing the group (≤ 8, ≤ block_m)."""
    if requested is not None:
        if group % requested:
            raise ValueError(f"heads_per_program={requested} must divide the GQA group size {group}")
        return min(requested, block_m)
    hp = 1
    while hp * 2 <= min(group, 8, block_m) and group % (hp * 2) == 0:
        hp *= 2
    return hp


# ---------------------------------------------------------------------------------------------- kernel body
def _prefill_kernel(
    # inputs
    cu_seqlens_ref,  # i32[num_seqs + 1]
    q_ref,  # [T * Hq, Dp]  (flattened; row = token * Hq + q_head)
    k_ref,  # [T * Hkv, Dp]
    v_ref,  # [T * Hkv, Dp]
    # outputs
    o_ref,  # [T * Hq, Dp]
    *lse_refs,  # f32[T * Hq] when return_lse
    num_seqs: int, num_tokens: int, num_q_heads: int, num_kv_heads: int, head_dim: int, heads_per_program: int,
    block_q: int, block_n: int, causal: bool, scale2: float, precision, exp2,
):
    hp = heads_per_program
    group = num_q_heads // num_kv_heads
    num_q_tiles = pl.num_programs(0)
    m = num_q_tiles - 1 - pl.program_id(0)  # longest-first
    first_q_head = pl.program_id(1) * hp
    kv_head = first_q_head // group
    b = pl.program_id(2)
    cols = tiles.Cols(head_dim, q_ref.shape[-1])
    row = jnp.arange(block_q * hp)
    local_tok = m * block_q + row // hp  # [M] request-local query position of each row
    q_head = first_q_head + row % hp  # [M]
    dot = functools.partial(jnp.dot, preferred_element_type=jnp.float32, precision=precision)

    @pl.when(b < num_seqs)
    def _attend():
        seq_start = cu_seqlens_ref[b]
        seq_len = cu_seqlens_ref[b + 1] - seq_start

        @pl.when(m * block_q < seq_len)  # tiles past the request exit at once
        def _tile():
            row_valid = local_tok < seq_len
            q_rows = (seq_start + local_tok) * num_q_heads + q_head
            q = tiles.load_rows(q_ref, q_rows, cols, row_valid)  # [M, Dp]
            q_last = jnp.minimum((m + 1) * block_q, seq_len) - 1
            full_end, kv_end = masks.kv_tile_ranges(m * block_q, q_last, seq_len, block_n, causal=causal)

            def step(j, state, masked):
                k_pos = j * block_n + jnp.arange(block_n)  # [N]
                kv_rows = (seq_start + k_pos) * num_kv_heads + kv_head
                k_valid = (k_pos < seq_len) if masked else None
                k = tiles.load_rows(k_ref, kv_rows, cols, k_valid)  # [N, Dp]
                v = tiles.load_rows(v_ref, kv_rows, cols, k_valid)  # [N, Dp]
                s2 = dot(q, k.T) * scale2  # [M, N] base-2 scores
                if masked:
                    visible = (masks.causal_mask(local_tok, k_pos, seq_len) if causal
                               else masks.length_mask(local_tok, k_pos, seq_len))
                    s2 = jnp.where(visible, s2, -jnp.inf)
                return softmax.online_softmax_step(state, s2, v, dot, exp2)

            state = softmax.kv_loop(softmax.init_state(block_q * hp, q_ref.shape[-1]), 0, full_end, kv_end, step)
            out, lse = softmax.finalize(state)
            tiles.store_rows(o_ref, q_rows, cols, out, row_valid)
            if lse_refs:
                tiles.store_vector(lse_refs[0], q_rows, lse, row_valid)

    @pl.when(b == num_seqs)
    def _zero_padding():  # rows [cu_seqlens[-1], T) of these heads: finite zeros, no second pass
        pad_start = cu_seqlens_ref[num_seqs]
        stride = num_q_tiles * block_q
        first = pad_start + m * block_q

        def zero(i, carry):
            tok = first + i * stride + row // hp
            tok_valid = tok < num_tokens
            rows = tok * num_q_heads + q_head
            tiles.store_rows(o_ref, rows, cols, jnp.zeros((row.shape[0], q_ref.shape[-1]), jnp.float32), tok_valid)
            if lse_refs:
                tiles.store_vector(lse_refs[0], rows, jnp.full(row.shape, -jnp.inf, jnp.float32), tok_valid)
            return carry

        jax.lax.fori_loop(0, pl.cdiv(jnp.maximum(num_tokens - first, 0), stride), zero, 0)


# -------------------------------------------------------------------------------------------- pallas_call
def _prefill_call(q, k, v, cu_seqlens, *, max_seqlen, causal, scale, return_lse, interpret,
                  cfg: config_lib.PrefillConfig):
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    num_seqs = cu_seqlens.shape[0] - 1
    group = num_q_heads // num_kv_heads
    hp = _heads_per_program(group, cfg.heads_per_program, cfg.block_m)
    block_q = cfg.block_m // hp
    padded = config_lib.next_pow2(head_dim)
    num_q_tiles = max(1, pl.cdiv(max(max_seqlen, 1), block_q))
    grid = (num_q_tiles, num_q_heads // hp, num_seqs + 1)

    full = lambda n: pl.BlockSpec((n, padded), lambda *_: (0, 0))  # whole array; kernels index rows themselves
    kernel = functools.partial(
        _prefill_kernel, num_seqs=num_seqs, num_tokens=num_tokens, num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads, head_dim=head_dim, heads_per_program=hp, block_q=block_q,
        block_n=cfg.block_n, causal=causal, scale2=scale * softmax.LOG2E, precision=tiles.dot_precision(q.dtype),
        exp2=softmax.approx_exp2 if (cfg.approx_exp2 and not interpret) else jnp.exp2)
    out_shape = [jax.ShapeDtypeStruct((num_tokens * num_q_heads, head_dim), q.dtype)]
    out_specs = [full(num_tokens * num_q_heads)]
    if return_lse:
        out_shape.append(jax.ShapeDtypeStruct((num_tokens * num_q_heads,), jnp.float32))
        out_specs.append(pl.BlockSpec((num_tokens * num_q_heads,), lambda *_: (0,)))
    outs = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[pl.BlockSpec((num_seqs + 1,), lambda *_: (0,)),
                  full(num_tokens * num_q_heads), full(num_tokens * num_kv_heads), full(num_tokens * num_kv_heads)],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name=f"varlen_prefill_{'causal' if causal else 'full'}_d{head_dim}",
    )(cu_seqlens, q.reshape(-1, head_dim), k.reshape(-1, head_dim), v.reshape(-1, head_dim))
    out = outs[0].reshape(num_tokens, num_q_heads, head_dim)
    if return_lse:
        return out, outs[1].reshape(num_tokens, num_q_heads)
    return out


# ------------------------------------------------------------------------------------------- public function
def _validate(q, k, v, cu_seqlens, max_seqlen):
    validation.check_rank("q", q, 3, "[num_tokens, num_q_heads, head_dim]")
    validation.check_rank("k", k, 3, "[num_tokens, num_kv_heads, head_dim]")
    validation.check_float("q", q)
    validation.check_same_dtype(("q", "k", "v"), q, k, v)
    validation.check_shape("v", v, k.shape, "k.shape")
    validation.check_shape("k", k, (q.shape[0], k.shape[1], q.shape[2]),
                           "[num_tokens, num_kv_heads, head_dim] matching q")
    validation.check_head_dim("q", q.shape[2])
    validation.check_gqa(q.shape[1], k.shape[1])
    validation.check_rank("cu_seqlens", cu_seqlens, 1, "i32[num_seqs + 1]")
    validation.check_int32("cu_seqlens", cu_seqlens)
    if cu_seqlens.shape[0] < 2:
        raise ValueError(f"cu_seqlens must be i32[num_seqs + 1] with num_seqs >= 1; got {tuple(cu_seqlens.shape)}")
    validation.check_static_positive("max_seqlen", max_seqlen)


BACKENDS = backend_lib.BACKENDS
# The default on sm_90 (measured on the H200, benchmarks/NOTES.md, fourteenth session: GPU time a call, 20 calls in
# one jitted function): the Mosaic kernel from this max_seqlen on, per head_dim, and only for batches of at least
# MOSAIC_MIN_TOKENS packed rows; else the Triton kernel.
# * Small batches: the Mosaic path costs 10-23 µs a call more (its work list and K/V staging launch: 16 and 8-10 µs
#   of GPU time a call in the P1/P2 breakdown). One request of 512 tokens takes 0.043 ms against Triton's 0.020, one
#   of 1024 ties (0.047 / 0.046), one of 2048 is Mosaic's (0.101 / 0.118).
# * Head dim 128: Mosaic 64 x 512 (0.513 vs 0.660 ms) and every longer workload; Triton 512 x 64 (0.448 vs 0.622),
#   1024 x 32 and 128 requests of 1-256 tokens at unaligned starts (0.302 vs 0.445: every K/V window staged).
#   Uniform aligned batches of 128- and 256-token requests are Mosaic's by 11-14% (0.439 / 0.487, 0.453 / 0.515),
#   but they share their max_seqlen with the mixed batch, where Mosaic takes 47% longer: the rule leaves them to
#   Triton.
# * Head dim 64 (half the matmul per softmax): Mosaic 16 x 2048 (0.783 vs 0.814 ms), 8 x 4096 and P1; Triton
#   32 x 1024 (0.464 vs 0.517).
MOSAIC_MIN_SEQLEN = {128: 512, 64: 2048}
MOSAIC_MIN_TOKENS = 2048


def default_backend(q, k, max_seqlen: int, interpret: bool) -> str:
    """``varlen_attention``'s ``backend=None``: "mosaic" on a compiled Hopper GPU where it applies and was measured
    faster, else "triton"."""
    if interpret or not backend_lib.is_hopper() or prefill_mosaic.supported(q, k) is not None:
        return "triton"
    long_enough = max_seqlen >= MOSAIC_MIN_SEQLEN.get(q.shape[-1], max_seqlen + 1)
    return "mosaic" if long_enough and q.shape[0] >= MOSAIC_MIN_TOKENS else "triton"


@functools.partial(jax.jit, static_argnames=("max_seqlen", "causal", "softmax_scale", "return_lse", "interpret",
                                             "config", "backend"))
def varlen_attention(q, k, v, cu_seqlens, *, max_seqlen: int, causal: bool = True, softmax_scale: float | None = None,
                     return_lse: bool = False, interpret: bool | None = None,
                     config: config_lib.PrefillConfig | None = None, backend: str | None = None):
    """Attention over requests packed along the token axis; each request sees only its own tokens.

    Args:
      q: ``[num_tokens, num_q_heads, head_dim]`` float32 / bfloat16 / float16.
      k, v: ``[num_tokens, num_kv_heads, head_dim]``, same dtype; ``num_q_heads % num_kv_heads == 0`` (GQA/MQA).
      cu_seqlens: ``i32[num_seqs + 1]``, non-decreasing from 0; request ``b`` owns rows
        ``[cu_seqlens[b], cu_seqlens[b+1])``. Rows at or past ``cu_seqlens[-1]`` are padding (output 0).
      max_seqlen: static bound on every request's length (bucket it, e.g. next power of two, so batches share one
        compiled program). A longer request is silently truncated: check with :func:`pallas_attn.checked`.
      causal: request-local causal mask (query ``i`` sees keys ``j <= i``); False: each request attends to all of
        its own tokens.
      softmax_scale: default ``1/sqrt(head_dim)``.
      return_lse: also return the natural-log LSE ``f32[num_tokens, num_q_heads]`` (``-inf`` for padding rows).
      interpret: None → compiled on GPU, interpreted on CPU (see :mod:`pallas_attn.backend`).
      config: block sizes / warps / stages (:class:`pallas_attn.config.PrefillConfig`); None → tuned default.
        Triton backend only.
      backend: "triton" or "mosaic": the Hopper kernel of :mod:`pallas_attn.prefill_mosaic` (wgmma, TMA, warp
        specialisation; bf16/fp16, head_dim 64 or 128 — anything else raises; interpreted on CPU by the Mosaic
        GPU interpreter). None: :func:`default_backend` — Mosaic on a compiled sm_90 GPU where it applies and was
        measured faster (``max_seqlen >= MOSAIC_MIN_SEQLEN[head_dim]`` and ``num_tokens >= MOSAIC_MIN_TOKENS``),
        else Triton.

    Returns:
      ``out [num_tokens, num_q_heads, head_dim]`` in q's dtype (and ``lse`` if asked).

    Example:
      >>> cu = jnp.array([0, 6, 10], jnp.int32)          # request A: 6 tokens, B: 4 tokens
      >>> out = varlen_attention(q, k, v, cu, max_seqlen=8)
    """
    _validate(q, k, v, cu_seqlens, max_seqlen)
    if q.shape[0] == 0:  # no tokens: the kernels' grids and gathers need at least one row
        return (q, jnp.zeros(q.shape[:2], jnp.float32)) if return_lse else q
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    interpret = backend_lib.resolve_interpret(interpret)
    backend = backend_lib.select_backend(
        backend, config=config, default=lambda: default_backend(q, k, max_seqlen, interpret),
        mosaic_unsupported=lambda: prefill_mosaic.supported(q, k))
    if backend == "mosaic":
        out, lse = prefill_mosaic.varlen_attention_mosaic(q, k, v, cu_seqlens, max_seqlen=max_seqlen, causal=causal,
                                                          scale=float(scale), return_lse=return_lse,
                                                          interpret=interpret)
        return (out, lse) if return_lse else out
    cfg = config or config_lib.default_prefill_config(q.shape[-1], q.dtype.itemsize)
    return _prefill_call(q, k, v, cu_seqlens, max_seqlen=max_seqlen, causal=causal, scale=float(scale),
                         return_lse=return_lse, interpret=interpret, cfg=cfg)
