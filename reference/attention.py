"""Pure-jnp reference attention: the definition of "correct" for every kernel in `pallas_attn`.

Written for clarity, not speed: lengths and page tables are read on the host (`np.asarray`, so these functions
are not jittable, except `merge_attention_states` and `varlen_attention_dense`), requests are handled one at a
time in a Python loop, pages are gathered with plain indexing, all math is float32 with matmuls at
`Precision.HIGHEST` (no TF32 on GPU), and every mask is built from absolute key / query positions. Nothing here
imports a kernel.

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

Model-family features (docs/design.md#model-family-features), keyword arguments with one meaning everywhere:
  * `window_size=(left, right)`, FlashAttention's convention (-1: unbounded on that side): the query at position
    i sees keys j with i - left <= j <= i + right, intersected with causality where causal.
  * `softcap` (0: off): the scaled score s becomes softcap * tanh(s / softcap) (Gemma 2, Grok).
  * `alibi_slopes` (f32[Hq]): adds slope_h * (j - i) to the score. Causal keys have j <= i, so the bias is
    -slope_h * distance; a key after its query (non-causal) gets a positive bias.
  * `sinks` (f32[Hq], gpt-oss): a logit with no value in every row's softmax denominator,
    out = sum_j exp(s_j) v_j / (sum_j exp(s_j) + exp(sink_h)). The LSE stays over the keys only, so that split
    states still merge; `merge_attention_states(..., sinks=)` applies the sink once, to the merged state.
    A row that sees no key still gives 0 and -inf: a sink alone does not make a row.
FP8 KV caches (vLLM's per-tensor and per_token_head modes): a paged cache of dtype float8_e4m3fn or float8_e5m2
holds `stored = value / scale` rounded to the format (`quantize_kv`: saturated to its finite range, NaN stays NaN)
and reads as `stored * scale` (`dequantize_kv`); the paged oracles take `k_scale=` and `v_scale=` with such a
cache, positive float32 scalars or float32 scale caches `[num_blocks, block_size, num_kv_heads]` (one scale per
token and head, `kv_scales_per_token_head`), and attend over the dequantised cache in float32: the definition.
Positions i, j are request-local in `varlen_attention` and absolute in the paged oracles (the decode query sits at
seq_len - 1; in `paged_attention` local query i sits at context_len + i), as the causal mask already reads them.
Order of operations, in `_attend` for every oracle:

    s = softmax_scale * q·k  ->  softcap * tanh(s / softcap)  ->  + slope_h * (j - i)
      ->  -inf where masked (causal, window, lengths, pages)  ->  softmax, exp(sink_h) in the denominator
"""

from __future__ import annotations

import functools
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


FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))


def _check_kv_scale(name: str, scale, shape=None):
    """A per-tensor scale (a float32 scalar) or, with ``shape`` (``x.shape[:-1]``: one scale per row of the last
    dim, vLLM's per-(token, head) mode), a float32 scale of that shape; positive and finite where its value is
    known (per-tensor only: a scale cache's unused slots may hold anything)."""
    arr = jnp.asarray(scale)
    if not jnp.issubdtype(arr.dtype, jnp.floating) or (arr.shape != () and arr.shape != shape):
        want = "a float scalar (shape [])" + (f" or float32{list(shape)}" if shape is not None else "")
        raise ValueError(f"{name} must be {want}; got {arr.dtype}{list(arr.shape)}")
    arr = arr.astype(jnp.float32)
    if arr.shape == () and not isinstance(arr, jax.core.Tracer) and not (np.isfinite(float(arr)) and float(arr) > 0):
        raise ValueError(f"{name} must be finite and positive; got {float(arr)}")
    return arr if arr.shape == () else arr[..., None]


SCALE_FLOOR = float(np.finfo(np.float32).tiny)  # a row of zeros gets this scale: it stores zeros


def _scale_of_amax(amax, dtype):
    """``amax · (1 / largest finite)``, the reciprocal rounded to float32 once: a product is correctly rounded on
    every backend, where XLA:GPU's float32 division may be one ulp off (openxla/xla#37181)."""
    reciprocal = np.float32(1.0) / np.float32(jnp.finfo(dtype).max)
    return jnp.maximum(amax * reciprocal, SCALE_FLOOR)


def kv_scales_per_token_head(x, dtype):
    """``f32[...]`` (``x.shape[:-1]``): the scale ``write_kv_cache`` gives each row of ``x [..., head_dim]`` (a
    token's head) in per-(token, head) mode: its largest magnitude over the format's largest finite value, so the
    row's largest element is stored at the top of the format; ``SCALE_FLOOR`` for a row of zeros; NaN in a row
    with NaN."""
    dtype = jnp.dtype(dtype)
    if dtype not in FP8_DTYPES:
        raise ValueError(f"dtype must be float8_e4m3fn or float8_e5m2; got {dtype}")
    amax = jnp.max(jnp.abs(jnp.asarray(x, jnp.float32)), axis=-1)
    return _scale_of_amax(amax, dtype)


