"""Request layer: one description of a packed batch, shared by every kernel.

The request layer: each request owns a `request_id` (its row `i`), a `seq_len`, a `query_start_loc`
(`cu_query_lens[i]`) and a `block_table` (row `i` of `block_tables`). The new tokens of all requests are packed
along the token axis: query rows `cu_query_lens[i] : cu_query_lens[i + 1]` belong to request `i`; rows at or past
`cu_query_lens[-1]` are padding.

Two kinds of "context length" exist in this field; this module names them apart:

* `context_lens` (here, and `build_metadata`'s argument) = tokens already in the cache BEFORE this step
  (vLLM's `num_computed_tokens`). The new tokens of request `i` sit at positions
  `context_lens[i] .. seq_lens[i] - 1`.
* `seq_lens` = every key a request's queries may see, the new tokens included (`context_lens + query_lens`).
  The `context_lens` ARGUMENT of the kernel `paged_decode_attention` means this quantity (decode convention:
  the new token is already written), so pass `BatchMetadata.seq_lens` there, not `.context_lens`.

Paged cache (docs/design.md#paged-kv-layout): `logical_block = pos // block_size`,
`physical_block = block_tables[i, logical_block]`, `slot = physical_block * block_size + pos % block_size`.
`slot_mapping[t]` is that slot for the token in query row `t`, or -1 for a padding row.

Static fields (`block_size`, `max_query_len`, `max_seq_len`, `num_tokens`) are pytree aux data: they are Python
ints under `jax.jit`, and changing one recompiles. `build_metadata` rounds them (and `max_blocks`) up to powers of
two so that every batch of one bucket shares a compiled program.

Everything here is host-side numpy; the arrays become device arrays when passed to a jitted function.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_attn.core import validation

NUM_TOKENS_MIN_BUCKET = 16  # smallest num_tokens bucket: tiny batches share one program
PAD_SLOT = -1  # slot_mapping entry of a padding row: the cache write skips it
PAD_PAGE = -1  # block_tables entry past a request's last page: never read
INT32_MAX = np.iinfo(np.int32).max


@dataclasses.dataclass(frozen=True)
class BatchMetadata:
    """A packed batch of `num_seqs` requests; a pytree whose static fields are aux data.

    Array fields (int32; numpy from `build_metadata`, device arrays once inside `jax.jit`):
      cu_query_lens:  i32[num_seqs + 1]  query rows of request i are `cu_query_lens[i] : cu_query_lens[i + 1]`.
      seq_lens:       i32[num_seqs]      keys request i's queries may see, its new tokens included.
      context_lens:   i32[num_seqs]      tokens cached before this step (`seq_lens - query_lens`).
      block_tables:   i32[num_seqs, max_blocks]  physical page of each logical page of request i.
      slot_mapping:   i32[num_tokens]    cache slot of the new token in each query row; -1 for padding rows.

    Static fields (Python ints; changing one recompiles):
      block_size:     tokens per page: a power of two up to 16 or a multiple of 16 up to 1024.
      max_query_len:  upper bound of every query length (bucketed: a power of two).
      max_seq_len:    upper bound of every seq_len (bucketed), at most `max_blocks * block_size`.
      num_tokens:     query rows, padding included (bucketed); `q.shape[0]` of the kernels.

    Validity rules (checked by `validate`, guaranteed by `build_metadata`):
      * `cu_query_lens[0] == 0`, non-decreasing, `cu_query_lens[-1] <= num_tokens`.
      * `0 <= query_lens[i] <= max_query_len` and `query_lens[i] <= seq_lens[i] <= max_seq_len`, where
        `query_lens = diff(cu_query_lens)`; `context_lens == seq_lens - query_lens`.
      * `block_tables[i, :cdiv(seq_lens[i], block_size)]` are valid page ids (>= 0); later entries are padding
        (-1 from the builder, but a kernel must accept any int32 there and never read it).
      * `slot_mapping[t]` follows the slot formula for real rows and is -1 for rows `>= cu_query_lens[-1]`.
      * Empty requests (query_len 0, seq_len 0) are allowed: they pad `num_seqs` to a bucket.
    """

    cu_query_lens: Any  # i32[num_seqs + 1]
    seq_lens: Any  # i32[num_seqs]
    context_lens: Any  # i32[num_seqs]
    block_tables: Any  # i32[num_seqs, max_blocks]
    slot_mapping: Any  # i32[num_tokens]
    block_size: int = dataclasses.field(metadata=dict(static=True))
    max_query_len: int = dataclasses.field(metadata=dict(static=True))
    max_seq_len: int = dataclasses.field(metadata=dict(static=True))
    num_tokens: int = dataclasses.field(metadata=dict(static=True))

    @property
    def num_seqs(self) -> int:
        """Requests in the batch, empty padding requests included."""
        return self.seq_lens.shape[0]

    @property
    def max_blocks(self) -> int:
        """Width of `block_tables`."""
        return self.block_tables.shape[1]

    @property
    def query_lens(self):
        """i32[num_seqs]: new tokens of each request (`diff(cu_query_lens)`)."""
        return self.cu_query_lens[1:] - self.cu_query_lens[:-1]

    def validate(self) -> None:
        """Checks the validity rules on concrete (host or device) values; raises ValueError. Not for the hot path."""
        _validate_metadata(self)


_DATA_FIELDS = ("cu_query_lens", "seq_lens", "context_lens", "block_tables", "slot_mapping")
_META_FIELDS = ("block_size", "max_query_len", "max_seq_len", "num_tokens")
jax.tree_util.register_dataclass(BatchMetadata, data_fields=list(_DATA_FIELDS), meta_fields=list(_META_FIELDS))


# ----------------------------------------------------------------------------------------------- small helpers


def bucket(n: int, minimum: int = 1) -> int:
    """The smallest power of two `>= max(n, minimum)` (`minimum` is rounded up to a power of two too)."""
    n = max(int(n), int(minimum), 1)
    return 1 << (n - 1).bit_length()


_bucket = bucket  # `build_metadata` has an argument named `bucket` that shadows this helper


def cdiv(a, b):
    """Ceiling division; works on ints and integer numpy arrays."""
    return -(-a // b)


def cu_seqlens_from_lens(lens) -> np.ndarray:
    """i32[len(lens) + 1] exclusive prefix sums `[0, l0, l0 + l1, ...]` of a 1-D sequence of lengths."""
    lens = _as_lengths(lens, "lens")
    cu = np.zeros(lens.shape[0] + 1, np.int64)
    np.cumsum(lens, out=cu[1:])
    _check_fits_int32(int(cu[-1]), "sum(lens)")
    return cu.astype(np.int32)


def _as_lengths(x, name: str) -> np.ndarray:
    """A 1-D, non-negative int64 numpy array, or a ValueError naming `name`."""
    arr = np.asarray(x)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, np.int64)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"{name} must hold integers, got dtype {arr.dtype}")
    arr = arr.astype(np.int64)
    if (arr < 0).any():
        bad = int(np.flatnonzero(arr < 0)[0])
        raise ValueError(f"{name} must be non-negative, got {name}[{bad}]={int(arr[bad])}")
    return arr


def _check_fits_int32(value: int, what: str) -> None:
    if value > INT32_MAX:
        raise ValueError(f"{what}={value} does not fit in int32 (max {INT32_MAX})")


def _check_block_size(block_size) -> int:
    """An int the paged kernels accept (:func:`pallas_attn.core.validation.check_block_size`), as a Python int."""
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)):
        raise ValueError(f"{block_size=} must be an int: {validation.BLOCK_SIZE_RULE}")
    validation.check_block_size(int(block_size))
    return int(block_size)


def _optional_int(value, name: str):
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name}={value!r} must be an int or None")
    if value < 0:
        raise ValueError(f"{name}={value} must be non-negative")
    return int(value)


# ------------------------------------------------------------------------------------------------------ builder


def build_metadata(
    query_lens: Sequence[int] | np.ndarray,
    context_lens: Sequence[int] | np.ndarray,
    block_size: int,
    *,
    num_blocks: int | None = None,
    max_blocks: int | None = None,
    num_seqs: int | None = None,
    num_tokens: int | None = None,
    bucket: bool = True,
    shuffle_pages: bool = True,
    seed: int = 0,
    block_tables: np.ndarray | None = None,
) -> BatchMetadata:
    """Builds a `BatchMetadata` on the host (numpy only) and allocates pages for every request.

    Args:
      query_lens: int[n] new tokens of each request this step (prefill chunk, 1 for decode, k for verification).
      context_lens: int[n] tokens already cached BEFORE this step (vLLM's `num_computed_tokens`; NOT the
        `context_lens` argument of `paged_decode_attention`, which counts the new token too: pass `seq_lens`).
      block_size: tokens per page: a power of two up to 16 or a multiple of 16 up to 1024 (48, 544, ...).
      num_blocks: pages in the pool. Default: exactly the pages the batch needs. With `block_tables`, bounds the
        page ids the tables may use.
      max_blocks: width of `block_tables`. Default: the pages of the longest request, bucketed.
      num_seqs: pad the batch to this many requests with empty ones (query_len 0, seq_len 0). Default: `n`.
        Pass `bucket(n)` to share one program across batch sizes.
      num_tokens: query rows, padding included. Default: `sum(query_lens)`, bucketed (at least 16).
      bucket: round `max_query_len`, `max_seq_len`, `num_tokens` and `max_blocks` (those not given) up to powers
        of two, so that batches of one bucket compile once.
      shuffle_pages: allocate pages from a seeded permutation of the pool (tests: no identity tables).
      seed: seed of that permutation.
      block_tables: int[n or num_seqs, w] explicit tables instead of the allocator; the first
        `cdiv(seq_len, block_size)` entries of each row must be page ids (in `[0, num_blocks)` if given).

    Returns:
      A `BatchMetadata` of numpy int32 arrays. Page `block_tables[i, j]` holds positions
      `j * block_size .. (j + 1) * block_size - 1` of request i.

    Example:
      >>> md = build_metadata([3, 1], [0, 7], block_size=4, shuffle_pages=False, bucket=False)
      >>> md.cu_query_lens.tolist(), md.seq_lens.tolist(), md.block_tables.tolist()
      ([0, 3, 4], [3, 8], [[0, -1], [1, 2]])
      >>> md.slot_mapping.tolist()  # request 1's new token is position 7: page 2, offset 3
      [0, 1, 2, 11]
    """
    do_bucket, bucket_fn = bucket, _bucket
    query_lens = _as_lengths(query_lens, "query_lens")
    context_lens = _as_lengths(context_lens, "context_lens")
    if query_lens.shape != context_lens.shape:
        raise ValueError(
            f"query_lens and context_lens must have the same length, got {query_lens.shape[0]} and "
            f"{context_lens.shape[0]}"
        )
    block_size = _check_block_size(block_size)
    num_blocks = _optional_int(num_blocks, "num_blocks")
    max_blocks = _optional_int(max_blocks, "max_blocks")
    num_seqs = _optional_int(num_seqs, "num_seqs")
    num_tokens = _optional_int(num_tokens, "num_tokens")

    n_real = query_lens.shape[0]
    if num_seqs is None:
        num_seqs = n_real
    elif num_seqs < n_real:
        raise ValueError(f"{num_seqs=} is smaller than the {n_real} requests given (len(query_lens))")

    # Empty padding requests: query_len 0, seq_len 0, no pages.
    pad = num_seqs - n_real
    query_lens = np.concatenate([query_lens, np.zeros(pad, np.int64)])
    context_lens = np.concatenate([context_lens, np.zeros(pad, np.int64)])
    seq_lens = context_lens + query_lens
    pages_needed = cdiv(seq_lens, block_size)  # int64[num_seqs]
    max_pages = int(pages_needed.max(initial=0))
    total_pages = int(pages_needed.sum())
    total_tokens = int(query_lens.sum())
    _check_fits_int32(int(seq_lens.max(initial=0)), "max(context_lens + query_lens)")

    # Static maxima.
    if num_tokens is None:
        num_tokens = bucket_fn(total_tokens, NUM_TOKENS_MIN_BUCKET) if do_bucket else total_tokens
    elif num_tokens < total_tokens:
        raise ValueError(f"{num_tokens=} is smaller than sum(query_lens)={total_tokens}")
    _check_fits_int32(num_tokens, "num_tokens")
    max_query_len = int(query_lens.max(initial=0))
    if do_bucket:
        max_query_len = bucket_fn(max_query_len)

    # Page tables: from the caller, or from a (shuffled) pool.
    if block_tables is not None:
        tables = _check_explicit_tables(block_tables, pages_needed, n_real, num_blocks, block_size, seq_lens)
        width_needed = tables.shape[1]
    else:
        width_needed = max_pages
    if max_blocks is None:
        max_blocks = bucket_fn(width_needed) if do_bucket else max(width_needed, 1)
    elif max_blocks < width_needed:
        what = "the width of block_tables" if block_tables is not None else "the pages of the longest request"
        raise ValueError(f"{max_blocks=} is smaller than {what} ({width_needed}; block_size={block_size})")

    if block_tables is None:
        if num_blocks is None:
            num_blocks = total_pages
        elif num_blocks < total_pages:
            raise ValueError(
                f"{num_blocks=} pages cannot hold this batch: it needs {total_pages} "
                f"(sum of cdiv(context_lens + query_lens, {block_size=}))"
            )
        _check_fits_int32(num_blocks * block_size, "num_blocks * block_size")
        pool = np.random.default_rng(seed).permutation(num_blocks) if shuffle_pages else np.arange(num_blocks)
        tables = np.full((num_seqs, max_blocks), PAD_PAGE, np.int64)
        starts = np.concatenate([[0], np.cumsum(pages_needed)])
        for i in range(num_seqs):
            tables[i, : pages_needed[i]] = pool[starts[i] : starts[i + 1]]
    else:
        tables = np.concatenate(
            [tables, np.full((num_seqs, max_blocks - tables.shape[1]), PAD_PAGE, np.int64)], axis=1
        )

    max_seq_len = int(seq_lens.max(initial=0))
    if do_bucket:
        # An upper bound a kernel may loop to: never past the table (max_blocks pages).
        max_seq_len = min(bucket_fn(max_seq_len, block_size), max_blocks * block_size)

    # Slot of every new token: positions context_len .. seq_len - 1 of each request, in query-row order.
    slot_mapping = np.full(num_tokens, PAD_SLOT, np.int64)
    req = np.repeat(np.arange(num_seqs), query_lens)  # int64[total_tokens]: request of each real row
    cu_query_lens = cu_seqlens_from_lens(query_lens)
    pos = context_lens[req] + (np.arange(total_tokens) - cu_query_lens[:-1][req])
    slot_mapping[:total_tokens] = tables[req, pos // block_size] * block_size + pos % block_size

    return BatchMetadata(
        cu_query_lens=cu_query_lens,
        seq_lens=seq_lens.astype(np.int32),
        context_lens=context_lens.astype(np.int32),
        block_tables=tables.astype(np.int32),
        slot_mapping=slot_mapping.astype(np.int32),
        block_size=block_size,
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        num_tokens=num_tokens,
    )


def _check_explicit_tables(block_tables, pages_needed, n_real, num_blocks, block_size, seq_lens) -> np.ndarray:
    """int64[num_seqs, w]: the caller's tables, checked and padded with -1 rows for empty padding requests."""
    tables = np.asarray(block_tables)
    num_seqs = pages_needed.shape[0]
    if tables.ndim != 2:
        raise ValueError(f"block_tables must be 2-D [num_seqs, max_blocks], got shape {tables.shape}")
    if tables.size and tables.dtype.kind not in "iu":
        raise ValueError(f"block_tables must hold integers, got dtype {tables.dtype}")
    if tables.shape[0] not in (n_real, num_seqs):
        raise ValueError(
            f"block_tables has {tables.shape[0]} rows, needs one per request ({n_real}) or per padded "
            f"request ({num_seqs=})"
        )
    tables = tables.astype(np.int64)
    if tables.shape[0] < num_seqs:
        tables = np.concatenate([tables, np.full((num_seqs - tables.shape[0], tables.shape[1]), PAD_PAGE)])
    for i in range(num_seqs):
        need = int(pages_needed[i])
        if need > tables.shape[1]:
            raise ValueError(
                f"block_tables has {tables.shape[1]} columns, too short for request {i}: "
                f"seq_len={int(seq_lens[i])} needs {need} pages of {block_size=}"
            )
        owned = tables[i, :need]
        if (owned < 0).any() or (num_blocks is not None and (owned >= num_blocks).any()):
            bound = f"[0, {num_blocks=})" if num_blocks is not None else ">= 0"
            raise ValueError(f"block_tables[{i}, :{need}]={owned.tolist()} must be page ids {bound}")
    if num_blocks is not None:
        _check_fits_int32(num_blocks * block_size, "num_blocks * block_size")
    elif tables.size:
        _check_fits_int32((int(tables.max()) + 1) * block_size, "(max page id + 1) * block_size")
    return tables


