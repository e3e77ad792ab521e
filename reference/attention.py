"""Pure-jnp reference attention: the definition of "correct" for every kernel in `pallas_attn`.

Written for clarity, not speed: lengths and page tables are read on the host (`np.asarray`, so these functions
are not jittable, except `merge_attention_states`), requests are handled one at a time in a Python loop, pages
are gathered with plain indexing, all math is float32 with matmuls at `Precision.HIGHEST` (no TF32 on GPU), and
every mask is built from absolute key / query positions. Nothing here imports a kernel.

Shared conventions (docs/design.md#conventions):
  * GQA: query head `h` uses kv head `h // (num_q_heads // num_kv_heads)`.
  * `softmax_scale=None` means `1 / sqrt(head_dim)` of the query (sparse MLA: `1 / sqrt(576)`).
  * Outputs are float32. With `return_lse=True` the functions return `(out, lse)`, where `lse` (float32) is the
    natural-log logsumexp of the *scaled* scores of each query row and head.
  * A query row that sees no key returns `out = 0` and `lse = -inf`. So do token rows that belong to no request
    (padding rows at or past `cu[-1]`).
  * Only the cache pages and block-table entries a request actually uses are read: entries past a request's last
    page may hold `-1` or garbage, and pages it does not own may hold NaN.
  * Kernel-only keyword arguments (`max_seqlen`, `max_query_len`, `num_splits`, `split_size`, `interpret`) are
    accepted and ignored so that a reference call and a kernel call look the same.
"""

from __future__ import annotations

import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np

# float32 matmuls must stay float32 on every backend (GPUs default to TF32 for f32 dots).
_HIGHEST = jax.lax.Precision.HIGHEST


# ---------------------------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------------------------


def _scale(softmax_scale, head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)


def _check_gqa(num_q_heads: int, num_kv_heads: int) -> None:
    if num_kv_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads=} must be a multiple of {num_kv_heads=}")


def _check_cu(cu, num_tokens: int, name: str) -> np.ndarray:
    """Reads `cu` (int[num_seqs + 1]) on the host and checks it is a valid packing of `num_tokens` rows."""
    cu = np.asarray(cu).astype(np.int64)
    if cu.ndim != 1 or cu.size < 1 or cu[0] != 0 or np.any(np.diff(cu) < 0) or cu[-1] > num_tokens:
        raise ValueError(f"{name} must be 1-D, start at 0, be non-decreasing and end <= {num_tokens=}; got {cu}")
    return cu