def kv_scale_per_tensor(x, dtype):
    """``f32[]``: a per-tensor scale calibrated on ``x`` as a deployment calibrates on sample activations: the
    largest finite magnitude (NaN ignored) over the format's largest finite value, so that magnitude is stored at
    the top of the format; ``SCALE_FLOOR`` for a tensor of zeros."""
    dtype = jnp.dtype(dtype)
    if dtype not in FP8_DTYPES:
        raise ValueError(f"dtype must be float8_e4m3fn or float8_e5m2; got {dtype}")
    amax = jnp.nanmax(jnp.abs(jnp.asarray(x, jnp.float32)))
    return _scale_of_amax(amax, dtype)


def quantize_kv(x, scale, dtype):
    """``dtype[...]``: what an FP8 cache stores for ``x [..., head_dim]`` (`write_kv_cache` with
    ``k_scale``/``v_scale``): ``x / scale`` in float32, saturated to the format's finite range (a finite value never
    becomes inf or NaN), rounded to nearest even; NaN stays NaN. ``scale``: a scalar (per tensor) or
    ``f32[x.shape[:-1]]`` (per token and head: :func:`kv_scales_per_token_head`)."""
    dtype = jnp.dtype(dtype)
    if dtype not in FP8_DTYPES:
        raise ValueError(f"dtype must be float8_e4m3fn or float8_e5m2; got {dtype}")
    finite = float(jnp.finfo(dtype).max)
    x = jnp.asarray(x, jnp.float32)
    y = x / _check_kv_scale("scale", scale, x.shape[:-1])
    return jnp.clip(y, -finite, finite).astype(dtype)


def dequantize_kv(cache, scale):
    """``f32[...]``: an FP8 cache as the attention reads it, ``stored * scale`` (``scale`` as in
    :func:`quantize_kv`)."""
    if jnp.dtype(cache.dtype) not in FP8_DTYPES:
        raise ValueError(f"cache must be float8_e4m3fn or float8_e5m2; got {cache.dtype}")
    cache = jnp.asarray(cache)
    return cache.astype(jnp.float32) * _check_kv_scale("scale", scale, cache.shape[:-1])


FP8_LATENT_GROUP = 128  # latent values per float32 scale in an FP8 latent row


def fp8_latent_width(kv_lora_rank: int, rope_dim: int) -> int:
    """Bytes of one FP8 latent row (FlashMLA's layout): ``kv_lora_rank`` e4m3 values, a float32 scale per
    ``FP8_LATENT_GROUP`` of them, ``rope_dim`` bfloat16 values (DeepSeek: 512 + 16 + 128 = 656)."""
    return kv_lora_rank + 4 * (kv_lora_rank // FP8_LATENT_GROUP) + 2 * rope_dim


def _check_latent_rank(kv_lora_rank: int, dim: int) -> None:
    if kv_lora_rank % FP8_LATENT_GROUP or not 0 < kv_lora_rank <= dim:
        raise ValueError(f"kv_lora_rank must be a multiple of {FP8_LATENT_GROUP} in (0, {dim}] for an FP8 latent "
                         f"row; got {kv_lora_rank}")


def quantize_latent(latent, kv_lora_rank: int = 512):
    """``uint8[..., fp8_latent_width]``: latent rows ``[..., kv_lora_rank + rope_dim]`` as an FP8 latent cache
    stores them (FlashMLA's layout, little-endian): ``kv_lora_rank`` float8_e4m3fn values ``x / scale_g``, then
    one float32 ``scale_g = max |x| / 448`` per group of 128 of them (1 for an all-zero group), then the
    ``rope_dim`` rope values in bfloat16. A finite row never stores inf or NaN; a NaN stays NaN."""
    x = jnp.asarray(latent, jnp.float32)
    _check_latent_rank(kv_lora_rank, x.shape[-1])
    lead, groups = x.shape[:-1], kv_lora_rank // FP8_LATENT_GROUP
    nope = x[..., :kv_lora_rank].reshape(*lead, groups, FP8_LATENT_GROUP)
    amax = jnp.max(jnp.abs(nope), axis=-1)
    finite = float(jnp.finfo(jnp.float8_e4m3fn).max)
    scale = jnp.where(amax > 0, amax / finite, 1.0)  # NaN amax: compares false, the NaN values stay NaN
    values = jnp.clip(nope / scale[..., None], -finite, finite).astype(jnp.float8_e4m3fn)
    as_bytes = lambda a: jax.lax.bitcast_convert_type(a, jnp.uint8).reshape(*lead, -1)  # noqa: E731
    return jnp.concatenate([as_bytes(values), as_bytes(scale.astype(jnp.float32)),
                            as_bytes(x[..., kv_lora_rank:].astype(jnp.bfloat16))], axis=-1)


def dequantize_latent(cache, kv_lora_rank: int = 512):
    """``f32[..., kv_lora_rank + rope_dim]``: FP8 latent rows (:func:`quantize_latent`) as attention reads them,
    each e4m3 value times its group's scale, the rope values widened."""
    cache = jnp.asarray(cache)
    if cache.dtype != jnp.uint8:
        raise ValueError(f"an FP8 latent cache is uint8 (FlashMLA's byte layout); got {cache.dtype}")
    groups = kv_lora_rank // FP8_LATENT_GROUP
    rope_bytes = cache.shape[-1] - kv_lora_rank - 4 * groups
    if kv_lora_rank % FP8_LATENT_GROUP or kv_lora_rank <= 0 or rope_bytes < 0 or rope_bytes % 2:
        raise ValueError(f"rows of {cache.shape[-1]} bytes are not FP8 latent rows of kv_lora_rank={kv_lora_rank} "
                         f"(kv_lora_rank + 4 * kv_lora_rank / {FP8_LATENT_GROUP} + 2 * rope_dim bytes)")
    lead = cache.shape[:-1]
    values = jax.lax.bitcast_convert_type(cache[..., :kv_lora_rank], jnp.float8_e4m3fn).astype(jnp.float32)
    scales = jax.lax.bitcast_convert_type(
        cache[..., kv_lora_rank:kv_lora_rank + 4 * groups].reshape(*lead, groups, 4), jnp.float32)
    rope = jax.lax.bitcast_convert_type(cache[..., kv_lora_rank + 4 * groups:].reshape(*lead, -1, 2), jnp.bfloat16)
    nope = values.reshape(*lead, groups, FP8_LATENT_GROUP) * scales[..., None]
    return jnp.concatenate([nope.reshape(*lead, kv_lora_rank), rope.astype(jnp.float32)], axis=-1)


def _kv_caches(k_cache, v_cache, k_scale, v_scale):
    """The caches the paged oracles attend over: an FP8 pair dequantised with its scales (both required), any
    other as given (scales then refused)."""
    k_cache, v_cache = jnp.asarray(k_cache), jnp.asarray(v_cache)
    fp8 = [jnp.dtype(c.dtype) in FP8_DTYPES for c in (k_cache, v_cache)]
    if any(fp8):
        if not all(fp8):
            raise ValueError(f"k_cache and v_cache must both be FP8 or neither; got {k_cache.dtype}, {v_cache.dtype}")
        if k_scale is None or v_scale is None:
            raise ValueError(f"an FP8 cache ({k_cache.dtype}) needs k_scale= and v_scale= (stored = value / scale)")
        return dequantize_kv(k_cache, k_scale), dequantize_kv(v_cache, v_scale)
    if k_scale is not None or v_scale is not None:
        raise ValueError(f"k_scale / v_scale go with an FP8 cache; this one is {k_cache.dtype}")
    return k_cache, v_cache


def _scale(softmax_scale, head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)


def _check_gqa(num_q_heads: int, num_kv_heads: int) -> None:
    if num_kv_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads=} must be a multiple of {num_kv_heads=}")


