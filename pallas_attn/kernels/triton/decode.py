"""Paged decode attention with optional split-KV (docs/design.md#split-kv-and-the-merge).

One query per request sits at the end of its context, so its mask row is all-visible and attention is a long,
memory-bound vector per head. The grid is ``(batch, num_kv_heads, num_splits)``: program ``(b, h, s)`` computes
all query heads of KV group ``h`` (padded to the 16-row minimum of a tensor-core dot) against each K/V tile, so
K/V are read once per group. It reads its request's block-table entries as scalars from the table (Pallas GPU
has no scalar prefetch) and gathers ``block_n`` keys — several pages — per step.

With ``num_splits > 1`` each segment writes a partial ``O_s`` and ``LSE_s`` (float32) and
:func:`pallas_attn.merge_attention_states` merges them (the jitted second pass). ``num_splits=None``
picks by :func:`pallas_attn.core.config.resolve_splits` (fill the GPU when the batch cannot; cut long tails when it
can); ``num_splits=1`` is the single pass with no merge.
``split_size=`` (tokens) fixes the segments' boundaries instead, so a request's output is bit-identical whatever
else is in the batch.

Reference: :func:`pallas_attn.reference.paged_decode_attention`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_attn.core import config as config_lib, masks, softmax, tiles
from pallas_attn.core.backend import pallas_triton as plgpu  # None without the backend: the ops say so


# ---------------------------------------------------------------------------------------------- kernel body
def _decode_kernel(
    # inputs
    seq_lens_ref,  # i32[num_seqs]: keys of each query, its own included
    block_tables_ref,  # i32[num_seqs * max_blocks]
    q_ref,  # [num_seqs * Hq, Dp]
    k_ref,  # [num_blocks * block_size * Hkv, Dp]
    v_ref,  # [num_blocks * block_size * Hkv, Dp]
    *refs,  # [alibi_slopes f32[Hq]], [sinks f32[Hq]] (as mods says), FP8 scales (kv_scales_mode "tensor": f32[2]
    #         k_scale, v_scale; "token": k and v scales f32[num_blocks * block_size * Hkv]); outputs o, lse:
    #         o [num_seqs * Hq, Dp] (single pass, q dtype) or [num_splits * num_seqs * Hq, Dp] (f32 partials),
    #         lse f32[num_seqs * Hq] or f32[num_splits * num_seqs * Hq]
    num_q_heads: int, num_kv_heads: int, head_dim: int, rows: int, max_blocks: int, block_size: int,
    block_n: int, num_splits: int, split_size: int | None, scale: float, mods: masks.ScoreMods, precision,
    kv_scales_mode: str | None, fp8: str | None, compiled: bool,
):
    refs = list(refs)
    slopes_ref = refs.pop(0) if mods.alibi else None
    sinks_ref = refs.pop(0) if mods.sinks else None
    scale, v_scale, token_scales = tiles.kv_scales(refs, kv_scales_mode, scale)
    o_ref, lse_ref = refs
    b, kv_head, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    group = num_q_heads // num_kv_heads
    num_seqs = pl.num_programs(0)
    padded = q_ref.shape[-1]
    # q / out columns; an FP8 cache's pages are uint16 pairs of dims, half as wide (tiles.as_fp8_pairs)
    cols = tiles.pair_cols(head_dim, padded) if fp8 else tiles.Cols(head_dim, padded)
    kv_cols = tiles.Cols(head_dim // 2, padded // 2) if fp8 else cols
    r = jnp.arange(rows)
    row_valid = r < group  # padding rows of the group compute on zeros and are never stored
    q_rows = b * num_q_heads + kv_head * group + r  # rows past the group are masked, but distinct
    # [rows, Dp]; over an FP8 cache its even and odd dims, so the key tiles split the same way: measured faster here
    # than key tiles joined back into the dims' order (docs/performance.md#fp8-kv-caches)
    q = tiles.load_parts(q_ref, q_rows, cols, row_valid)
    q, scale = tiles.query_for_cache(q, fp8, scale)
    ctx = jnp.clip(seq_lens_ref[b], 0, max_blocks * block_size)  # a length past the table reads nothing more
    q_pos = jnp.full((rows,), ctx - 1)  # the query is the last position: every key is visible

    num_pages = k_ref.shape[0] // (block_size * num_kv_heads)

    guarded = tiles.page_guard(block_tables_ref, b * max_blocks, block_size, num_pages, max_blocks)
    tile_start, full_start, full_end, kv_end, kv_first = tiles.paged_tile_plan(
        ctx - 1, ctx - 1, ctx, block_n, split, num_splits, split_size, mods, guarded=guarded)
    dot = functools.partial(jnp.dot, preferred_element_type=jnp.float32, precision=precision)
    step = tiles.paged_kv_step(q, q_pos, k_ref, v_ref, block_tables_ref, b * max_blocks, ctx, kv_head, cols=kv_cols,
                               block_n=block_n, block_size=block_size, num_kv_heads=num_kv_heads,
                               num_pages=num_pages, scale=scale, dot=dot, mods=mods,
                               slope2=tiles.load_vector(slopes_ref, q_rows % num_q_heads, row_valid) * softmax.LOG2E
                               if mods.alibi else None,
                               kv_first=kv_first, fp8=fp8, compiled=compiled, token_scales=token_scales)
    state = softmax.kv_loop(softmax.init_state(rows, padded // 2 if fp8 else padded, 2 if fp8 else 1), tile_start,
                            full_end, kv_end, step, full_start)
    # an empty split (or context 0) gives 0 and -inf; split partials leave the sink to the merge
    sink2 = (tiles.load_vector(sinks_ref, q_rows % num_q_heads, row_valid) * softmax.LOG2E
             if mods.sinks and num_splits == 1 else None)
    out, lse = softmax.finalize(state, sink2)
    if v_scale is not None:
        out = jax.tree.map(lambda o: o * v_scale, out)
    out_rows = split * num_seqs * num_q_heads + q_rows
    tiles.store_parts(o_ref, out_rows, cols, out, row_valid)
    tiles.store_vector(lse_ref, out_rows, lse, row_valid)


# -------------------------------------------------------------------------------------------- pallas_call
def paged_decode_triton(q, k_cache, v_cache, block_tables, seq_lens, alibi_slopes=None, sinks=None, kv_scales=(),
                        *, scale, num_splits, split_size, interpret, cfg: config_lib.DecodeConfig,
                        mods: masks.ScoreMods = masks.NO_MODS):
    """``(out [num_seqs, Hq, D], lse)``; ``alibi_slopes`` / ``sinks`` ``f32[Hq]`` exactly when ``mods`` says;
    ``kv_scales`` with an FP8 cache, dequantised in the kernel: ``(f32[2],)`` (``k_scale, v_scale``, per tensor) or
    the two scale caches ``f32[num_blocks, block_size, Hkv]`` (per token and head); ``()`` without."""
    num_seqs, num_q_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    max_blocks = block_tables.shape[1]
    group = num_q_heads // num_kv_heads
    padded = config_lib.next_pow2(head_dim)
    rows = max(tiles.MIN_DOT_ROWS, config_lib.next_pow2(group))
    partial = num_splits > 1
    out_rows = (num_splits if partial else 1) * num_seqs * num_q_heads
    cache_rows = num_blocks * block_size * num_kv_heads
    fp8 = tiles.fp8_format(k_cache.dtype)
    kv_width = padded // 2 if fp8 else padded
    if fp8:
        k_cache, v_cache = tiles.as_fp8_pairs(k_cache), tiles.as_fp8_pairs(v_cache)

    full = lambda n, w=padded: pl.BlockSpec((n, w), lambda *_: (0, 0))
    vec = lambda n: pl.BlockSpec((n,), lambda *_: (0,))
    kernel = functools.partial(
        _decode_kernel, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, rows=rows,
        max_blocks=max_blocks, block_size=block_size, block_n=cfg.block_n, num_splits=num_splits,
        split_size=split_size, scale=scale, mods=mods, precision=tiles.dot_precision(q.dtype),
        kv_scales_mode=tiles.kv_scales_mode(kv_scales), fp8=fp8, compiled=not interpret)
    features = [x.astype(jnp.float32) for x in (alibi_slopes, sinks) if x is not None]
    scales = [x.reshape(-1).astype(jnp.float32) for x in kv_scales]
    out, lse = pl.pallas_call(
        kernel,
        grid=(num_seqs, num_kv_heads, num_splits),
        in_specs=[vec(num_seqs), vec(num_seqs * max_blocks), full(num_seqs * num_q_heads),
                  full(cache_rows, kv_width), full(cache_rows, kv_width)]
                 + [vec(num_q_heads)] * len(features) + [vec(x.shape[0]) for x in scales],
        out_specs=[full(out_rows), vec(out_rows)],
        out_shape=[jax.ShapeDtypeStruct((out_rows, head_dim), jnp.float32 if partial else q.dtype),
                   jax.ShapeDtypeStruct((out_rows,), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name=f"paged_decode_d{head_dim}_bs{block_size}" + ("_split" if partial else ""),
    )(seq_lens, block_tables.reshape(-1), q.reshape(-1, head_dim), k_cache.reshape(cache_rows, -1),
      v_cache.reshape(cache_rows, -1), *features, *scales)
    return softmax.merge_split_outputs(out, lse, num_splits, q.shape, q.dtype, sinks if num_splits > 1 else None)
