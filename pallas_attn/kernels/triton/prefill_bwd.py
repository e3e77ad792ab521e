"""The backward pass of packed varlen attention on the Pallas Triton backend (FlashAttention-2's two kernels).

The forward saves only ``out`` and the LSE. With ``P = exp(s - L)`` recomputed tile by tile (``L`` the row's full
log-denominator: the keys' LSE, and the sink where there is one), the gradients are::

    dV = Pᵀ dO        dP = dO Vᵀ        dS = P ∘ (dP - D)        D = rowsum(dO ∘ O) - dLSE · exp(L - LSE)
    dQ = (dS ∘ s') K          dK = (dS ∘ s')ᵀ Q          s' = ds / d(q·k): scale, times 1 - tanh² with a soft-cap

(the ``dLSE`` term is the cotangent of a returned LSE; ALiBi adds a constant, so ``s'`` ignores it). Two kernels,
no atomics, so the gradients are bit-identical run to run:

* **dK / dV**: grid ``(kv_tiles, Hkv, num_seqs)``. Program ``(n, h, b)`` holds key tile ``n`` of request ``b`` for
  KV head ``h`` and walks every query head of the group over the query tiles that see the tile (causal: from the
  tile's first key on; a window bounds both ends), accumulating ``dK`` and ``dV`` for the group in float32 (GQA's
  sum over the group happens here, in registers).
* **dQ**: grid ``(q_tiles, Hq, num_seqs)``. Program ``(m, h, b)`` holds query tile ``m`` of one query head and walks
  the key tiles it sees, as the forward does.

Both read only their request's rows: every load is masked to ``[seq_start, seq_start + seq_len)``, so padding rows
and other requests' rows never reach a gradient. Rows no program writes (padding, a request's rows past
``max_seqlen``) are zeroed by the caller (:func:`pallas_attn.ops.varlen`).

Reference: autodiff of :func:`pallas_attn.reference.varlen_attention_dense`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_attn.core import config as config_lib, masks, softmax, tiles
from pallas_attn.core.backend import pallas_triton as plgpu  # None without the backend: the ops say so


# ---------------------------------------------------------------------------------------------- shared parts
def _scores(raw, *, scale: float, mods: masks.ScoreMods, q_pos, k_pos, slope2):
    """``(s2, ds)``: the base-2 scores of raw ``q·k`` (``[M, N]``, as the forward's :meth:`ScoreMods.scores`) and
    ``ds``, the derivative of the natural-log score by the raw product (a scalar without a soft-cap)."""
    s2, ds = mods.base2_with_derivative(raw, scale)
    if mods.alibi:
        s2 = s2 + slope2[:, None] * (k_pos[None, :] - q_pos[:, None]).astype(jnp.float32)
    return s2, ds


def _visible(q_pos, k_pos, seq_len, causal: bool, mods: masks.ScoreMods):
    """``[M, N]`` bool: the forward's mask (causal or the request's length, then the window)."""
    visible = masks.causal_mask(q_pos, k_pos, seq_len) if causal else masks.length_mask(q_pos, k_pos, seq_len)
    visible = visible & (q_pos < seq_len)[:, None]
    window = mods.window_mask(q_pos, k_pos)
    return visible if window is None else visible & window


def _probabilities_and_dscores(q, k, v, do, l2, delta, *, q_pos, k_pos, seq_len, causal, scale, mods, slope2, dot):
    """One (query tile, key tile) pair: ``P [M, N]`` (float32) and ``dS ∘ s'``, the gradient of the raw
    products. ``l2``: the rows' log-denominators in base 2 (``+inf`` for a row that sees no key: its P is 0);
    ``delta``: the rows' ``D``."""
    s2, ds = _scores(dot(q, k.T), scale=scale, mods=mods, q_pos=q_pos, k_pos=k_pos, slope2=slope2)
    p = jnp.where(_visible(q_pos, k_pos, seq_len, causal, mods), jnp.exp2(s2 - l2[:, None]), 0.0)
    dp = dot(do, v.T)  # [M, N]
    return p, p * (dp - delta[:, None]) * ds


def _request(cu_seqlens_ref, b, *, num_seqs: int, num_tokens: int, max_seqlen: int):
    """``(seq_start, seq_len)`` of request ``b``'s rows, truncated to ``max_seqlen`` as the forward reads them."""
    seq_start, seq_end = tiles.request_span(cu_seqlens_ref, b, num_seqs, num_tokens)
    return seq_start, jnp.minimum(seq_end - seq_start, max_seqlen)


def _query_rows(q_ref, do_ref, l2_ref, delta_ref, rows, cols, valid):
    """``(q [M, Dp], dO [M, Dp], l2 [M], D [M])`` of one head's query rows; masked rows read as 0."""
    return (tiles.load_rows(q_ref, rows, cols, valid), tiles.load_rows(do_ref, rows, cols, valid),
            tiles.load_vector(l2_ref, rows, valid), tiles.load_vector(delta_ref, rows, valid))


