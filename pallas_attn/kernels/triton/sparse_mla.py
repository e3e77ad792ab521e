"""Top-k sparse MLA attention over a paged latent cache (DeepSeek-V3.2 style).

Each query token attends only to its ``topk`` selected positions. The cache holds one shared latent head per
position: ``[num_blocks, block_size, kv_lora_rank + rope_dim]`` (512 + 64 = 576 for DeepSeek). Keys are the full
576 dims of the selected rows, values their first ``kv_lora_rank`` dims, so one gathered tile serves as both K and
V; ``q [T, H, 576]`` is already absorbed into the latent space.

The kernel resolves every selected position itself, through the owning request's block table (top-k logical
position → ``block_table[pos // block_size]`` → physical slot), so only the request's own pages are read and no
``[T, topk, 576]`` gather is ever written out. Grid ``(num_tokens, cdiv(H, block_h))``: the ``block_h`` heads of a
token are the M dimension of both dots and share each gathered tile. The QKᵀ dot is split into the latent part
(``[block_h, 512] x [512, block_n]``) and the rope part (``[block_h, 64] x [64, block_n]``) so no 576-wide
(non-power-of-two) tile exists. Every program sees all of its rows' keys, so attention sinks (``f32[H]``, one more
term ``exp(sink_h)`` in each row's denominator) join at the finalization, in the kernel.

On a compiled sm_90 GPU at DeepSeek's 576 / 512 dims the default is the Mosaic GPU kernel of
:mod:`pallas_attn.kernels.mosaic.sparse_mla` (warp-specialised: a memory warpgroup gathers the rows with
``cp.async``, a score warpgroup hands P to a value warpgroup), which is faster there
(``docs/performance.md#sparse-mla``). This Triton kernel is the default elsewhere and in interpret mode
(``backend=`` forces either).

Reference: :func:`pallas_attn.reference.sparse_mla_attention`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_attn.core import config as config_lib, softmax, tiles
from pallas_attn.core.backend import pallas_triton as plgpu  # None without the backend: the ops say so


# ---------------------------------------------------------------------------------------------- kernel body
def _sparse_kernel(
    # inputs
    token_req_ref,  # i32[T]: owning request of each token, -1 for padding tokens
    token_keys_ref,  # i32[T]: indices of token t must lie in [0, token_keys[t]) (0 for padding tokens)
    block_tables_ref,  # i32[num_seqs * max_blocks]
    topk_ref,  # i32[T * topk_padded]: request-local positions, -1 unused
    q_ref,  # [T * H, Dqk]
    kv_ref,  # [num_blocks * block_size, Dqk]
    *refs,  # [sinks f32[H]] (with has_sinks); outputs o [T * H, Dv], lse f32[T * H]
    num_heads: int, kv_lora_rank: int, rope_dim: int, topk: int, max_blocks: int, block_size: int,
    block_h: int, block_n: int, value_splits: int, scale2: float, has_sinks: bool, precision,
):
    sinks_ref = refs[0] if has_sinks else None
    o_ref, lse_ref = refs[-2:]
    t, hb = pl.program_id(0), pl.program_id(1)
    vs = pl.program_id(2) if value_splits > 1 else 0
    value_width = kv_lora_rank // value_splits  # output columns [vs * value_width, (vs + 1) * value_width)
    head = hb * block_h + jnp.arange(block_h)
    row_valid = head < num_heads
    q_rows = jnp.where(row_valid, t * num_heads + head, o_ref.shape[0] + jnp.arange(block_h))
    parts = tiles.latent_cols(kv_lora_rank, rope_dim)  # (latent, rope) column groups of a row
    value = tiles.Cols(value_width, value_width, offset=vs * value_width)  # this program's output columns
    req = token_req_ref[t]
    num_keys = token_keys_ref[t]
    dot = functools.partial(jnp.dot, preferred_element_type=jnp.float32, precision=precision)

    q_nope, q_pe = tiles.load_latent(q_ref, q_rows, parts, row_valid & (req >= 0))  # [H_blk, Dv], [H_blk, rope]

    def step(j, state):
        pos = plgpu.load(topk_ref.at[t * topk + j * block_n + jnp.arange(block_n)])  # [N]
        # Indices past the request's keys and pages outside the pool are ignored like -1 (safe mode reports them).
        valid = (pos >= 0) & (pos < num_keys)
        slot, page_ok = tiles.paged_rows(block_tables_ref, req * max_blocks, pos, block_size, 1, 0,
                                         kv_ref.shape[0] // block_size, valid)  # [N]
        valid = valid & page_ok  # an index on a page id outside the pool is ignored like -1
        k_nope, k_pe = tiles.load_latent(kv_ref, slot, parts, valid)  # [N, Dv], [N, rope]
        s = dot(q_nope, k_nope.T)  # [H_blk, N]
        if rope_dim:
            s = s + dot(q_pe, k_pe.T)
        s2 = jnp.where(valid[None, :], s * scale2, -jnp.inf)
        if value_splits == 1:
            v = k_nope  # V is the latent part of the same rows: one gather serves both dots
        else:  # this program's slice of the value dims (a second, cache-hot gather of the same rows)
            v = tiles.load_rows(kv_ref, slot, value, valid)
        return softmax.online_softmax_step(state, s2, v, dot)

    num_tiles = (req >= 0).astype(jnp.int32) * (topk // block_n)  # a padding token visits no tile
    state = jax.lax.fori_loop(jnp.int32(0), num_tiles, step, softmax.init_state(block_h, value_width))
    # [H_blk]: the sinks of this program's heads in base 2 (the LSE stays over the keys)
    sink2 = tiles.load_vector(sinks_ref, head, row_valid) * softmax.LOG2E if has_sinks else None
    out, lse = softmax.finalize(state, sink2)  # all -1 (or a padding token): zeros and -inf
    tiles.store_rows(o_ref, q_rows, value, out, row_valid)

    if value_splits == 1:
        tiles.store_vector(lse_ref, q_rows, lse, row_valid)
    else:
        @pl.when(vs == 0)  # every value split computes the same LSE
        def _():
            tiles.store_vector(lse_ref, q_rows, lse, row_valid)


# -------------------------------------------------------------------------------------------- pallas_call
def sparse_mla_triton(q, kv_cache, block_tables, topk_indices, token_req, token_keys, sinks=None, *, kv_lora_rank,
                      scale, interpret, cfg: config_lib.SparseConfig):
    """``(out [T, H, kv_lora_rank], lse f32[T, H])``; arguments validated by
    :func:`pallas_attn.ops.sparse_mla.sparse_mla_attention`; ``sinks`` ``f32[H]`` or None."""
    num_tokens, num_heads, dim_qk = q.shape
    num_blocks, block_size, _ = kv_cache.shape
    num_seqs, max_blocks = block_tables.shape
    topk = topk_indices.shape[1]
    block_n = min(cfg.block_n, max(16, config_lib.next_pow2(topk)))
    topk_padded = pl.cdiv(topk, block_n) * block_n
    if topk_padded != topk:  # a ragged last tile reads as unused (-1) entries
        topk_indices = jnp.pad(topk_indices, ((0, 0), (0, topk_padded - topk)), constant_values=-1)
    block_h = min(cfg.block_h, max(16, config_lib.next_pow2(num_heads)))
    kernel = functools.partial(
        _sparse_kernel, num_heads=num_heads, kv_lora_rank=kv_lora_rank, rope_dim=dim_qk - kv_lora_rank,
        topk=topk_padded, max_blocks=max_blocks, block_size=block_size, block_h=block_h, block_n=block_n,
        value_splits=cfg.value_splits, scale2=scale * softmax.LOG2E, has_sinks=sinks is not None,
        precision=tiles.dot_precision(q.dtype))
    features = [] if sinks is None else [sinks.astype(jnp.float32)]
    vec = lambda n: pl.BlockSpec((n,), lambda *_: (0,))
    mat = lambda n, d: pl.BlockSpec((n, d), lambda *_: (0, 0))
    out, lse = pl.pallas_call(
        kernel,
        grid=(num_tokens, pl.cdiv(num_heads, block_h)) + ((cfg.value_splits,) if cfg.value_splits > 1 else ()),
        in_specs=[vec(num_tokens), vec(num_tokens), vec(num_seqs * max_blocks), vec(num_tokens * topk_padded),
                  mat(num_tokens * num_heads, dim_qk), mat(num_blocks * block_size, dim_qk)]
                 + [vec(num_heads)] * len(features),
        out_specs=[mat(num_tokens * num_heads, kv_lora_rank), vec(num_tokens * num_heads)],
        out_shape=[jax.ShapeDtypeStruct((num_tokens * num_heads, kv_lora_rank), q.dtype),
                   jax.ShapeDtypeStruct((num_tokens * num_heads,), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name=f"sparse_mla_d{dim_qk}_v{kv_lora_rank}_bs{block_size}",
    )(token_req, token_keys, block_tables.reshape(-1), topk_indices.reshape(-1), q.reshape(-1, dim_qk),
      kv_cache.reshape(-1, dim_qk), *features)
    return out.reshape(num_tokens, num_heads, kv_lora_rank), lse.reshape(num_tokens, num_heads)
