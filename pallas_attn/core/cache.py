"""Paged KV cache: layout, allocation, and the write of new K/V through `slot_mapping`.

Layout (vLLM / FlashAttention): `k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim]`. All requests
share one pool of `num_blocks` pages of `block_size` tokens (a power of two up to 16 or a multiple of 16 up to 1024:
`pallas_attn.core.validation.check_block_size`). The MLA latent cache drops the head axis:
`[num_blocks, block_size, head_dim]` (`gather_kv` reads both).

Slot formula (docs/design.md#paged-kv-layout), for position `pos` of request `req`:
    logical_block  = pos // block_size
    physical_block = block_tables[req][logical_block]
    slot           = physical_block * block_size + pos % block_size
so slot `s` is row `s % block_size` of page `s // block_size`, i.e. row `s` of the cache viewed as
`[num_blocks * block_size, ...]`. `BatchMetadata.slot_mapping` (metadata.py) holds the slot of every new token;
-1 marks a padding row.

Limits: slots must fit in int32 (`num_blocks * block_size < 2**31`). `write_kv_cache` drops every slot outside
`[0, num_blocks * block_size)`, not only -1; it does not check for two rows writing one slot (the last one wins
on CPU; on GPU the winner is unspecified).
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from pallas_attn.core import validation

PAD_SLOT = -1  # slot_mapping entry of a padding row: skipped by the write
FP8_DTYPES = validation.FP8_DTYPES  # stored = value / scale: write_kv_cache(k_scale=, v_scale=)
SCALE_FLOOR = float(np.finfo(np.float32).tiny)  # the per-(token, head) scale of a row of zeros
CACHE_DTYPES = (*validation.FLOAT_DTYPES, *FP8_DTYPES)


def _quantize(x, scale, dtype):
    """``x / scale`` saturated to ``dtype``'s finite range (a finite value never becomes inf or NaN), rounded to
    nearest even: ``pallas_attn.reference.quantize_kv``, the definition."""
    finite = float(jnp.finfo(dtype).max)
    return jnp.clip(x.astype(jnp.float32) / scale, -finite, finite).astype(dtype)


@functools.partial(jax.jit, static_argnames=("kv_lora_rank",))
def quantize_latent(latent, kv_lora_rank: int = 512) -> jax.Array:
    """MLA latent rows as an FP8 latent cache stores them (FlashMLA's layout; ``mla_attention`` reads it).

    Args:
      latent: ``[..., kv_lora_rank + rope_dim]`` float latent rows (DeepSeek: 512 + 64), e.g. the new tokens'.
      kv_lora_rank: a multiple of 128.

    Returns:
      ``uint8[..., kv_lora_rank + 4 * kv_lora_rank / 128 + 2 * rope_dim]`` (656 bytes for DeepSeek's rows, against
      1,152 in bf16): ``kv_lora_rank`` float8_e4m3fn values ``x / scale_g``, one float32 ``scale_g = max |x| / 448``
      per 128 of them (1 for a group of zeros), the rope dims in bfloat16. A finite row never stores inf or NaN.
      Write rows into the cache ``uint8[num_blocks, block_size, 656]`` at their slots as any latent row
      (``cache.reshape(-1, 656).at[slot_mapping].set(rows)``). The definition:
      :func:`pallas_attn.reference.quantize_latent`.
    """
    x = jnp.asarray(latent).astype(jnp.float32)
    validation.check_fp8_latent_rank(kv_lora_rank, x.shape[-1])
    lead, groups = x.shape[:-1], kv_lora_rank // validation.FP8_LATENT_GROUP
    nope = x[..., :kv_lora_rank].reshape(*lead, groups, validation.FP8_LATENT_GROUP)
    amax = jnp.max(jnp.abs(nope), axis=-1)
    finite = float(jnp.finfo(jnp.float8_e4m3fn).max)
    scale = jnp.where(amax > 0, amax / finite, 1.0)
    parts = (jnp.clip(nope / scale[..., None], -finite, finite).astype(jnp.float8_e4m3fn), scale,
             x[..., kv_lora_rank:].astype(jnp.bfloat16))
    return jnp.concatenate([jax.lax.bitcast_convert_type(p, jnp.uint8).reshape(*lead, -1) for p in parts], axis=-1)


def allocate_kv_cache(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype=jnp.bfloat16
) -> tuple[jax.Array, jax.Array]:
    """Zero caches `(k_cache, v_cache)`, each `dtype[num_blocks, block_size, num_kv_heads, head_dim]`.

    `block_size` must be one the paged kernels accept: a power of two up to 16 or a multiple of 16 up to 1024
    (48 and 544 included); anything else raises `ValueError` here rather than at the first attention call.
    `dtype`: bfloat16, float16, float32, or an FP8 format (float8_e4m3fn, float8_e5m2) written through
    `write_kv_cache(..., k_scale=, v_scale=)` and read by the paged kernels given the same scales
    (docs/design.md#fp8-kv-caches).

    Example:
      >>> k_cache, v_cache = allocate_kv_cache(8, 16, 2, 64)
      >>> k_cache.shape, k_cache.dtype
      ((8, 16, 2, 64), dtype(bfloat16))
    """
    for name, value in dict(num_blocks=num_blocks, block_size=block_size, num_kv_heads=num_kv_heads,
                            head_dim=head_dim).items():
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive int")
    validation.check_block_size(int(block_size))
    if jnp.dtype(dtype) not in CACHE_DTYPES:
        raise ValueError(f"dtype={dtype!r} must be one of {', '.join(d.name for d in CACHE_DTYPES)}")
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)


def _check_write_shapes(k_cache, v_cache, k, v, slot_mapping) -> None:
    """Static (trace-time) checks of `write_kv_cache`'s arguments."""
    if k_cache.ndim != 4 or v_cache.ndim != 4:
        raise ValueError(
            f"k_cache {k_cache.shape} and v_cache {v_cache.shape} must be "
            "[num_blocks, block_size, num_kv_heads, head_dim]"
        )
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(
            f"k_cache {k_cache.shape} and v_cache {v_cache.shape} must agree on [num_blocks, block_size, num_kv_heads]"
        )
    num_tokens = slot_mapping.shape[0] if slot_mapping.ndim == 1 else None
    if slot_mapping.ndim != 1 or not jnp.issubdtype(slot_mapping.dtype, jnp.integer):
        raise ValueError(f"slot_mapping {slot_mapping.shape} {slot_mapping.dtype} must be integer [num_tokens]")
    if k.shape != (num_tokens, *k_cache.shape[2:]):
        raise ValueError(
            f"k {k.shape} must be [num_tokens, num_kv_heads, head_dim] = {(num_tokens, *k_cache.shape[2:])} "
            f"(slot_mapping {slot_mapping.shape}, k_cache {k_cache.shape})"
        )
    if v.shape != (num_tokens, *v_cache.shape[2:]):
        raise ValueError(
            f"v {v.shape} must be [num_tokens, num_kv_heads, head_dim] = {(num_tokens, *v_cache.shape[2:])} "
            f"(slot_mapping {slot_mapping.shape}, v_cache {v_cache.shape})"
        )


def _scatter_rows(cache, rows, slot_mapping):
    """`cache` with row `slot_mapping[t]` of its `[num_blocks * block_size, ...]` view set to `rows[t]`."""
    num_blocks, block_size = cache.shape[:2]
    num_slots = num_blocks * block_size
    flat = cache.reshape(num_slots, *cache.shape[2:])
    # A negative index would wrap around; send every slot outside the pool past the end, where mode="drop" skips it.
    slots = slot_mapping.astype(jnp.int32)
    slots = jnp.where((slots >= 0) & (slots < num_slots), slots, num_slots)
    flat = flat.at[slots].set(rows.astype(cache.dtype), mode="drop")
    return flat.reshape(cache.shape)


@functools.partial(jax.jit, donate_argnums=(0, 1))
def _write_kv_cache_jit(k_cache, v_cache, k, v, slot_mapping, k_scale, v_scale):
    _check_write_shapes(k_cache, v_cache, k, v, slot_mapping)
    if jnp.dtype(k_cache.dtype) in FP8_DTYPES:
        k, v = _quantize(k, k_scale, k_cache.dtype), _quantize(v, v_scale, v_cache.dtype)
    return _scatter_rows(k_cache, k, slot_mapping), _scatter_rows(v_cache, v, slot_mapping)


@functools.partial(jax.jit, donate_argnums=(0, 1, 5, 6))
def _write_kv_cache_per_token_jit(k_cache, v_cache, k, v, slot_mapping, k_scales, v_scales):
    """Per-(token, head) scales: each new row's scale from its own largest magnitude
    (``reference.kv_scales_per_token_head``), written beside it."""
    _check_write_shapes(k_cache, v_cache, k, v, slot_mapping)
    out = []
    for cache, scales, x in ((k_cache, k_scales, k), (v_cache, v_scales, v)):
        row_scales = _per_token_head_scales(x, cache.dtype)  # [T, Hkv]
        stored = _quantize(x, row_scales[..., None], cache.dtype)
        out += [_scatter_rows(cache, stored, slot_mapping), _scatter_rows(scales, row_scales, slot_mapping)]
    return out[0], out[2], out[1], out[3]


def _per_token_head_scales(x, dtype):
    """``f32[T, Hkv]``: ``reference.kv_scales_per_token_head``, the definition."""
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1)
    # A product by the float32 reciprocal, not a division: XLA:GPU's float32 division may be one ulp off
    # (openxla/xla#37181), and the scale a row is written with must not depend on the backend.
    return jnp.maximum(amax * (np.float32(1.0) / np.float32(jnp.finfo(dtype).max)), SCALE_FLOOR)


def _check_scales(k_cache, v_cache, k_scale, v_scale):
    """The scales an FP8 pair of caches needs (both, finite and positive scalars or both scale caches), refused
    with any other dtype; and the mode (``validation.check_kv_scales``)."""
    k_scale = validation.check_kv_scale("k_scale", k_scale)
    v_scale = validation.check_kv_scale("v_scale", v_scale)
    mode = validation.check_kv_scales(k_cache, v_cache, k_scale, v_scale)
    return k_scale, v_scale, mode


def allocate_kv_scales(num_blocks: int, block_size: int, num_kv_heads: int) -> tuple[jax.Array, jax.Array]:
    """Scale caches `(k_scales, v_scales)`, each `f32[num_blocks, block_size, num_kv_heads]` of ones: an FP8 cache
    with one scale per token and head (vLLM's `per_token_head` mode). Pass them as `write_kv_cache(...,
    k_scale=k_scales, v_scale=v_scales)`, which fills in each written slot's scales, and to the paged kernels.

    Example:
      >>> k_scales, v_scales = allocate_kv_scales(8, 16, 2)
      >>> k_scales.shape
      (8, 16, 2)
    """
    for name, value in (("num_blocks", num_blocks), ("block_size", block_size), ("num_kv_heads", num_kv_heads)):
        validation.check_static_int(name, value)
    shape = (num_blocks, block_size, num_kv_heads)
    return jnp.ones(shape, jnp.float32), jnp.ones(shape, jnp.float32)


def write_kv_cache(k_cache, v_cache, k, v, slot_mapping, *, k_scale=None, v_scale=None) -> tuple[jax.Array, ...]:
    """Writes the new tokens' keys and values into the paged caches; returns the new `(k_cache, v_cache)` (and the
    new scale caches with per-(token, head) scales).

    Args:
      k_cache: dtype[num_blocks, block_size, num_kv_heads, head_dim]. DONATED: do not use it after the call.
      v_cache: dtype[num_blocks, block_size, num_kv_heads, head_dim_v]. DONATED.
      k: [num_tokens, num_kv_heads, head_dim] keys of the packed new tokens (cast to the cache dtype).
      v: [num_tokens, num_kv_heads, head_dim_v] values.
      slot_mapping: i32[num_tokens] cache slot of each row (`BatchMetadata.slot_mapping`); -1 (and any slot
        outside the pool) skips the row.
      k_scale, v_scale: with an FP8 cache only (required there): float32 scalars (per tensor), the cache then
        stores `value / scale` saturated to the format's finite range (`pallas_attn.reference.quantize_kv`); or
        scale caches `f32[num_blocks, block_size, num_kv_heads]` (:func:`allocate_kv_scales`, per token and head;
        DONATED), each written row then gets its own scale, its largest magnitude over the format's largest
        finite value (`pallas_attn.reference.kv_scales_per_token_head`), and the call returns
        `(k_cache, v_cache, k_scale, v_scale)`.

    The caches are donated, so on GPU (and CPU) the write is in place: only the written rows move. Inside an
    outer `jax.jit` donation is up to that outer function. Works under `jax.jit` either way.

    Example:
      >>> k_cache, v_cache = allocate_kv_cache(2, 4, 1, 8, jnp.float32)
      >>> k = v = jnp.ones((3, 1, 8))
      >>> k_cache, v_cache = write_kv_cache(k_cache, v_cache, k, v, jnp.array([5, -1, 0], jnp.int32))
      >>> k_cache[:, :, 0, 0].tolist()
      [[1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]]
    """
    with warnings.catch_warnings():
        # Backends that cannot donate (or an unusual aliasing) only cost a copy; do not warn on every compile.
        warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
        k_scale, v_scale, mode = _check_scales(k_cache, v_cache, k_scale, v_scale)
        if mode == "token":
            return _write_kv_cache_per_token_jit(k_cache, v_cache, k, v, slot_mapping, k_scale, v_scale)
        return _write_kv_cache_jit(k_cache, v_cache, k, v, slot_mapping, k_scale, v_scale)


def gather_kv(cache, block_table_row, length: int) -> jax.Array:
    """The logical view `[length, ...]` of one request: position `p` read from slot formula's page and offset.

    Args:
      cache: [num_blocks, block_size, num_kv_heads, head_dim] (or the latent `[num_blocks, block_size, head_dim]`).
      block_table_row: i32[max_blocks] one request's row of `block_tables`.
      length: static int, positions to read (usually the request's seq_len).

    Returns:
      `cache.dtype[length, *cache.shape[2:]]`. For notebooks and tests; the kernels never materialise this.
      When `block_table_row` is concrete, its first `cdiv(length, block_size)` entries are checked to be page ids.
    """
    if not isinstance(block_table_row, jax.Array):
        block_table_row = np.asarray(block_table_row)
    num_blocks, block_size = cache.shape[:2]
    if isinstance(length, bool) or not isinstance(length, (int, np.integer)) or length < 0:
        raise ValueError(f"{length=} must be a non-negative int (static)")
    if block_table_row.ndim != 1:
        raise ValueError(f"block_table_row {block_table_row.shape} must be 1-D [max_blocks]")
    pages_needed = -(-int(length) // block_size)
    if pages_needed > block_table_row.shape[0]:
        raise ValueError(
            f"{length=} needs {pages_needed} pages of {block_size=}, block_table_row has {block_table_row.shape[0]}"
        )
    if not isinstance(block_table_row, jax.core.Tracer):
        owned = np.asarray(block_table_row[:pages_needed])
        if ((owned < 0) | (owned >= num_blocks)).any():
            raise ValueError(
                f"block_table_row[:{pages_needed}]={owned.tolist()} must be page ids in [0, {num_blocks=})"
            )
    pos = jnp.arange(length)
    pages = jnp.asarray(block_table_row)[pos // block_size]
    return jnp.asarray(cache)[pages, pos % block_size]
