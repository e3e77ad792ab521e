"""Test helpers for attention kernels: tolerance-checked comparison and hostile inputs, for your pytest and ours.

* `assert_attention_close(out, ref, dtype=...)`: relative L2 error `||out - ref|| / ||ref||` (float64) below a
  tolerance looked up by the dtype of the kernel INPUT (`TOLERANCES`); any NaN/Inf in the compared rows fails
  first, with a count and the first indices.
* `make_paged_kv`: paged caches `[num_blocks, block_size, num_kv_heads, head_dim]` with shuffled pages, random
  normal contents where a request owns a slot, and `poison` (NaN) everywhere else: free pages, the tail of each
  request's last page. Block-table entries past a request's last page hold garbage (-1, other requests' pages,
  out-of-range ids). A kernel that reads anything it should not returns NaN.
* `random_packed`: packed `[num_tokens, num_heads, head_dim]` rows with poisoned padding rows, plus `cu_seqlens`.
* `poisoned_like`: a NaN-filled buffer of the same shape and dtype.

Random data comes from a `numpy.random.Generator` you pass (`np.random.default_rng(seed)`), so tests are
reproducible without touching global state.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import chex
import jax
import jax.numpy as jnp
import numpy as np

from pallas_attn.core import validation
from pallas_attn.core.metadata import cu_seqlens_from_lens

# Relative L2 tolerance by the dtype of the kernel's inputs. float32: interpret mode and GPU dots without TF32
# agree with the float32 reference to rounding; half precisions lose ~3 (fp16) or ~8 (bf16) mantissa bits in P·V.
TOLERANCES: dict[np.dtype, float] = {
    np.dtype(jnp.float32): 1e-5,
    np.dtype(jnp.float16): 5e-3,
    np.dtype(jnp.bfloat16): 1e-2,
}
MAX_REPORTED = 5  # indices listed in a failure message
_INT32 = np.iinfo(np.int32)


# ------------------------------------------------------------------------------------------------- comparison


def _rows(x, valid) -> np.ndarray:
    """float64 numpy copy of `x` restricted to its valid leading rows (`valid`: None, a count, or a bool mask)."""
    x = np.asarray(x).astype(np.float64)
    if valid is None:
        return x
    if isinstance(valid, (int, np.integer)) and not isinstance(valid, bool):
        if not 0 <= valid <= x.shape[0]:
            raise ValueError(f"valid={valid} must lie in [0, {x.shape[0]}] (rows of the array)")
        return x[:valid]
    mask = np.asarray(valid)
    if mask.dtype != bool or mask.shape != x.shape[:1]:
        raise ValueError(f"valid must be an int or a bool[{x.shape[0]}] row mask, got {mask.dtype}{list(mask.shape)}")
    return x[mask]


def relative_l2(out, ref, valid=None) -> float:
    """`||out - ref|| / ||ref||` in float64 over the valid rows (`valid`: None = all, an int = the first N rows,
    or a bool row mask). When `ref` is all zeros, the absolute `||out - ref||` (0.0 for two zero arrays)."""
    out, ref = _rows(out, valid), _rows(ref, valid)
    chex.assert_equal_shape([out, ref])
    diff = float(np.linalg.norm((out - ref).ravel()))
    norm = float(np.linalg.norm(ref.ravel()))
    return diff / norm if norm > 0 else diff


def _nonfinite_message(x: np.ndarray, name: str, where: str) -> str | None:
    bad = ~np.isfinite(x)
    if not bad.any():
        return None
    n_nan, n_inf = int(np.isnan(x).sum()), int(np.isinf(x).sum())
    bad_rows = np.flatnonzero(bad.reshape(x.shape[0], -1).any(axis=1))
    first = [tuple(int(i) for i in idx) for idx in np.argwhere(bad)[:MAX_REPORTED]]
    return (
        f"{name} has {int(bad.sum())} non-finite values (NaN: {n_nan}, Inf: {n_inf}) in {bad_rows.size} of "
        f"{where}; rows {bad_rows[:MAX_REPORTED].tolist()}{'...' if bad_rows.size > MAX_REPORTED else ''}, "
        f"first indices {first}"
    )


def assert_attention_close(out, ref, *, dtype=None, rtol: float | None = None, valid_rows: int | None = None):
    """Asserts `relative_l2(out, ref) <= rtol` over the first `valid_rows` rows, and that they are finite.

    Args:
      out: [num_tokens, ...] kernel output (any float dtype).
      ref: same shape, the reference output (float32 is best).
      dtype: dtype of the kernel's INPUTS, which picks the tolerance from `TOLERANCES`
        (float32 1e-5, float16 5e-3, bfloat16 1e-2). Default: `out.dtype`.
      rtol: explicit relative L2 tolerance; overrides the table.
      valid_rows: compare only rows `[0, valid_rows)`; later rows are padding, whose output is unspecified.

    Raises:
      AssertionError: shapes differ, a compared value of `out` or `ref` is NaN/Inf, or the error is too large.
      TypeError: `out` or `ref` is a tuple, e.g. `(out, lse)` from `return_lse=True`: pass the outputs and compare
        the LSEs separately.
      ValueError: no tolerance is known for `dtype` and no `rtol` was given.

    Example:
      >>> ref = np.ones((4, 2, 8), np.float32)
      >>> assert_attention_close(ref + 1e-7, ref)
    """
    for name, x in (("out", out), ("ref", ref)):
        validation.check_single_array(name, x, f"pass {name}[0] (the output of return_lse=True) and compare the LSE "
                                               f"separately (its -inf rows must match exactly)")
    chex.assert_equal_shape([out, ref])
    key = np.dtype(dtype if dtype is not None else np.asarray(out).dtype)
    if rtol is None:
        if key not in TOLERANCES:
            raise ValueError(f"no tolerance for dtype={key}: pass rtol=, or one of {[str(d) for d in TOLERANCES]}")
        rtol = TOLERANCES[key]
    out_rows, ref_rows = _rows(out, valid_rows), _rows(ref, valid_rows)
    where = f"{out_rows.shape[0]} compared rows" + (f" (valid_rows={valid_rows})" if valid_rows is not None else "")
    for x, name in ((out_rows, "out"), (ref_rows, "ref")):
        message = _nonfinite_message(x, name, where)
        if message:
            raise AssertionError(message)
    err = relative_l2(out_rows, ref_rows)
    if not err <= rtol:
        diff = np.abs(out_rows - ref_rows)
        worst = tuple(int(i) for i in np.unravel_index(np.argmax(diff), diff.shape)) if diff.size else ()
        raise AssertionError(
            f"relative L2 error {err:.3e} > rtol={rtol:.1e} (input dtype {key}) over {where}; "
            f"max |out - ref| = {diff.max(initial=0.0):.3e} at {worst}"
        )


# ----------------------------------------------------------------------------------------------- hostile inputs


def _lengths(lens, name: str) -> np.ndarray:
    arr = np.asarray(lens)
    if arr.ndim != 1 or (arr.size and (arr.dtype.kind not in "iu" or (arr < 0).any())):
        raise ValueError(f"{name} must be a 1-D sequence of non-negative ints, got {arr.tolist()}")
    return arr.astype(np.int64)


def make_paged_kv(
    rng: np.random.Generator,
    seq_lens: Sequence[int] | np.ndarray,
    block_size: int,
    num_kv_heads: int | None,
    head_dim: int,
    dtype,
    *,
    extra_blocks: int = 3,
    poison: float = float("nan"),
    table_padding: str = "garbage",
    max_blocks: int | None = None,
) -> tuple[jax.Array, jax.Array | None, jax.Array]:
    """Paged caches holding `seq_lens[i]` random tokens per request, poison everywhere else.

    Args:
      rng: numpy Generator (pages, contents and table garbage all come from it).
      seq_lens: int[num_seqs] tokens of each request in the cache.
      block_size: tokens per page.
      num_kv_heads: KV heads; None builds the MLA latent cache `[num_blocks, block_size, head_dim]`.
      head_dim: last axis.
      dtype: cache dtype (values are drawn in float32, then cast).
      extra_blocks: free pages in the pool beyond those the requests own (poisoned).
      poison: value of every slot no request owns (cast to `dtype`: 1e30 stays finite in bf16, is Inf in fp16).
      table_padding: entries past each request's last page: 'garbage' (a mix of -1, other pages, ids past the
        pool and negative ids) or 'neg' (-1 only).
      max_blocks: table width; default the longest request's pages + 1, so every row has padding.

    Returns:
      `(k_cache, v_cache, block_tables)`: caches `dtype[num_blocks, block_size, num_kv_heads, head_dim]`
      (`v_cache` is None for the latent cache: MLA reads its values from the same cache), `block_tables
      i32[num_seqs, max_blocks]`, pages a random permutation of the pool. Position `p` of request `i` lives at
      page `block_tables[i, p // block_size]`, row `p % block_size`.
    """
    seq_lens = _lengths(seq_lens, "seq_lens")
    if table_padding not in ("garbage", "neg"):
        raise ValueError(f"{table_padding=} must be 'garbage' or 'neg'")
    if extra_blocks < 0:
        raise ValueError(f"{extra_blocks=} must be non-negative")
    pages = -(-seq_lens // block_size)  # int64[num_seqs]
    num_blocks = int(pages.sum()) + extra_blocks
    if num_blocks == 0:
        raise ValueError(f"{seq_lens=} own no pages and {extra_blocks=}: the cache would be empty")
    needed_width = int(pages.max(initial=0))
    if max_blocks is None:
        max_blocks = needed_width + 1
    elif max_blocks < needed_width:
        raise ValueError(f"{max_blocks=} is smaller than the pages of the longest request ({needed_width})")

    num_seqs = seq_lens.shape[0]
    pool = rng.permutation(num_blocks)
    tables = np.full((num_seqs, max_blocks), -1, np.int64)
    owned = np.zeros((num_blocks, block_size), bool)  # slots some request owns
    start = 0
    for i in range(num_seqs):
        tables[i, : pages[i]] = pool[start : start + pages[i]]
        start += pages[i]
        pos = np.arange(seq_lens[i])
        owned[tables[i, pos // block_size], pos % block_size] = True
    if table_padding == "garbage":
        padding = np.arange(max_blocks)[None, :] >= pages[:, None]  # bool[num_seqs, max_blocks]
        n = int(padding.sum())
        kind = rng.integers(0, 4, n)
        choices = np.stack([
            np.full(n, -1),  # the usual sentinel
            rng.integers(0, num_blocks, n),  # a real page, often another request's
            rng.integers(num_blocks, _INT32.max, n, endpoint=True),  # past the pool
            rng.integers(_INT32.min, -1, n),  # negative, not -1
        ])
        tables[padding] = choices[kind, np.arange(n)]

    head_shape = (head_dim,) if num_kv_heads is None else (num_kv_heads, head_dim)
    caches = []
    for _ in range(1 if num_kv_heads is None else 2):
        cache = np.full((num_blocks, block_size, *head_shape), poison, np.float32)
        cache[owned] = rng.standard_normal((int(owned.sum()), *head_shape), np.float32)
        with np.errstate(over="ignore"):  # a huge poison becoming Inf in fp16 is documented, not a surprise
            caches.append(jnp.asarray(cache, dtype))
    k_cache, v_cache = caches if len(caches) == 2 else (caches[0], None)
    return k_cache, v_cache, jnp.asarray(tables, jnp.int32)


def random_packed(
    rng: np.random.Generator,
    lens: Sequence[int] | np.ndarray,
    num_heads: int,
    head_dim: int,
    dtype,
    pad_to: int | None = None,
    poison: float = float("nan"),
) -> tuple[jax.Array, jax.Array]:
    """Packed rows `x dtype[num_tokens, num_heads, head_dim]` and `cu_seqlens i32[len(lens) + 1]`.

    Rows `cu_seqlens[i] : cu_seqlens[i + 1]` are request i's (random normal); `num_tokens = pad_to` (default
    `sum(lens)`), and rows past `sum(lens)` are padding filled with `poison`.
    """
    lens = _lengths(lens, "lens")
    total = int(lens.sum())
    num_tokens = total if pad_to is None else int(pad_to)
    if num_tokens < total:
        raise ValueError(f"{pad_to=} is smaller than sum(lens)={total}")
    x = np.full((num_tokens, num_heads, head_dim), poison, np.float32)
    x[:total] = rng.standard_normal((total, num_heads, head_dim), np.float32)
    return jnp.asarray(x, dtype), jnp.asarray(cu_seqlens_from_lens(lens))


def poisoned_like(x) -> jax.Array:
    """A NaN-filled array of `x`'s shape and (floating) dtype: an output buffer nobody should read unwritten."""
    dtype = np.dtype(x.dtype)
    if not jnp.issubdtype(dtype, jnp.inexact):
        raise ValueError(f"poisoned_like needs a floating dtype (NaN), got {dtype}")
    return jnp.full(x.shape, math.nan, dtype)