def _slope2(slopes_ref, q_head, rows: int, mods: masks.ScoreMods):
    """``[rows]``: the query head's ALiBi slope in base 2, or None without ALiBi."""
    return tiles.load_vector(slopes_ref, jnp.full((rows,), q_head)) * softmax.LOG2E if mods.alibi else None


# ---------------------------------------------------------------------------------------------- dK / dV kernel
def _dkdv_kernel(cu_seqlens_ref, q_ref, k_ref, v_ref, do_ref, l2_ref, delta_ref, *refs, num_seqs: int,
                 num_tokens: int, num_q_heads: int, num_kv_heads: int, head_dim: int, max_seqlen: int,
                 block_m: int, block_n: int, causal: bool, scale: float, mods: masks.ScoreMods, precision):
    refs = list(refs)
    slopes_ref = refs.pop(0) if mods.alibi else None
    dk_ref, dv_ref = refs
    n, kv_head, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    group = num_q_heads // num_kv_heads
    cols = tiles.Cols(head_dim, q_ref.shape[-1])
    dot = functools.partial(jnp.dot, preferred_element_type=jnp.float32, precision=precision)
    seq_start, seq_len = _request(cu_seqlens_ref, b, num_seqs=num_seqs, num_tokens=num_tokens, max_seqlen=max_seqlen)

    @pl.when(n * block_n < seq_len)
    def _tile():
        k_pos = n * block_n + jnp.arange(block_n)
        k_valid = k_pos < seq_len
        kv_rows = (seq_start + k_pos) * num_kv_heads + kv_head
        k = tiles.load_rows(k_ref, kv_rows, cols, k_valid)  # [N, Dp]
        v = tiles.load_rows(v_ref, kv_rows, cols, k_valid)
        k_last = jnp.minimum((n + 1) * block_n, seq_len) - 1
        # The query rows that may see a key of this tile, [first, last]: causal from its first key on, a right
        # window from its first key - right on, a left window up to its last key + left.
        first = n * block_n if causal else 0
        if mods.window_right >= 0 and not causal:
            first = jnp.maximum(n * block_n - mods.window_right, 0)
        last = seq_len - 1
        if mods.window_left >= 0:
            last = jnp.minimum(last, k_last + mods.window_left)
        m_start, m_end = first // block_m, last // block_m + 1

        def head(g, acc):
            q_head = kv_head * group + g
            slope2 = _slope2(slopes_ref, q_head, block_m, mods)

            def query_tile(m, acc):
                dk, dv = acc
                q_pos = m * block_m + jnp.arange(block_m)
                q_valid = q_pos < seq_len
                rows = (seq_start + q_pos) * num_q_heads + q_head
                q, do, l2, delta = _query_rows(q_ref, do_ref, l2_ref, delta_ref, rows, cols, q_valid)
                p, dsc = _probabilities_and_dscores(q, k, v, do, l2, delta, q_pos=q_pos, k_pos=k_pos,
                                                    seq_len=seq_len, causal=causal, scale=scale, mods=mods,
                                                    slope2=slope2, dot=dot)
                dv = dv + dot(p.astype(do.dtype).T, do)
                dk = dk + dot(dsc.astype(q.dtype).T, q)
                return dk, dv

            return jax.lax.fori_loop(m_start, m_end, query_tile, acc)

        zeros = jnp.zeros((block_n, q_ref.shape[-1]), jnp.float32)
        dk, dv = jax.lax.fori_loop(0, group, head, (zeros, zeros))
        tiles.store_rows(dk_ref, kv_rows, cols, dk, k_valid)
        tiles.store_rows(dv_ref, kv_rows, cols, dv, k_valid)


# ---------------------------------------------------------------------------------------------- dQ kernel
def _dq_kernel(cu_seqlens_ref, q_ref, k_ref, v_ref, do_ref, l2_ref, delta_ref, *refs, num_seqs: int,
               num_tokens: int, num_q_heads: int, num_kv_heads: int, head_dim: int, max_seqlen: int, block_m: int,
               block_n: int, causal: bool, scale: float, mods: masks.ScoreMods, precision):
    refs = list(refs)
    slopes_ref = refs.pop(0) if mods.alibi else None
    (dq_ref,) = refs
    m, q_head, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    kv_head = q_head // (num_q_heads // num_kv_heads)
    cols = tiles.Cols(head_dim, q_ref.shape[-1])
    dot = functools.partial(jnp.dot, preferred_element_type=jnp.float32, precision=precision)
    seq_start, seq_len = _request(cu_seqlens_ref, b, num_seqs=num_seqs, num_tokens=num_tokens, max_seqlen=max_seqlen)

    @pl.when(m * block_m < seq_len)
    def _tile():
        q_pos = m * block_m + jnp.arange(block_m)
        q_valid = q_pos < seq_len
        rows = (seq_start + q_pos) * num_q_heads + q_head
        q, do, l2, delta = _query_rows(q_ref, do_ref, l2_ref, delta_ref, rows, cols, q_valid)
        slope2 = _slope2(slopes_ref, q_head, block_m, mods)
        q_last = jnp.minimum((m + 1) * block_m, seq_len) - 1
        if mods.windowed:
            start, _, _, kv_end = masks.window_tile_ranges(m * block_m, q_last, seq_len, block_n,
                                                           (mods.window_left, mods.window_right), causal=causal)
        else:
            start = 0
            _, kv_end = masks.kv_tile_ranges(m * block_m, q_last, seq_len, block_n, causal=causal)

        def key_tile(j, dq):
            k_pos = j * block_n + jnp.arange(block_n)
            k_valid = k_pos < seq_len
            kv_rows = (seq_start + k_pos) * num_kv_heads + kv_head
            k = tiles.load_rows(k_ref, kv_rows, cols, k_valid)
            v = tiles.load_rows(v_ref, kv_rows, cols, k_valid)
            _, dsc = _probabilities_and_dscores(q, k, v, do, l2, delta, q_pos=q_pos, k_pos=k_pos, seq_len=seq_len,
                                                causal=causal, scale=scale, mods=mods, slope2=slope2, dot=dot)
            return dq + dot(dsc.astype(k.dtype), k)

        dq = jax.lax.fori_loop(start, kv_end, key_tile, jnp.zeros((block_m, q_ref.shape[-1]), jnp.float32))
        tiles.store_rows(dq_ref, rows, cols, dq, q_valid)


