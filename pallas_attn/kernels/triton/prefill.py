"""Packed varlen prefill attention on the Pallas Triton backend (docs/design.md#the-grid).

Requests are packed along the token axis: ``q [T, Hq, D]``, ``k, v [T, Hkv, D]``, request ``b`` owning rows
``[cu_seqlens[b], cu_seqlens[b+1])``. The grid is ``(q_tiles, Hkv * groups, batch + 1)``: program ``(m, h, b)``
owns one request × one KV head (``heads_per_program`` of its query heads, which share every K/V tile) × one query
tile. It reads ``seq_start``/``seq_len`` for ``b`` from ``cu_seqlens``, exits at once when its tile starts past the
request, touches only rows ``[seq_start, seq_start + seq_len)`` and builds the causal mask in registers from
request-local positions (``pos_q >= pos_k``). Full tiles (■) run with no mask code, diagonal tiles (△) are
masked element-wise, future tiles (·) are never loaded (see :mod:`pallas_attn.core.masks`). Query tiles are visited
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

from pallas_attn.core import config as config_lib, masks, softmax, tiles
from pallas_attn.core.backend import pallas_triton as plgpu  # None without the backend: the ops say so


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
    *refs,  # [alibi_slopes f32[Hq]], [sinks f32[Hq]] (as mods says); outputs: o [T * Hq, Dp], [lse f32[T * Hq]]
    num_seqs: int, num_tokens: int, num_q_heads: int, num_kv_heads: int, head_dim: int, heads_per_program: int,
    max_seqlen: int, block_q: int, block_n: int, causal: bool, scale: float, mods: masks.ScoreMods, precision,
    exp2,
):
    refs = list(refs)
    slopes_ref = refs.pop(0) if mods.alibi else None
    sinks_ref = refs.pop(0) if mods.sinks else None
    o_ref, *lse_refs = refs
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

    seq_start, seq_end = tiles.request_span(cu_seqlens_ref, b, num_seqs, num_tokens)
    zeros = jnp.zeros((row.shape[0], q_ref.shape[-1]), jnp.float32)

    def zero_rows(first, end, stride):  # rows [first, end) of these heads, a tile every `stride` rows: 0, LSE -inf
        def zero(i, carry):
            tok = first + i * stride + row // hp
            tok_valid = tok < end
            rows = tok * num_q_heads + q_head  # distinct, masked ones included (tiles.store_rows)
            tiles.store_rows(o_ref, rows, cols, zeros, tok_valid)
            if lse_refs:
                tiles.store_vector(lse_refs[0], rows, jnp.full(row.shape, -jnp.inf, jnp.float32), tok_valid)
            return carry

        jax.lax.fori_loop(0, pl.cdiv(jnp.maximum(end - first, 0), stride), zero, 0)

    @pl.when(b < num_seqs)
    def _attend():
        # A request longer than max_seqlen is truncated to its first max_seqlen tokens (queries and keys); the tile
        # programs of query tile 0 zero its other rows (none when the contract holds: a loop of zero steps).
        seq_len = jnp.minimum(seq_end - seq_start, max_seqlen)

        @pl.when(m == 0)
        def _truncated():
            zero_rows(seq_start + seq_len + m * block_q, seq_end, block_q)

        @pl.when(m * block_q < seq_len)  # tiles past the request exit at once
        def _tile():
            row_valid = local_tok < seq_len
            q_rows = (seq_start + local_tok) * num_q_heads + q_head
            q = tiles.load_rows(q_ref, q_rows, cols, row_valid)  # [M, Dp]
            q_last = jnp.minimum((m + 1) * block_q, seq_len) - 1
            if mods.windowed:
                start, full_start, full_end, kv_end = masks.window_tile_ranges(
                    m * block_q, q_last, seq_len, block_n, (mods.window_left, mods.window_right), causal=causal)
            else:
                start, full_start = 0, None
                full_end, kv_end = masks.kv_tile_ranges(m * block_q, q_last, seq_len, block_n, causal=causal)
            slope2 = tiles.load_vector(slopes_ref, q_head) * softmax.LOG2E if mods.alibi else None  # [M]

            def step(j, state, masked):
                k_pos = j * block_n + jnp.arange(block_n)  # [N]
                kv_rows = (seq_start + k_pos) * num_kv_heads + kv_head
                k_valid = None
                if masked:  # keys outside every row's window are not loaded either: they may hold anything
                    k_valid = k_pos < seq_len
                    if mods.window_left >= 0:
                        k_valid &= k_pos >= m * block_q - mods.window_left
                    if mods.window_right >= 0:
                        k_valid &= k_pos <= q_last + mods.window_right
                k = tiles.load_rows(k_ref, kv_rows, cols, k_valid)  # [N, Dp]
                v = tiles.load_rows(v_ref, kv_rows, cols, k_valid)  # [N, Dp]
                s2 = mods.scores(dot(q, k.T), scale, local_tok, k_pos, slope2)  # [M, N] base-2 scores
                if masked:
                    visible = (masks.causal_mask(local_tok, k_pos, seq_len) if causal
                               else masks.length_mask(local_tok, k_pos, seq_len))
                    window = mods.window_mask(local_tok, k_pos)
                    s2 = jnp.where(visible if window is None else visible & window, s2, -jnp.inf)
                return softmax.online_softmax_step(state, s2, v, dot, exp2)

            state = softmax.kv_loop(softmax.init_state(block_q * hp, q_ref.shape[-1]), start, full_end, kv_end, step,
                                    full_start)
            sink2 = tiles.load_vector(sinks_ref, q_head) * softmax.LOG2E if mods.sinks else None
            out, lse = softmax.finalize(state, sink2)
            tiles.store_rows(o_ref, q_rows, cols, out, row_valid)
            if lse_refs:
                tiles.store_vector(lse_refs[0], q_rows, lse, row_valid)

    @pl.when(b == num_seqs)
    def _zero_padding():  # rows no request owns, [0, cu[0]) and [cu[-1], T): zeros, no second pass
        stride = num_q_tiles * block_q
        first_start, _ = tiles.request_span(cu_seqlens_ref, 0, num_seqs, num_tokens)
        zero_rows(m * block_q, first_start, stride)
        zero_rows(seq_start + m * block_q, num_tokens, stride)


# -------------------------------------------------------------------------------------------- pallas_call
def varlen_attention_triton(q, k, v, cu_seqlens, alibi_slopes=None, sinks=None, *, max_seqlen, causal, scale,
                            return_lse, interpret, cfg: config_lib.PrefillConfig,
                            mods: masks.ScoreMods = masks.NO_MODS):
    """``(out [T, Hq, D], lse f32[T, Hq] | None)`` (the LSE with ``return_lse``), as the Mosaic prefill returns
    them; ``alibi_slopes`` / ``sinks`` ``f32[Hq]`` exactly when ``mods`` says."""
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
        num_kv_heads=num_kv_heads, head_dim=head_dim, heads_per_program=hp, max_seqlen=max_seqlen, block_q=block_q,
        block_n=cfg.block_n, causal=causal, scale=scale, mods=mods, precision=tiles.dot_precision(q.dtype),
        exp2=softmax.approx_exp2 if (cfg.approx_exp2 and not interpret) else jnp.exp2)
    features = [x.astype(jnp.float32) for x in (alibi_slopes, sinks) if x is not None]
    out_shape = [jax.ShapeDtypeStruct((num_tokens * num_q_heads, head_dim), q.dtype)]
    out_specs = [full(num_tokens * num_q_heads)]
    if return_lse:
        out_shape.append(jax.ShapeDtypeStruct((num_tokens * num_q_heads,), jnp.float32))
        out_specs.append(pl.BlockSpec((num_tokens * num_q_heads,), lambda *_: (0,)))
    outs = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[pl.BlockSpec((num_seqs + 1,), lambda *_: (0,)),
                  full(num_tokens * num_q_heads), full(num_tokens * num_kv_heads), full(num_tokens * num_kv_heads)]
        + [pl.BlockSpec((num_q_heads,), lambda *_: (0,))] * len(features),
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name=f"varlen_prefill_{'causal' if causal else 'full'}_d{head_dim}",
    )(cu_seqlens, q.reshape(-1, head_dim), k.reshape(-1, head_dim), v.reshape(-1, head_dim), *features)
    out = outs[0].reshape(num_tokens, num_q_heads, head_dim)
    return out, (outs[1].reshape(num_tokens, num_q_heads) if return_lse else None)