def _empty_result(num_tokens: int, num_heads: int, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """Host buffers pre-filled with the "sees no key" answer: out 0, lse -inf."""
    out = np.zeros((num_tokens, num_heads, head_dim), np.float32)
    lse = np.full((num_tokens, num_heads), -np.inf, np.float32)
    return out, lse


def _finish(out: np.ndarray, lse: np.ndarray, return_lse: bool):
    out, lse = jnp.asarray(out), jnp.asarray(lse)
    return (out, lse) if return_lse else out


def _gather_positions(cache: jax.Array, table_row: np.ndarray, positions: np.ndarray) -> jax.Array:
    """Rows of a paged cache at logical `positions` of one request.

    cache: [num_blocks, block_size, ...]; table_row: i32[max_blocks]; positions: int[N] -> [N, ...].
    Only the table entries of pages holding `positions` are read, so entries past the request's last page are
    never looked at. Those that are read must be real pages: jnp indexing would silently clamp a bad one.
    """
    num_blocks, block_size = cache.shape[:2]
    logical = positions // block_size
    if np.any(logical >= table_row.shape[0]):
        raise ValueError(f"position {positions.max()} needs page {logical.max()} but {table_row.shape[0]=}")
    physical = table_row[logical]
    if np.any((physical < 0) | (physical >= num_blocks)):
        raise ValueError(f"block table entry out of range [0, {num_blocks=}): {physical}")
    return _take_slots(cache, physical, positions % block_size)


@jax.jit  # one compile per shape instead of several eager index ops
def _take_slots(cache, blocks, slots):
    """cache: [num_blocks, block_size, ...]; blocks, slots: int[N] -> cache[blocks[i], slots[i]]: [N, ...]."""
    return cache[blocks, slots]


@jax.jit  # one compile per request shape instead of one per jnp op: keeps the oracle usable in tests
def _attend(q, k, v, visible, scale) -> tuple[jax.Array, jax.Array]:
    """Masked softmax attention for one request, all heads at once.

    q: [M, Hq, D]; k: [N, Hkv, D]; v: [N, Hkv, Dv]; visible: bool[M, N] (shared by all heads).
    Returns out: f32[M, Hq, Dv] and lse: f32[M, Hq]; a row with no visible key gives 0 and -inf.
    """
    num_rows, num_q_heads, head_dim = q.shape
    num_kv_heads, head_dim_v = k.shape[1], v.shape[2]
    group = num_q_heads // num_kv_heads
    # Query head h = kv_head * group + j, so consecutive query heads share a kv head.
    q = q.astype(jnp.float32).reshape(num_rows, num_kv_heads, group, head_dim)
    k, v = k.astype(jnp.float32), v.astype(jnp.float32)
    visible = visible.astype(bool)[None, None]  # [1, 1, M, N]

    # Subscripts: m query row, n key row, k kv head, g query head within its group, d head dim.
    s = jnp.einsum("mkgd,nkd->kgmn", q, k, precision=_HIGHEST) * scale  # [Hkv, G, M, N]
    # Masked scores are -inf BEFORE the exponential: exp of a masked score far above the row max would be inf, and
    # XLA may turn where(mask, inf, 0) into inf * 0 = NaN (seen at q × 1e20).
    s = jnp.where(visible, s, -jnp.inf)
    # `initial` makes the max of an empty or fully masked row -inf instead of an error.
    row_max = jnp.max(s, axis=-1, keepdims=True, initial=-jnp.inf)
    # Shift by 0 for rows with no visible key so that no -inf - -inf NaN is ever formed.
    shift = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    p = jnp.exp(s - shift)  # [Hkv, G, M, N]; 0 where masked
    denom = p.sum(axis=-1)  # [Hkv, G, M]
    out = jnp.einsum("kgmn,nkd->mkgd", p, v, precision=_HIGHEST)  # [M, Hkv, G, Dv]
    out = out / jnp.where(denom > 0, denom, 1.0).transpose(2, 0, 1)[..., None]
    lse = jnp.where(denom > 0, shift[..., 0] + jnp.log(jnp.where(denom > 0, denom, 1.0)), -jnp.inf)
    return out.reshape(num_rows, num_q_heads, head_dim_v), lse.transpose(2, 0, 1).reshape(num_rows, num_q_heads)


# ---------------------------------------------------------------------------------------------------------------
# Oracles
# ---------------------------------------------------------------------------------------------------------------


def varlen_attention(q, k, v, cu_seqlens, *, max_seqlen=None, causal=True, softmax_scale=None, return_lse=False,
                     interpret=None):
    """Packed variable-length self-attention (prefill over contiguous K/V).

    q: [T, Hq, D]; k, v: [T, Hkv, D]; cu_seqlens: i32[B + 1].
    Request b owns rows [cu_seqlens[b], cu_seqlens[b + 1]) of q, k and v and never sees another request's rows.
    causal=True: local query i sees local keys j <= i; causal=False: every key of its request.
    Returns out f32[T, Hq, D] (and lse f32[T, Hq] if return_lse). `max_seqlen` and `interpret` are ignored.
    """
    del max_seqlen, interpret
    num_tokens, num_q_heads, head_dim = q.shape
    _check_gqa(num_q_heads, k.shape[1])
    cu = _check_cu(cu_seqlens, num_tokens, "cu_seqlens")
    scale = _scale(softmax_scale, head_dim)
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)

    out, lse = _empty_result(num_tokens, num_q_heads, v.shape[-1])
    for start, end in zip(cu[:-1], cu[1:]):
        if start == end:
            continue
        local = np.arange(end - start)
        visible = local[:, None] >= local[None, :] if causal else np.ones((local.size, local.size), bool)
        o, l = _attend(q[start:end], k[start:end], v[start:end], visible, scale)
        out[start:end], lse[start:end] = np.asarray(o), np.asarray(l)
    return _finish(out, lse, return_lse)


def paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens=None, *, softmax_scale=None, num_splits=None,
                           split_size=None, return_lse=False, interpret=None, context_lens=None):
    """One query per request over its paged KV cache; the query sees every one of its `seq_lens[b]` keys (its own
    included, as in `paged_attention`).

    q: [B, Hq, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D]; block_tables: i32[B, max_blocks];
    seq_lens: i32[B] (`context_lens=`: its former name, deprecated, warns).
    Key position p of request b lives at cache[block_tables[b, p // block_size], p % block_size]. Only the first
    cdiv(seq_lens[b], block_size) table entries are read. seq_lens[b] == 0 gives zeros and lse -inf.
    Returns out f32[B, Hq, D] (and lse f32[B, Hq]). `num_splits`, `split_size`, `interpret` are ignored.
    """
    del num_splits, split_size, interpret
    if context_lens is not None:
        if seq_lens is not None:
            raise TypeError("paged_decode_attention() got both seq_lens and its deprecated alias context_lens=; "
                            "pass seq_lens only")
        warnings.warn("paged_decode_attention(): context_lens= is deprecated, pass seq_lens= (the same values)",
                      DeprecationWarning, stacklevel=2)
        seq_lens = context_lens
    if seq_lens is None:
        raise TypeError("paged_decode_attention() missing required argument: 'seq_lens'")
    num_seqs, num_q_heads, head_dim = q.shape
    _check_gqa(num_q_heads, k_cache.shape[2])
    tables, lens = np.asarray(block_tables), np.asarray(seq_lens).astype(np.int64)
    scale = _scale(softmax_scale, head_dim)
    q, k_cache, v_cache = jnp.asarray(q), jnp.asarray(k_cache), jnp.asarray(v_cache)

    out, lse = _empty_result(num_seqs, num_q_heads, v_cache.shape[-1])
    for b in range(num_seqs):
        if lens[b] == 0:
            continue
        positions = np.arange(lens[b])
        k = _gather_positions(k_cache, tables[b], positions)  # [seq_len, Hkv, D]
        v = _gather_positions(v_cache, tables[b], positions)
        o, l = _attend(q[b:b + 1], k, v, np.ones((1, lens[b]), bool), scale)
        out[b], lse[b] = np.asarray(o[0]), np.asarray(l[0])
    return _finish(out, lse, return_lse)


def paged_attention(q, k_cache, v_cache, block_tables, seq_lens, cu_query_lens, *, max_query_len=None,
                    softmax_scale=None, num_splits=None, split_size=None, return_lse=False, interpret=None):
    """Ragged queries over a paged KV cache: decode, verification, chunked and fresh prefill in one batch.

    q: [T, Hq, D] packed; k_cache, v_cache: [num_blocks, block_size, Hkv, D]; block_tables: i32[B, max_blocks];
    seq_lens: i32[B] (every key, the new tokens included, already written to the cache); cu_query_lens: i32[B + 1].

    Request b has q_len = cu_query_lens[b + 1] - cu_query_lens[b] new tokens, which are the LAST q_len of its
    seq_lens[b] keys. With context_len = seq_lens[b] - q_len, local query i sits at absolute position
    context_len + i and sees every key at position <= context_len + i (bottom-right causal alignment).
    For q_len = 3, seq_len = 7 (context_len = 4), ■ visible, · masked:

                          key position
                      0  1  2  3 | 4  5  6
        q0 (pos 4)    ■  ■  ■  ■ | ■  ·  ·
        q1 (pos 5)    ■  ■  ■  ■ | ■  ■  ·
        q2 (pos 6)    ■  ■  ■  ■ | ■  ■  ■
                      cached       new tokens
                      (full [q_len, context_len] rectangle + [q_len, q_len] lower triangle)

    q_len 1 is decode, small q_len verification, context_len 0 fresh prefill, q_len 0 contributes no rows.
    Returns out f32[T, Hq, D] (and lse f32[T, Hq]). `max_query_len`, `num_splits`, `split_size`, `interpret`
    are ignored.
    """
    del max_query_len, num_splits, split_size, interpret
    num_tokens, num_q_heads, head_dim = q.shape
    _check_gqa(num_q_heads, k_cache.shape[2])
    cu = _check_cu(cu_query_lens, num_tokens, "cu_query_lens")
    tables, lens = np.asarray(block_tables), np.asarray(seq_lens).astype(np.int64)
    if lens.shape != (cu.size - 1,):
        raise ValueError(f"seq_lens must have one entry per request: {lens.shape=} vs {cu.size - 1} requests")
    scale = _scale(softmax_scale, head_dim)
    q, k_cache, v_cache = jnp.asarray(q), jnp.asarray(k_cache), jnp.asarray(v_cache)

    out, lse = _empty_result(num_tokens, num_q_heads, v_cache.shape[-1])
    for b, (start, end) in enumerate(zip(cu[:-1], cu[1:])):
        q_len, seq_len = end - start, lens[b]
        if q_len > seq_len:
            raise ValueError(f"request {b}: {q_len=} new tokens but only {seq_len=} keys in the cache")
        if q_len == 0:
            continue
        context_len = seq_len - q_len
        key_pos = np.arange(seq_len)
        query_pos = context_len + np.arange(q_len)
        visible = key_pos[None, :] <= query_pos[:, None]  # [q_len, seq_len]
        k = _gather_positions(k_cache, tables[b], key_pos)  # [seq_len, Hkv, D]
        v = _gather_positions(v_cache, tables[b], key_pos)
        o, l = _attend(q[start:end], k, v, visible, scale)
        out[start:end], lse[start:end] = np.asarray(o), np.asarray(l)
    return _finish(out, lse, return_lse)