# -------------------------------------------------------------------------------------------- pallas_calls
def varlen_attention_bwd_triton(q, k, v, cu_seqlens, do, l2, delta, alibi_slopes=None, *, max_seqlen: int,
                                causal: bool, scale: float, interpret: bool, cfg: config_lib.PrefillConfig,
                                mods: masks.ScoreMods = masks.NO_MODS):
    """``(dq [T, Hq, D], dk [T, Hkv, D], dv [T, Hkv, D])`` in float32 for the rows the kernels own (a request's
    first ``max_seqlen`` rows); other rows are left unwritten. ``do``: ``[T, Hq, D]``; ``l2``: ``f32[T, Hq]`` the
    rows' full log-denominators in base 2, ``+inf`` where a row sees no key; ``delta``: ``f32[T, Hq]`` (the module's
    ``D``). ``cfg``: ``block_m`` query rows and ``block_n`` keys per tile, warps, stages (one head per query tile)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    num_seqs = cu_seqlens.shape[0] - 1
    padded = config_lib.next_pow2(head_dim)
    block_m, block_n = cfg.block_m, cfg.block_n
    common = dict(num_seqs=num_seqs, num_tokens=num_tokens, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                  head_dim=head_dim, max_seqlen=max_seqlen, block_m=block_m, block_n=block_n, causal=causal,
                  scale=scale, mods=mods, precision=tiles.dot_precision(q.dtype))
    full = lambda n: pl.BlockSpec((n, padded), lambda *_: (0, 0))  # noqa: E731
    vec = lambda n: pl.BlockSpec((n,), lambda *_: (0,))  # noqa: E731
    features = [alibi_slopes.astype(jnp.float32)] if alibi_slopes is not None else []
    in_specs = ([vec(num_seqs + 1), full(num_tokens * num_q_heads), full(num_tokens * num_kv_heads),
                 full(num_tokens * num_kv_heads), full(num_tokens * num_q_heads), vec(num_tokens * num_q_heads),
                 vec(num_tokens * num_q_heads)] + [vec(num_q_heads)] * len(features))
    args = (cu_seqlens, q.reshape(-1, head_dim), k.reshape(-1, head_dim), v.reshape(-1, head_dim),
            do.reshape(-1, head_dim), l2.reshape(-1), delta.reshape(-1), *features)
    params = plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    seq_tiles = lambda block: max(1, pl.cdiv(max(max_seqlen, 1), block))  # noqa: E731
    kv_rows = jax.ShapeDtypeStruct((num_tokens * num_kv_heads, head_dim), jnp.float32)
    dk, dv = pl.pallas_call(
        functools.partial(_dkdv_kernel, **common),
        grid=(seq_tiles(block_n), num_kv_heads, num_seqs),
        in_specs=in_specs, out_specs=[full(num_tokens * num_kv_heads)] * 2, out_shape=[kv_rows, kv_rows],
        compiler_params=params, interpret=interpret,
        name=f"varlen_bwd_dkdv_{'causal' if causal else 'full'}_d{head_dim}",
    )(*args)
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, **common),
        grid=(seq_tiles(block_m), num_q_heads, num_seqs),
        in_specs=in_specs, out_specs=full(num_tokens * num_q_heads),
        out_shape=jax.ShapeDtypeStruct((num_tokens * num_q_heads, head_dim), jnp.float32),
        compiler_params=params, interpret=interpret,
        name=f"varlen_bwd_dq_{'causal' if causal else 'full'}_d{head_dim}",
    )(*args)
    return (dq.reshape(num_tokens, num_q_heads, head_dim), dk.reshape(num_tokens, num_kv_heads, head_dim),
            dv.reshape(num_tokens, num_kv_heads, head_dim))