def _check_window(window_size) -> tuple[int, int]:
    """(left, right) as Python ints, each >= -1 (-1: unbounded on that side)."""
    is_bound = lambda w: isinstance(w, int | np.integer) and not isinstance(w, bool) and w >= -1
    if not (isinstance(window_size, tuple | list) and len(window_size) == 2 and all(map(is_bound, window_size))):
        raise ValueError(f"window_size must be a pair (left, right) of ints >= -1 (-1: unbounded); got {window_size!r}")
    return int(window_size[0]), int(window_size[1])


def _check_softcap(softcap) -> float:
    try:
        value = float(softcap)
    except (TypeError, ValueError):
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"softcap must be a finite float >= 0 (0: off); got {softcap!r}")
    return value


def _check_per_head(values, num_q_heads: int, name: str) -> jax.Array | None:
    """A per-query-head parameter (`sinks`, `alibi_slopes`) as f32[num_q_heads], or None."""
    if values is None:
        return None
    values = jnp.asarray(values, jnp.float32)
    if values.shape != (num_q_heads,):
        raise ValueError(f"{name} must be f32[num_q_heads] with {num_q_heads=}; got shape {values.shape}")
    return values


def _check_features(num_q_heads: int, window_size, softcap, alibi_slopes, sinks):
    """The model-family keywords, validated: ((left, right), the keyword arguments they give `_attend`)."""
    return _check_window(window_size), dict(softcap=_check_softcap(softcap),
                                            alibi_slopes=_check_per_head(alibi_slopes, num_q_heads, "alibi_slopes"),
                                            sinks=_check_per_head(sinks, num_q_heads, "sinks"))


def _visible(query_pos: np.ndarray, key_pos: np.ndarray, causal: bool, window_size: tuple[int, int]) -> np.ndarray:
    """bool[M, N]: which keys each query sees, from positions in one frame (both request-local or both absolute).

    query_pos: int[M]; key_pos: int[N]. Causal: j <= i. Window (left, right): i - left <= j <= i + right, a bound
    of -1 being absent. Lengths and pages are the caller's to mask.
    """
    offset = key_pos[None, :] - query_pos[:, None]  # [M, N]: j - i
    left, right = window_size
    visible = offset == offset  # all True, in the positions' own array type (numpy, or jnp when traced)
    if causal:
        visible = visible & (offset <= 0)
    if left >= 0:
        visible = visible & (offset >= -left)
    if right >= 0:
        visible = visible & (offset <= right)
    return visible