def sparse_mla_attention(q, kv_cache, block_tables, topk_indices, *, cu_query_lens=None, kv_lora_rank=512,
                         softmax_scale=None, return_lse=False, interpret=None):
    """Top-k sparse attention over an MLA latent cache (one KV head shared by all query heads).

    q: [T, H, Dqk] (Dqk = 576 = 512 latent + 64 rope); kv_cache: [num_blocks, block_size, Dqk];
    block_tables: i32[B, max_blocks]; topk_indices: i32[T, topk] request-local key positions, -1 = unused;
    cu_query_lens: i32[B + 1], or None meaning token t is the single query of request t (T == B).

    Token t of request b attends to the rows at its valid indices p, found at
    kv_cache[block_tables[b, p // block_size], p % block_size]. Keys are the full Dqk dims of those rows, values
    their first `kv_lora_rank` dims. A duplicate index is a separate key (the same as gather + dense attention).
    A row whose indices are all -1 gives zeros and lse -inf; so do tokens at or past cu_query_lens[-1].
    `softmax_scale=None` means 1 / sqrt(Dqk). Returns out f32[T, H, kv_lora_rank] (and lse f32[T, H]).
    """
    del interpret
    num_tokens, num_heads, head_dim = q.shape
    tables, topk = np.asarray(block_tables), np.asarray(topk_indices).astype(np.int64)
    if topk.ndim != 2 or topk.shape[0] != num_tokens:
        raise ValueError(f"topk_indices must be [T, topk] with {num_tokens=}; got {topk.shape}")
    if np.any(topk < -1):
        raise ValueError("topk_indices must be >= 0, or -1 for an unused slot")
    if cu_query_lens is None:
        if tables.shape[0] != num_tokens:
            raise ValueError(f"cu_query_lens=None needs one token per request: {num_tokens=} vs {tables.shape[0]=}")
        cu = np.arange(num_tokens + 1)
    else:
        cu = _check_cu(cu_query_lens, num_tokens, "cu_query_lens")
    scale = _scale(softmax_scale, head_dim)
    q, kv_cache = jnp.asarray(q), jnp.asarray(kv_cache)

    out, lse = _empty_result(num_tokens, num_heads, kv_lora_rank)
    for b, (start, end) in enumerate(zip(cu[:-1], cu[1:])):
        for t in range(start, end):
            positions = topk[t][topk[t] >= 0]  # duplicates kept on purpose
            if positions.size == 0:
                continue
            rows = _gather_positions(kv_cache, tables[b], positions)[:, None, :]  # [n, 1, Dqk]: one kv head
            o, l = _attend(q[t:t + 1], rows, rows[..., :kv_lora_rank], np.ones((1, positions.size), bool), scale)
            out[t], lse[t] = np.asarray(o[0]), np.asarray(l[0])
    return _finish(out, lse, return_lse)


@jax.jit
def merge_attention_states(outs, lses):
    """Merges attention states computed over disjoint key subsets (the split-KV reduction).

    outs: [S, ..., D]; lses: f32[S, ...] (natural-log LSE of each split). Returns (out f32[..., D], lse f32[...]):
        m = max_s lse_s;  w_s = exp(lse_s - m);  out = sum_s w_s out_s / sum_s w_s;  lse = m + log(sum_s w_s).
    A split with lse_s = -inf saw no key and contributes nothing, even if its out_s is garbage or NaN. When every
    split is empty the result is out 0, lse -inf, and never NaN. Pure jnp and jitted (unlike the other oracles).
    """
    outs = jnp.asarray(outs, jnp.float32)
    lses = jnp.asarray(lses, jnp.float32)
    empty = jnp.isneginf(lses)  # [S, ...]
    m = jnp.max(lses, axis=0)
    # Shift by 0 when every split is empty so that no -inf - -inf NaN is formed.
    shift = jnp.where(jnp.isneginf(m), 0.0, m)
    w = jnp.where(empty, 0.0, jnp.exp(lses - shift))  # [S, ...]
    # `where`, not `w * out`: 0 * NaN would let an empty split's garbage through.
    weighted = jnp.where(empty[..., None], 0.0, w[..., None] * outs)
    total = w.sum(axis=0)
    has_keys = total > 0
    out = weighted.sum(axis=0) / jnp.where(has_keys, total, 1.0)[..., None]
    lse = jnp.where(has_keys, shift + jnp.log(jnp.where(has_keys, total, 1.0)), -jnp.inf)
    return out, lse
