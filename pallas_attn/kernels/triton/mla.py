"""Dense MLA attention over a paged latent cache (DeepSeek-V3 / Kimi-K2 decode and multi-token steps).

The cache holds one shared latent head per position, ``[num_blocks, block_size, kv_lora_rank + rope_dim]`` (512 +
64 = 576 for DeepSeek): keys are a row's full 576 dims, values its first ``kv_lora_rank``; ``q [T, H, 576]`` is
already absorbed into the latent space. Every query head attends to every key of its request, so the kernel is
``paged_attention`` with one KV head whose values are a prefix of its keys — with one tile loaded for both dots.

Request ``b``'s ``q_len`` new tokens are the last of its ``seq_lens[b]`` keys, causal among themselves (decode:
``q_len`` 1; MTP / speculative verification: 2–8). The grid is ``(q_blocks, cdiv(H, block_h), num_splits)``: a
query block is ``block_q`` tokens of one request × ``block_h`` heads, and those rows are the M dim of both dots,
so each latent tile is read once for all of them (FlashMLA packs its 64-row tiles the same way). Query blocks are
mapped to requests as in the ragged paged kernel (:func:`pallas_attn.kernels.triton.paged.query_blocks`). The
QKᵀ dot is split into the latent part (``[M, 512] x [512, N]``) and the rope part (``[M, 64] x [64, N]``) so no
576-wide (non-power-of-two) tile exists, as in :mod:`pallas_attn.kernels.triton.sparse_mla`.

Tiles are planned as in the other paged kernels (:func:`pallas_attn.core.tiles.paged_tile_plan`): full tiles carry no
mask, the ragged last tile and the causal triangle are masked, a program checks its own pages are in the pool before
its loop, and split-KV segments (``num_splits`` / ``split_size``) are merged by
:func:`pallas_attn.merge_attention_states`. Attention sinks join an unsplit program's denominator in the kernel and
a split one's in the merge.

An FP8 latent cache (``uint8`` rows of FlashMLA's layout: 512 e4m3 values, a float32 scale per 128 of them, 64
bf16 rope values; :func:`pallas_attn.quantize_latent`) is read as it is stored: the e4m3 values widen to q's dtype
exactly, and each scale group's scale multiplies its products, never the values: ``S = Σ_g scale_g · (Q_g K_gᵀ)``
over the 4 groups' 128 dims plus the rope dot, ``O_g += (P · scale_g) V_g`` (:func:`pallas_attn.core.softmax.
scaled_probabilities`). The scores are then those of the dequantised rows up to float32 rounding.

Reference: :func:`pallas_attn.reference.mla_attention`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_attn.core import config as config_lib, masks, softmax, tiles, validation
from pallas_attn.core.backend import pallas_triton as plgpu  # None without the backend: the ops say so


# ---------------------------------------------------------------------------------------------- kernel body
def _mla_kernel(
    # inputs
    block_req_ref,  # i32[num_q_blocks]: request of each query block, < 0 past the last one
    block_first_ref,  # i32[num_q_blocks]: first request-local token of the block
    cu_query_lens_ref,  # i32[num_seqs + 1]
    seq_lens_ref,  # i32[num_seqs]
    block_tables_ref,  # i32[num_seqs * max_blocks]
    q_ref,  # [T * H, Dqk]
    kv_ref,  # [num_blocks * block_size, Dqk]
    *refs,  # [sinks f32[H]] (with has_sinks); outputs o [num_splits * T * H, Dv] (f32 partials when split, else
    #         q's dtype), lse f32[num_splits * T * H]
    num_tokens: int, num_heads: int, kv_lora_rank: int, rope_dim: int, block_q: int, block_h: int, rows: int,
    max_blocks: int, block_size: int, block_n: int, num_splits: int, split_size: int | None, scale2: float,
    has_sinks: bool, precision, fp8: bool,
):
    sinks_ref = refs[0] if has_sinks else None
    o_ref, lse_ref = refs[-2:]
    p, hb, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    r = jnp.arange(rows)
    tok_in_block = r // block_h
    head = hb * block_h + r % block_h
    head_valid = (head < num_heads) & (tok_in_block < block_q)  # rows past block_q × block_h pad a 16-row dot
    req = block_req_ref[p]
    parts = tiles.latent_cols(kv_lora_rank, rope_dim)  # (latent, rope) column groups of a row
    # The latent dims in groups: one, or an FP8 cache's scale groups (each group's scale meets its products)
    groups = kv_lora_rank // validation.FP8_LATENT_GROUP if fp8 else 1
    width = kv_lora_rank // groups
    group_cols = tuple(tiles.Cols(width, width, offset=g * width) for g in range(groups))
    dot = functools.partial(jnp.dot, preferred_element_type=jnp.float32, precision=precision)

    def load_kv(slot, mask):
        """``(latent groups [N, width] in q's dtype, their scales f32[N] or None, rope [N, rope] | None)``."""
        if fp8:
            return tiles.load_fp8_latent(kv_ref, slot, kv_lora_rank, rope_dim, q_ref.dtype, mask)
        k_nope, k_pe = tiles.load_latent(kv_ref, slot, parts, mask)
        return (k_nope,), (None,), k_pe

    @pl.when(req >= 0)
    def _attend():
        first = block_first_ref[p]
        q_start, q_len, seq_len, context, tok = tiles.query_block_frame(
            cu_query_lens_ref, seq_lens_ref, req, first, tok_in_block, max_blocks * block_size)
        row_valid = (tok < q_len) & head_valid
        # Masked rows get distinct out-of-range indices (see tiles.store_rows).
        q_rows = jnp.where(row_valid, (q_start + tok) * num_heads + head, num_tokens * num_heads + r)
        q_nope = tuple(tiles.load_rows(q_ref, q_rows, c, row_valid) for c in group_cols)  # [M, width] each
        q_pe = tiles.load_rows(q_ref, q_rows, parts[1], row_valid) if rope_dim else None  # [M, rope]
        q_pos = context + tok  # absolute positions: a full rectangle plus the new tokens' triangle
        q_last = context + jnp.minimum(first + block_q, q_len) - 1
        num_pages = kv_ref.shape[0] // block_size

        tile_start, _, full_end, kv_end, _ = tiles.paged_tile_plan(
            context + first, q_last, seq_len, block_n, split, num_splits, split_size, masks.NO_MODS,
            guarded=tiles.page_guard(block_tables_ref, req * max_blocks, block_size, num_pages, max_blocks))

        def scores(k_nope, k_scales, k_pe):  # [M, N] base 2
            s = None
            for q_g, k_g, scale_g in zip(q_nope, k_nope, k_scales):
                s_g = dot(q_g, k_g.T)
                s_g = s_g if scale_g is None else s_g * scale_g[None, :]
                s = s_g if s is None else s + s_g
            if rope_dim:
                s = s + dot(q_pe, k_pe.T)
            return s * scale2

        def fold(state, s2, k_nope, k_scales):  # the tile's softmax and P · V, one accumulator per group
            if not fp8:
                return softmax.online_softmax_step(state, s2, k_nope[0], dot)
            acc, m, l = state
            m, alpha, p, l = softmax.softmax_update(m, l, s2)
            new = []
            for a, v_g, scale_g in zip(acc, k_nope, k_scales):
                p_g, top = softmax.scaled_probabilities(p, scale_g, v_g.dtype)
                new.append(alpha[:, None] * a + dot(p_g, v_g) * top)
            return tuple(new), m, l

        def step(j, state, masked):
            k_pos = j * block_n + jnp.arange(block_n)  # [N]
            if not masked:  # pages vouched for by the program's check: no guard, no mask
                slot, _ = tiles.paged_rows(block_tables_ref, req * max_blocks, k_pos, block_size, 1, 0, num_pages,
                                           guard=False)
                k_nope, k_scales, k_pe = load_kv(slot, None)
                return fold(state, scores(k_nope, k_scales, k_pe), k_nope, k_scales)
            k_valid = k_pos < seq_len
            slot, page_ok = tiles.paged_rows(block_tables_ref, req * max_blocks, k_pos, block_size, 1, 0, num_pages,
                                             k_valid)
            ok = k_valid & page_ok
            k_nope, k_scales, k_pe = load_kv(slot, ok)  # masked keys read as 0: V stays finite
            # A key past the request or on a page outside the pool moves past every query: one [M, N] compare is
            # the whole causal, length and page mask.
            visible = jnp.where(ok, k_pos, jnp.iinfo(jnp.int32).max)[None, :] <= q_pos[:, None]
            return fold(state, jnp.where(visible, scores(k_nope, k_scales, k_pe), -jnp.inf), k_nope, k_scales)

        state = softmax.kv_loop(softmax.init_state(rows, width, groups), tile_start, full_end, kv_end, step)
        # [M]: the rows' sinks in base 2; split partials leave the sink to their merge
        sink2 = (tiles.load_vector(sinks_ref, head, row_valid) * softmax.LOG2E
                 if has_sinks and num_splits == 1 else None)
        out, lse = softmax.finalize(state, sink2)  # no key (an empty split, context 0): zeros and -inf
        out_rows = split * num_tokens * num_heads + q_rows
        for cols, out_g in zip(group_cols, out if fp8 else (out,)):
            tiles.store_rows(o_ref, out_rows, cols, out_g, row_valid)
        tiles.store_vector(lse_ref, out_rows, lse, row_valid)


# -------------------------------------------------------------------------------------------- pallas_call
def mla_triton(q, kv_cache, block_tables, seq_lens, cu_query_lens, block_req, block_first, sinks=None, *,
               kv_lora_rank: int, scale: float, num_splits: int, split_size: int | None, interpret: bool,
               cfg: config_lib.MLAConfig, block_q: int):
    """``(out, lse)`` as the kernel writes them: ``out [num_splits * T * H, Dv]`` (float32 partial states when
    split, else q's dtype), ``lse f32[num_splits * T * H]``; rows no query block owns are not written. Arguments
    validated by :func:`pallas_attn.ops.mla.mla_attention`; ``cu_query_lens`` clamped, ``(block_req, block_first)``
    from :func:`pallas_attn.kernels.triton.paged.query_blocks`, ``sinks`` ``f32[H]`` or None."""
    num_tokens, num_heads, dim_qk = q.shape
    num_blocks, block_size, row_width = kv_cache.shape  # an FP8 latent cache's rows are its bytes
    num_seqs, max_blocks = block_tables.shape
    fp8 = validation.is_fp8_latent(kv_cache)
    block_h = min(cfg.block_h, config_lib.next_pow2(num_heads))
    rows = max(tiles.MIN_DOT_ROWS, block_q * block_h)
    num_q_blocks = block_req.shape[0]
    out_rows = num_splits * num_tokens * num_heads
    kernel = functools.partial(
        _mla_kernel, num_tokens=num_tokens, num_heads=num_heads, kv_lora_rank=kv_lora_rank,
        rope_dim=dim_qk - kv_lora_rank, block_q=block_q, block_h=block_h, rows=rows, max_blocks=max_blocks,
        block_size=block_size, block_n=cfg.block_n, num_splits=num_splits, split_size=split_size,
        scale2=scale * softmax.LOG2E, has_sinks=sinks is not None and num_splits == 1,
        precision=tiles.dot_precision(q.dtype), fp8=fp8)
    features = [sinks.astype(jnp.float32)] if sinks is not None and num_splits == 1 else []
    vec = lambda n: pl.BlockSpec((n,), lambda *_: (0,))  # noqa: E731
    mat = lambda n, d: pl.BlockSpec((n, d), lambda *_: (0, 0))  # noqa: E731
    return pl.pallas_call(
        kernel,
        grid=(num_q_blocks, pl.cdiv(num_heads, block_h), num_splits),
        in_specs=[vec(num_q_blocks), vec(num_q_blocks), vec(num_seqs + 1), vec(num_seqs), vec(num_seqs * max_blocks),
                  mat(num_tokens * num_heads, dim_qk), mat(num_blocks * block_size, row_width)]
                 + [vec(num_heads)] * len(features),
        out_specs=[mat(out_rows, kv_lora_rank), vec(out_rows)],
        out_shape=[jax.ShapeDtypeStruct((out_rows, kv_lora_rank), jnp.float32 if num_splits > 1 else q.dtype),
                   jax.ShapeDtypeStruct((out_rows,), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name=f"mla_d{dim_qk}_v{kv_lora_rank}_bs{block_size}_q{block_q}" + ("_fp8" if fp8 else "")
             + ("_split" if num_splits > 1 else ""),
    )(block_req, block_first, cu_query_lens, seq_lens, block_tables.reshape(-1), q.reshape(-1, dim_qk),
      kv_cache.reshape(-1, row_width), *features)