# ----------------------------------------------------------------------------------------- dynamic validation


def _validate_metadata(md: BatchMetadata) -> None:
    cu = np.asarray(md.cu_query_lens).astype(np.int64)
    seq_lens = np.asarray(md.seq_lens).astype(np.int64)
    context_lens = np.asarray(md.context_lens).astype(np.int64)
    tables = np.asarray(md.block_tables).astype(np.int64)
    slots = np.asarray(md.slot_mapping).astype(np.int64)
    num_seqs, bs = seq_lens.shape[0], md.block_size
    _check_block_size(bs)
    if cu.shape != (num_seqs + 1,) or context_lens.shape != (num_seqs,) or tables.ndim != 2 or (
        tables.shape[0] != num_seqs
    ):
        raise ValueError(
            f"inconsistent shapes: cu_query_lens {cu.shape}, seq_lens {seq_lens.shape}, "
            f"context_lens {context_lens.shape}, block_tables {tables.shape}"
        )
    if slots.shape != (md.num_tokens,):
        raise ValueError(f"slot_mapping has shape {slots.shape}, needs ({md.num_tokens},) (num_tokens)")
    q = np.diff(cu)
    if cu[0] != 0 or (q < 0).any() or cu[-1] > md.num_tokens:
        raise ValueError(f"cu_query_lens={cu.tolist()} must start at 0, not decrease, end <= {md.num_tokens=}")
    if (q > md.max_query_len).any():
        raise ValueError(f"query_lens={q.tolist()} exceed {md.max_query_len=}")
    if (seq_lens < q).any() or (seq_lens > md.max_seq_len).any():
        raise ValueError(f"seq_lens={seq_lens.tolist()} must lie in [query_lens, {md.max_seq_len=}]")
    if (context_lens != seq_lens - q).any():
        raise ValueError(f"context_lens={context_lens.tolist()} must equal seq_lens - query_lens")
    if md.max_seq_len > tables.shape[1] * bs:
        raise ValueError(f"{md.max_seq_len=} exceeds max_blocks * block_size = {tables.shape[1] * bs}")
    expected = np.full_like(slots, PAD_SLOT)
    for i in range(num_seqs):
        need = int(cdiv(seq_lens[i], bs))
        if (tables[i, :need] < 0).any():
            raise ValueError(f"block_tables[{i}, :{need}]={tables[i, :need].tolist()} must be page ids >= 0")
        pos = np.arange(context_lens[i], seq_lens[i])
        expected[cu[i] : cu[i + 1]] = tables[i, pos // bs] * bs + pos % bs
    if (slots != expected).any():
        bad = int(np.flatnonzero(slots != expected)[0])
        raise ValueError(f"slot_mapping[{bad}]={int(slots[bad])}, the slot formula gives {int(expected[bad])}")


def clamp_cu(cu, num_tokens: int):
    """Request boundaries ``i32[num_seqs + 1]`` made safe whatever they hold: clamped into ``[0, num_tokens]`` and
    non-decreasing (a running max). On valid boundaries it is the identity; on broken ones the requests keep
    disjoint rows inside the array, so no request can read or write another's
    (docs/design.md#isolation-whatever-the-inputs)."""
    return jnp.minimum(jax.lax.cummax(jnp.maximum(cu, 0)), num_tokens).astype(cu.dtype)


def token_requests(cu_query_lens, num_tokens: int):
    """``i32[num_tokens]``: the request that owns each packed row (``cu_query_lens[b] <= row < cu_query_lens[b+1]``),
    -1 for rows no request owns (before ``cu_query_lens[0]``, at or past ``cu_query_lens[-1]``). Traceable (jnp);
    one fusion, no loop."""
    tok = jnp.arange(num_tokens, dtype=jnp.int32)
    req = jnp.searchsorted(cu_query_lens, tok, side="right", method="compare_all").astype(jnp.int32) - 1
    owned = (tok >= cu_query_lens[0]) & (tok < cu_query_lens[-1])
    return jnp.where(owned, jnp.clip(req, 0, cu_query_lens.shape[0] - 2), -1)


def segment_items(counts, num_items: int):
    """Lay ``counts[b]`` items of each request end to end and map a static ``num_items`` slots onto them.

    Returns ``(owner i32[num_items], index i32[num_items], cu i32[num_seqs + 1])``: slot ``i`` is item
    ``index[i]`` of request ``owner[i]`` (-1 and 0 past the last item), ``cu`` the cumulative counts. The kernels'
    static work lists (query blocks, tiles, staged rows) are this map; traceable, one fusion."""
    cu = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(counts).astype(jnp.int32)])
    owner = token_requests(cu, num_items)
    index = jnp.arange(num_items, dtype=jnp.int32) - cu[jnp.maximum(owner, 0)]
    return owner, jnp.where(owner >= 0, index, 0), cu