def _first_key(first_query: int, window_size: tuple[int, int]) -> int:
    """The first key position a query at `first_query` or later can see (paged oracles: the keys are read from
    there on, so a window's expired pages are never read and their table entries may hold anything)."""
    left = window_size[0]
    return 0 if left < 0 else max(0, first_query - left)


def _request_rows(cu, num_tokens: int, name: str) -> np.ndarray:
    """Reads `cu` (int[num_seqs + 1]) on the host: the request boundaries, made safe whatever they hold.

    Boundaries are clamped into [0, num_tokens] and made non-decreasing (a running max), so request b owns rows
    [cu[b], cu[b + 1]) of the result and requests never overlap. On a valid `cu` (0 = cu[0] <= ... <= cu[-1] <=
    num_tokens) this is the identity. Rows before cu[0] and from cu[-1] on belong to no request.
    """
    cu = np.asarray(cu).astype(np.int64)
    if cu.ndim != 1 or cu.size < 1:
        raise ValueError(f"{name} must be 1-D with num_seqs + 1 >= 1 entries; got shape {cu.shape}")
    return np.minimum(np.maximum.accumulate(np.maximum(cu, 0)), num_tokens)


def _empty_result(num_tokens: int, num_heads: int, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """Host buffers pre-filled with the "sees no key" answer: out 0, lse -inf."""
    out = np.zeros((num_tokens, num_heads, head_dim), np.float32)
    lse = np.full((num_tokens, num_heads), -np.inf, np.float32)
    return out, lse


def _finish(out: np.ndarray, lse: np.ndarray, return_lse: bool):
    out, lse = jnp.asarray(out), jnp.asarray(lse)
    return (out, lse) if return_lse else out


def _gather_positions(cache: jax.Array, table_row: np.ndarray, positions: np.ndarray):
    """Rows of a paged cache at logical `positions` of one request, and which of them exist.

    cache: [num_blocks, block_size, ...]; table_row: i32[max_blocks]; positions: int[N] (inside the table:
    < max_blocks * block_size) -> (rows [N, ...], ok bool[N]). Only the table entries of pages holding `positions`
    are read, so entries past the request's last page are never looked at. A key whose page id is outside the pool
    [0, num_blocks) does not exist: ok is False, its row is zeros, and the caller masks its score.
    """
    num_blocks, block_size = cache.shape[:2]
    physical = table_row[positions // block_size].astype(np.int64)
    ok = (physical >= 0) & (physical < num_blocks)
    rows = _take_slots(cache, np.where(ok, physical, 0), positions % block_size)
    # Zeros, not page 0's contents: a masked key's value must not reach the output as 0 * NaN.
    return jnp.where(ok.reshape(-1, *[1] * (rows.ndim - 1)), rows, 0), ok


def _capped_lens(lens, table_width: int, block_size: int) -> np.ndarray:
    """Key counts as the kernels read them: clamped into [0, the table's capacity max_blocks * block_size]."""
    return np.clip(np.asarray(lens).astype(np.int64), 0, table_width * block_size)


@jax.jit  # one compile per shape instead of several eager index ops
def _take_slots(cache, blocks, slots):
    """cache: [num_blocks, block_size, ...]; blocks, slots: int[N] -> cache[blocks[i], slots[i]]: [N, ...]."""
    return cache[blocks, slots]


# One compile per request shape instead of one per jnp op: keeps the oracle usable in tests. `softcap` is static
# because it picks the program (0: no tanh at all), like `alibi_slopes=None` and `sinks=None` do.
@functools.partial(jax.jit, static_argnames="softcap")
def _attend(q, k, v, visible, scale, *, query_pos=None, key_pos=None, alibi_slopes=None, sinks=None,
            softcap=0.0) -> tuple[jax.Array, jax.Array]:
    """Masked softmax attention for one request, all heads at once, in the module's order of operations.

    q: [M, Hq, D]; k: [N, Hkv, D]; v: [N, Hkv, Dv]; visible: bool[M, N] (shared by all heads);
    query_pos: int[M], key_pos: int[N] (read only for ALiBi); alibi_slopes, sinks: f32[Hq] or None.
    Returns out: f32[M, Hq, Dv] and lse: f32[M, Hq] over the keys only (no sink); a row with no visible key gives
    0 and -inf, sink or not.
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
    if softcap:
        s = softcap * jnp.tanh(s / softcap)
    if alibi_slopes is not None:
        offset = (key_pos[None, :] - query_pos[:, None]).astype(jnp.float32)  # [M, N]: j - i, exact in int
        s = s + alibi_slopes.reshape(num_kv_heads, group, 1, 1) * offset
    # Masked scores are -inf BEFORE the exponential: exp of a masked score far above the row max would be inf, and
    # XLA may turn where(mask, inf, 0) into inf * 0 = NaN (seen at q × 1e20).
    s = jnp.where(visible, s, -jnp.inf)
    # `initial` makes the max of an empty or fully masked row -inf instead of an error.
    row_max = jnp.max(s, axis=-1, keepdims=True, initial=-jnp.inf)
    # Shift by 0 for rows with no visible key so that no -inf - -inf NaN is ever formed. The softmax and the LSE do
    # not depend on the shift, so no gradient flows through it (varlen_attention_dense differentiates this).
    shift = jax.lax.stop_gradient(jnp.where(jnp.isfinite(row_max), row_max, 0.0))
    p = jnp.exp(s - shift)  # [Hkv, G, M, N]; 0 where masked
    denom = p.sum(axis=-1)  # [Hkv, G, M]; >= 1 when the row sees a key
    out = jnp.einsum("kgmn,nkd->mkgd", p, v, precision=_HIGHEST)  # [M, Hkv, G, Dv]
    total = denom
    if sinks is not None:
        # The sink joins the denominator on the keys' shift, not on max(row max, sink): the LSE must stay over the
        # keys. A sink far above every score overflows to inf and the output goes to 0, its limit.
        total = denom + jnp.exp(sinks.reshape(num_kv_heads, group, 1) - shift[..., 0])
    out = out / jnp.where(denom > 0, total, 1.0).transpose(2, 0, 1)[..., None]
    lse = jnp.where(denom > 0, shift[..., 0] + jnp.log(jnp.where(denom > 0, denom, 1.0)), -jnp.inf)
    return out.reshape(num_rows, num_q_heads, head_dim_v), lse.transpose(2, 0, 1).reshape(num_rows, num_q_heads)


# ---------------------------------------------------------------------------------------------------------------
# Oracles
# ---------------------------------------------------------------------------------------------------------------


def varlen_attention(q, k, v, cu_seqlens, *, max_seqlen=None, causal=True, softmax_scale=None,
                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, sinks=None, return_lse=False,
                     interpret=None):
    """Packed variable-length self-attention (prefill over contiguous K/V).

    q: [T, Hq, D]; k, v: [T, Hkv, D]; cu_seqlens: i32[B + 1].
    Request b owns rows [cu_seqlens[b], cu_seqlens[b + 1]) of q, k and v and never sees another request's rows.
    causal=True: local query i sees local keys j <= i; causal=False: every key of its request.
    `window_size`, `softcap`, `alibi_slopes` (f32[Hq]), `sinks` (f32[Hq]): see the module docstring; i and j are
    request-local positions.
    A request longer than `max_seqlen` (when given) is truncated to its first max_seqlen tokens, queries and keys;
    its other rows, like rows no request owns (before cu_seqlens[0], from cu_seqlens[-1] on), give zeros and lse
    -inf. Boundaries are read as `_request_rows` says. Returns out f32[T, Hq, D] (and lse f32[T, Hq] if
    return_lse). `interpret` is ignored.
    """
    del interpret
    num_tokens, num_q_heads, head_dim = q.shape
    _check_gqa(num_q_heads, k.shape[1])
    window, features = _check_features(num_q_heads, window_size, softcap, alibi_slopes, sinks)
    cu = _request_rows(cu_seqlens, num_tokens, "cu_seqlens")
    scale = _scale(softmax_scale, head_dim)
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)

    out, lse = _empty_result(num_tokens, num_q_heads, v.shape[-1])
    for start, end in zip(cu[:-1], cu[1:]):
        if max_seqlen is not None:
            end = min(end, start + max_seqlen)
        if start == end:
            continue
        local = np.arange(end - start)
        visible = _visible(local, local, causal, window)
        o, l = _attend(q[start:end], k[start:end], v[start:end], visible, scale, query_pos=local, key_pos=local,
                       **features)
        out[start:end], lse[start:end] = np.asarray(o), np.asarray(l)
    return _finish(out, lse, return_lse)


def varlen_attention_dense(q, k, v, cu_seqlens, *, max_seqlen=None, causal=True, softmax_scale=None,
                           window_size=(-1, -1), softcap=0.0, alibi_slopes=None, sinks=None, return_lse=False,
                           interpret=None):
    """`varlen_attention`, jittable and differentiable: one masked [T, T] attention over all packed rows at once
    (memory O(T² · Hq): for tests and small models), with the same arguments and results. Everything is traced:
    `cu_seqlens` may be a traced array, read as `_request_rows` reads it. The gradient of a row that belongs to no
    request (or past `max_seqlen` in its request) is zero, and nothing of it (NaN included) reaches another row's
    gradient: such rows are replaced by zeros before any product. Gradients flow to q, k, v and `sinks`.
    """
    del interpret
    num_tokens, num_q_heads, head_dim = q.shape
    _check_gqa(num_q_heads, k.shape[1])
    window, features = _check_features(num_q_heads, window_size, softcap, alibi_slopes, sinks)
    scale = _scale(softmax_scale, head_dim)
    cu = jnp.asarray(cu_seqlens).astype(jnp.int32)
    if cu.ndim != 1 or cu.shape[0] < 1:
        raise ValueError(f"cu_seqlens must be 1-D with num_seqs + 1 >= 1 entries; got shape {cu.shape}")
    cu = jnp.minimum(jax.lax.cummax(jnp.maximum(cu, 0)), num_tokens)  # `_request_rows`, traced
    tok = jnp.arange(num_tokens)
    req = jnp.clip(jnp.searchsorted(cu, tok, side="right") - 1, 0, cu.shape[0] - 1)
    local = tok - cu[req]
    owned = (tok >= cu[0]) & (tok < cu[-1])
    if max_seqlen is not None:
        owned &= local < max_seqlen
    visible = (req[:, None] == req[None, :]) & owned[:, None] & owned[None, :] & _visible(local, local, causal,
                                                                                          window)
    rows = owned[:, None, None]
    q, k, v = (jnp.where(rows, jnp.asarray(x), jnp.zeros((), jnp.asarray(x).dtype)) for x in (q, k, v))
    out, lse = _attend(q, k, v, visible, scale, query_pos=local, key_pos=local, **features)
    return (out, lse) if return_lse else out


def paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens=None, *, softmax_scale=None,
                           window_size=(-1, -1), softcap=0.0, alibi_slopes=None, sinks=None, num_splits=None,
                           split_size=None, return_lse=False, interpret=None, context_lens=None, k_scale=None,
                           v_scale=None):
    """One query per request over its paged KV cache; the query sees every one of its `seq_lens[b]` keys (its own
    included, as in `paged_attention`), or those inside `window_size`.

    q: [B, Hq, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D]; block_tables: i32[B, max_blocks];
    seq_lens: i32[B] (`context_lens=`: its former name, deprecated, warns).
    Key position p of request b lives at cache[block_tables[b, p // block_size], p % block_size]. Only the first
    cdiv(seq_lens[b], block_size) table entries are read. seq_lens[b] == 0 gives zeros and lse -inf. Lengths are
    clamped into [0, max_blocks * block_size]; a key on a page id outside [0, num_blocks) is masked.
    `window_size`, `softcap`, `alibi_slopes` (f32[Hq]), `sinks` (f32[Hq]): see the module docstring; positions are
    absolute, the query at seq_lens[b] - 1. With a left window only keys from seq_lens[b] - 1 - left on are read.
    An FP8 cache (float8_e4m3fn / e5m2) takes `k_scale`, `v_scale`: attention over `dequantize_kv` of it.
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
    window, features = _check_features(num_q_heads, window_size, softcap, alibi_slopes, sinks)
    tables = np.asarray(block_tables)
    lens = _capped_lens(seq_lens, tables.shape[1], k_cache.shape[1])
    scale = _scale(softmax_scale, head_dim)
    q = jnp.asarray(q)
    k_cache, v_cache = _kv_caches(k_cache, v_cache, k_scale, v_scale)

    out, lse = _empty_result(num_seqs, num_q_heads, v_cache.shape[-1])
    for b in range(num_seqs):
        if lens[b] == 0:
            continue
        query_pos = np.array([lens[b] - 1])
        key_pos = np.arange(_first_key(query_pos[0], window), lens[b])
        k, ok = _gather_positions(k_cache, tables[b], key_pos)  # [seq_len, Hkv, D] (from the window's start)
        v, _ = _gather_positions(v_cache, tables[b], key_pos)
        visible = _visible(query_pos, key_pos, True, window) & ok[None, :]  # [1, seq_len]
        o, l = _attend(q[b:b + 1], k, v, visible, scale, query_pos=query_pos, key_pos=key_pos, **features)
        out[b], lse[b] = np.asarray(o[0]), np.asarray(l[0])
    return _finish(out, lse, return_lse)


def paged_attention(q, k_cache, v_cache, block_tables, seq_lens, cu_query_lens, *, max_query_len=None,
                    softmax_scale=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, sinks=None,
                    num_splits=None, split_size=None, return_lse=False, interpret=None, k_scale=None, v_scale=None):
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
    Whatever the inputs hold: boundaries are read as `_request_rows` says (rows no request owns give zeros and lse
    -inf), seq_lens are clamped into [0, max_blocks * block_size] (a q_len past seq_len puts the first queries at
    negative positions, which see no key), and keys on a page id outside [0, num_blocks) are masked.
    `window_size`, `softcap`, `alibi_slopes` (f32[Hq]), `sinks` (f32[Hq]): see the module docstring; positions are
    the absolute ones above. With a left window only keys from context_len - left on are read: pages wholly before
    every query's window may have been freed. An FP8 cache takes `k_scale`, `v_scale` (`dequantize_kv`).
    Returns out f32[T, Hq, D] (and lse f32[T, Hq]). `max_query_len`, `num_splits`, `split_size`, `interpret`
    are ignored.
    """
    del max_query_len, num_splits, split_size, interpret
    num_tokens, num_q_heads, head_dim = q.shape
    _check_gqa(num_q_heads, k_cache.shape[2])
    window, features = _check_features(num_q_heads, window_size, softcap, alibi_slopes, sinks)
    cu = _request_rows(cu_query_lens, num_tokens, "cu_query_lens")
    tables = np.asarray(block_tables)
    lens = _capped_lens(seq_lens, tables.shape[1], k_cache.shape[1])
    if lens.shape != (cu.size - 1,):
        raise ValueError(f"seq_lens must have one entry per request: {lens.shape=} vs {cu.size - 1} requests")
    scale = _scale(softmax_scale, head_dim)
    q = jnp.asarray(q)
    k_cache, v_cache = _kv_caches(k_cache, v_cache, k_scale, v_scale)

    out, lse = _empty_result(num_tokens, num_q_heads, v_cache.shape[-1])
    for b, (start, end) in enumerate(zip(cu[:-1], cu[1:])):
        q_len, seq_len = end - start, lens[b]
        if q_len == 0:
            continue
        context_len = seq_len - q_len
        query_pos = context_len + np.arange(q_len)
        key_pos = np.arange(_first_key(context_len, window), seq_len)
        k, ok = _gather_positions(k_cache, tables[b], key_pos)  # [seq_len, Hkv, D] (from the window's start)
        v, _ = _gather_positions(v_cache, tables[b], key_pos)
        visible = _visible(query_pos, key_pos, True, window) & ok[None, :]  # [q_len, seq_len]
        o, l = _attend(q[start:end], k, v, visible, scale, query_pos=query_pos, key_pos=key_pos, **features)
        out[start:end], lse[start:end] = np.asarray(o), np.asarray(l)
    return _finish(out, lse, return_lse)


def sparse_mla_attention(q, kv_cache, block_tables, topk_indices, *, cu_query_lens=None, seq_lens=None,
                         kv_lora_rank=512, softmax_scale=None, sinks=None, return_lse=False, interpret=None):
    """Top-k sparse attention over an MLA latent cache (one KV head shared by all query heads).

    q: [T, H, Dqk] (Dqk = 576 = 512 latent + 64 rope); kv_cache: [num_blocks, block_size, Dqk], or an FP8 latent
    cache uint8[num_blocks, block_size, fp8_latent_width] (:func:`quantize_latent`), read as its dequantised rows;
    block_tables: i32[B, max_blocks]; topk_indices: i32[T, topk] request-local key positions, -1 = unused;
    cu_query_lens: i32[B + 1], or None meaning token t is the single query of request t (T == B).

    Token t of request b attends to the rows at its valid indices p, found at
    kv_cache[block_tables[b, p // block_size], p % block_size]. Keys are the full Dqk dims of those rows, values
    their first `kv_lora_rank` dims. A duplicate index is a separate key (the same as gather + dense attention).
    A row whose indices are all -1 gives zeros and lse -inf; so do tokens no request owns (`_request_rows`).
    An index past the request's keys is ignored like -1: past seq_lens[b] when seq_lens (i32[B]) is given, past
    the table's capacity max_blocks * block_size always; so is one on a page id outside [0, num_blocks).
    `softmax_scale=None` means 1 / sqrt(Dqk). `sinks` (f32[H]): see the module docstring.
    Returns out f32[T, H, kv_lora_rank] (and lse f32[T, H], over the keys only).
    """
    del interpret
    num_tokens, num_heads, head_dim = q.shape
    tables, topk = np.asarray(block_tables), np.asarray(topk_indices).astype(np.int64)
    if topk.ndim != 2 or topk.shape[0] != num_tokens:
        raise ValueError(f"topk_indices must be [T, topk] with {num_tokens=}; got {topk.shape}")
    if cu_query_lens is None:
        if tables.shape[0] != num_tokens:
            raise ValueError(f"cu_query_lens=None needs one token per request: {num_tokens=} vs {tables.shape[0]=}")
        cu = np.arange(num_tokens + 1)
    else:
        cu = _request_rows(cu_query_lens, num_tokens, "cu_query_lens")
    capacity = tables.shape[1] * kv_cache.shape[1]
    limits = (np.full(tables.shape[0], capacity) if seq_lens is None
              else _capped_lens(seq_lens, tables.shape[1], kv_cache.shape[1]))
    sinks = _check_per_head(sinks, num_heads, "sinks")
    scale = _scale(softmax_scale, head_dim)
    q, kv_cache = jnp.asarray(q), jnp.asarray(kv_cache)

    out, lse = _empty_result(num_tokens, num_heads, kv_lora_rank)
    for b, (start, end) in enumerate(zip(cu[:-1], cu[1:])):
        for t in range(start, end):
            positions = topk[t][(topk[t] >= 0) & (topk[t] < limits[b])]  # duplicates kept on purpose
            if positions.size == 0:
                continue
            rows, ok = _gather_positions(kv_cache, tables[b], positions)
            rows = rows[:, None, :]  # [n, 1, Dqk]: one kv head
            o, l = _attend(q[t:t + 1], rows, rows[..., :kv_lora_rank], ok[None, :], scale, sinks=sinks)
            out[t], lse[t] = np.asarray(o[0]), np.asarray(l[0])
    return _finish(out, lse, return_lse)


def mla_attention(q, kv_cache, block_tables, seq_lens, cu_query_lens=None, *, max_query_len=1, kv_lora_rank=512,
                  softmax_scale=None, num_splits=None, split_size=None, sinks=None, return_lse=False, interpret=None):
    """Dense attention over an MLA latent cache (DeepSeek-V3 / Kimi-K2 with absorbed queries): every query head
    attends to every key of its request, the latent rows of one KV head shared by all heads.

    q: [T, H, Dqk] (Dqk = 576 = 512 latent + 64 rope); kv_cache: [num_blocks, block_size, Dqk], or an FP8 latent
    cache uint8[num_blocks, block_size, fp8_latent_width] (:func:`quantize_latent`), read as its dequantised rows;
    block_tables: i32[B, max_blocks]; seq_lens: i32[B] (every key, the new tokens included, already in the cache);
    cu_query_lens: i32[B + 1], or None meaning token t is the single query of request t (T == B: decode).

    Keys are the rows' full Dqk dims, values their first `kv_lora_rank` dims. Request b's q_len new tokens are the
    last of its seq_lens[b] keys, causal among themselves: this is `paged_attention` with one KV head of dim Dqk
    whose values are the keys' first `kv_lora_rank` dims, and every rule of `paged_attention` on rows, lengths and
    pages holds (rows no request owns give zeros and lse -inf; lengths clamped to the table's capacity; keys on a
    page id outside [0, num_blocks) masked). `softmax_scale=None` means 1 / sqrt(Dqk). `sinks` (f32[H]): see the
    module docstring. Returns out f32[T, H, kv_lora_rank] (and lse f32[T, H], over the keys only).
    `max_query_len`, `num_splits`, `split_size`, `interpret` are ignored.
    """
    del max_query_len, num_splits, split_size, interpret
    q, kv_cache = jnp.asarray(q), jnp.asarray(kv_cache)
    if kv_cache.dtype == jnp.uint8:  # an FP8 latent cache: attention over its dequantised rows
        kv_cache = dequantize_latent(kv_cache, kv_lora_rank)
    if q.ndim != 3 or kv_cache.ndim != 3 or q.shape[-1] != kv_cache.shape[-1]:
        raise ValueError(f"q must be [T, H, Dqk] and kv_cache [num_blocks, block_size, Dqk] with one Dqk; got "
                         f"{q.shape} and {kv_cache.shape}")
    if not 0 < kv_lora_rank <= q.shape[-1]:
        raise ValueError(f"kv_lora_rank must be in [1, Dqk = {q.shape[-1]}]; got {kv_lora_rank}")
    if cu_query_lens is None:
        if np.asarray(block_tables).shape[0] != q.shape[0]:
            raise ValueError(f"cu_query_lens=None needs one token per request: T = {q.shape[0]} vs "
                             f"block_tables.shape[0] = {np.asarray(block_tables).shape[0]}")
        cu_query_lens = np.arange(q.shape[0] + 1)
    latent = kv_cache[:, :, None, :]  # [num_blocks, block_size, 1, Dqk]: the one KV head
    return paged_attention(q, latent, latent[..., :kv_lora_rank], block_tables, seq_lens, cu_query_lens,
                           softmax_scale=softmax_scale, sinks=sinks, return_lse=return_lse)


@jax.jit
def merge_attention_states(outs, lses, sinks=None):
    """Merges attention states computed over disjoint key subsets (the split-KV reduction).

    outs: [S, ..., D]; lses: f32[S, ...] (natural-log LSE of each split). Returns (out f32[..., D], lse f32[...]):
        m = max_s lse_s;  w_s = exp(lse_s - m);  out = sum_s w_s out_s / sum_s w_s;  lse = m + log(sum_s w_s).
    A split with lse_s = -inf saw no key and contributes nothing, even if its out_s is garbage or NaN. When every
    split is empty the result is out 0, lse -inf, and never NaN. Pure jnp and jitted (unlike the other oracles).

    sinks: f32[H] or None, H the last axis of lses (the head axis). The states are sink-free (as every oracle
    returns them: their LSE is over keys only) and the sink is applied here, once:
        out = sum_s w_s out_s / (sum_s w_s + exp(sink_h - m));  lse unchanged, over the keys only.
    So the merge of sink-free splits equals the unsplit call with `sinks=`. Rows where every split is empty stay
    out 0, lse -inf.
    """
    outs = jnp.asarray(outs, jnp.float32)
    lses = jnp.asarray(lses, jnp.float32)
    if sinks is not None:
        sinks = jnp.asarray(sinks, jnp.float32)
        if lses.ndim < 2 or sinks.shape != lses.shape[-1:]:
            raise ValueError(f"sinks must be f32[H] with H = lses.shape[-1], the head axis of lses [S, ..., H]; "
                             f"got sinks {sinks.shape} for lses {lses.shape}")
    empty = jnp.isneginf(lses)  # [S, ...]
    m = jnp.max(lses, axis=0)
    # Shift by 0 when every split is empty so that no -inf - -inf NaN is formed.
    shift = jnp.where(jnp.isneginf(m), 0.0, m)
    w = jnp.where(empty, 0.0, jnp.exp(lses - shift))  # [S, ...]
    # `where`, not `w * out`: 0 * NaN would let an empty split's garbage through.
    weighted = jnp.where(empty[..., None], 0.0, w[..., None] * outs)
    total = w.sum(axis=0)
    has_keys = total > 0
    # As in `_attend`: the sink joins the denominator on the keys' shift, so the LSE below stays over the keys.
    denom = total if sinks is None else total + jnp.exp(sinks - shift)
    out = weighted.sum(axis=0) / jnp.where(has_keys, denom, 1.0)[..., None]
    lse = jnp.where(has_keys, shift + jnp.log(jnp.where(has_keys, total, 1.0)), -jnp.inf)
    return out, lse
