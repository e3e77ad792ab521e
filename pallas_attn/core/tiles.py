"""Tile memory access shared by the kernels: rows addressed by index vectors (docs/design.md#the-grid).

Every kernel sees its arrays flattened to 2-D ``[rows, head_dim]`` (a free reshape in the wrapper) and addresses a
tile as a vector of row indices — packed tokens ``(seq_start + pos) * num_heads + head``, or paged slots
``(block_table[pos // block_size] * block_size + pos % block_size) * num_kv_heads + kv_head``. In Triton this is
plain pointer arithmetic (each row is ``head_dim`` contiguous elements, so loads stay coalesced); in interpret mode
it is a gather. Head dims that are not a power of two are padded inside the kernel: the block is
``[rows, next_pow2(D)]`` and the extra columns are masked off on load and store.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_attn.core import masks, softmax
from pallas_attn.core.backend import pallas_triton as plgpu  # None without the backend: the ops say so

MIN_DOT_ROWS = 16  # tensor-core dots want M >= 16: GQA groups / short query blocks are padded up to this many rows


class Cols:
    """The ``[padded]`` column vector of a tile and its mask (None when ``width`` is already a power of two).

    ``offset`` selects a column slice ``[offset, offset + width)`` (MLA: the rope dims, a value slice)."""

    def __init__(self, width: int, padded: int, offset=0):
        arange = jnp.arange(padded)
        self.idx = arange if isinstance(offset, int) and offset == 0 else offset + arange
        self.mask = None if padded == width else (arange < width)[None, :]

    def with_rows(self, row_mask):
        """``[R, padded]`` load/store mask from a ``[R]`` row mask (either may be None)."""
        if row_mask is None:
            return self.mask
        if self.mask is None:
            return row_mask[:, None]
        return row_mask[:, None] & self.mask


def load_rows(ref, rows, cols: Cols, row_mask=None):
    """``ref[rows, :padded]`` → ``[R, padded]``; masked rows and padded columns read as 0 (never touched)."""
    mask = cols.with_rows(row_mask)
    view = ref.at[rows[:, None], cols.idx[None, :]]
    if mask is None:
        return plgpu.load(view)
    return plgpu.load(view, mask=mask, other=0)


def store_rows(ref, rows, cols: Cols, value, row_mask=None):
    """``ref[rows, :D] = value[:, :D]`` for rows where ``row_mask``.

    ``rows`` must be distinct, masked ones included: interpret mode stores by scatter, where a masked duplicate
    could write the old value back over a valid row."""
    plgpu.store(ref.at[rows[:, None], cols.idx[None, :]], value.astype(ref.dtype), mask=cols.with_rows(row_mask))


def load_vector(ref, rows, row_mask=None):
    """``ref[rows]`` of a 1-D ref (LSE); masked rows read as 0."""
    return plgpu.load(ref.at[rows], mask=row_mask, other=0 if row_mask is not None else None)


def store_vector(ref, rows, value, row_mask=None):
    """``ref[rows] = value`` for a 1-D ref (LSE)."""
    plgpu.store(ref.at[rows], value.astype(ref.dtype), mask=row_mask)


def request_span(cu_ref, b, num_seqs: int, num_tokens: int):
    """``(start, end)`` of request ``b``'s rows from the ``i32[num_seqs + 1]`` boundaries ``cu_ref``, whatever they
    hold: the rule of :func:`pallas_attn.core.metadata.clamp_cu`, applied inside the Triton prefill (one vector load
    per program, no launch before the kernel), so requests never overlap and never reach past the array
    (docs/design.md#isolation-whatever-the-inputs). ``b == num_seqs`` gives ``(end of the last request, end of the
    last request)``."""
    idx = jnp.arange(1 << max(num_seqs, 1).bit_length())  # a power of two > num_seqs
    cu = jnp.clip(plgpu.load(cu_ref.at[jnp.minimum(idx, num_seqs)]), 0, num_tokens)
    start = jnp.max(jnp.where(idx <= b, cu, 0))
    end = jnp.max(jnp.where(idx <= jnp.minimum(b + 1, num_seqs), cu, 0))
    return start, end


def paged_rows(block_table_ref, table_base, pos, block_size: int, num_kv_heads: int, kv_head, num_pages: int,
               valid=None, guard: bool = True):
    """``(rows [N], page_ok bool[N] | None)``: row indices of key positions ``pos`` in the flattened
    ``[num_blocks*block_size*Hkv, D]`` cache, and whether their page id is in the pool.

    ``block_table_ref`` is the flattened ``[num_seqs * max_blocks]`` table and ``table_base`` the request's first
    entry. Entries are read as scalars-per-row from the table (logical_block = pos // block_size,
    physical_block = block_table[logical_block], slot = physical_block * block_size + pos % block_size). Where
    ``valid`` is False the table is not read. With ``guard``, a page id outside ``[0, num_pages)`` is never
    dereferenced: its rows point at row 0 and ``page_ok`` is False, so callers mask their loads and scores
    (docs/design.md#isolation-whatever-the-inputs). Without it (pages already vouched for), ``page_ok`` is None.
    """
    logical = table_base + pos // block_size
    if valid is None:
        page = plgpu.load(block_table_ref.at[logical])
    else:
        page = plgpu.load(block_table_ref.at[logical], mask=valid, other=0)
    page_ok = None
    if guard:
        page_ok = (page >= 0) & (page < num_pages)
        page = jnp.where(page_ok, page, 0)
    return (page * block_size + pos % block_size) * num_kv_heads + kv_head, page_ok


PAGE_CHECK_CHUNK = 256  # table entries a program checks per vector load (program_pages_in_pool)


def program_pages_in_pool(block_table_ref, table_base, key_start, key_end, block_size: int, num_pages: int,
                          max_blocks: int):
    """Scalar bool: every page holding key positions ``[key_start, key_end)`` of the request whose table row starts
    at ``table_base`` has an id in ``[0, num_pages)``. One pass over the program's own table entries,
    ``PAGE_CHECK_CHUNK`` at a time, before its KV loop: a fusion computing it for every request before the kernel
    measured slower (one more launch: docs/performance.md#the-cost-of-the-isolation-guards). ``key_end`` must not
    pass the table's capacity."""
    first = key_start // block_size
    last = (key_end + block_size - 1) // block_size  # exclusive
    chunk = min(1 << max(max_blocks - 1, 0).bit_length(), PAGE_CHECK_CHUNK)
    idx = jnp.arange(chunk)

    def count_bad(c, bad):
        logical = first + c * chunk + idx
        used = logical < last
        page = plgpu.load(block_table_ref.at[table_base + logical], mask=used, other=0)
        return bad + jnp.sum((used & ((page < 0) | (page >= num_pages))).astype(jnp.int32))

    num_chunks = jnp.where(key_end > key_start, last - first + chunk - 1, 0) // chunk  # no key: nothing read
    return jax.lax.fori_loop(0, num_chunks, count_bad, jnp.int32(0)) == 0


def dot_precision(dtype):
    """float32 inputs use full-precision (IEEE) dots; bf16/fp16 the tensor-core default."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def paged_kv_step(q, q_pos, k_ref, v_ref, block_table_ref, table_base, kv_len, kv_head, *, cols: Cols,
                  block_n: int, block_size: int, num_kv_heads: int, num_pages: int, scale: float, dot,
                  mods: masks.ScoreMods = masks.NO_MODS, slope2=None, kv_first=None):
    """The per-KV-tile step shared by paged decode and ragged paged attention (``mods``: window, soft-cap and
    ALiBi on absolute positions; ``slope2 [M]`` the rows' ALiBi slopes in base 2).

    ``q [M, Dp]`` rows sit at absolute positions ``q_pos [M]`` of a request with ``kv_len`` keys; key tile ``j``
    covers positions ``[j*block_n, (j+1)*block_n)``, read through the request's block table. Unmasked tiles (■)
    build no mask at all: the kernels send tiles here only for a program whose pages are all in the pool
    (:func:`program_pages_in_pool`). Masked tiles mask loads past ``kv_len`` (the table is not
    read there) and apply ``key_pos <= query_pos`` (a full rectangle plus a bottom-right triangle), and keys on a
    page id outside the pool are never loaded and score ``-inf``. ``kv_first``: with a left window, the first key
    any row of the tile sees; masked tiles neither read the table nor load keys below it (those slots, or whole
    pages, may be freed and hold anything).
    """
    def step(j, state, masked):
        k_pos = j * block_n + jnp.arange(block_n)  # [N]
        if not masked:
            rows, _ = paged_rows(block_table_ref, table_base, k_pos, block_size, num_kv_heads, kv_head, num_pages,
                                 guard=False)
            k, v = load_rows(k_ref, rows, cols), load_rows(v_ref, rows, cols)  # [N, Dp]
            return softmax.online_softmax_step(state, mods.scores(dot(q, k.T), scale, q_pos, k_pos, slope2), v, dot)
        k_valid = k_pos < kv_len if kv_first is None else (k_pos < kv_len) & (k_pos >= kv_first)
        rows, page_ok = paged_rows(block_table_ref, table_base, k_pos, block_size, num_kv_heads, kv_head, num_pages,
                                   k_valid)
        ok = k_valid & page_ok  # [N]
        k, v = load_rows(k_ref, rows, cols, ok), load_rows(v_ref, rows, cols, ok)  # [N, Dp]
        s2 = mods.scores(dot(q, k.T), scale, q_pos, k_pos, slope2)  # [M, N] base 2
        # A key past the request, before every row's window or on a page outside the pool moves past every query:
        # one [M, N] compare is the whole causal, length and page mask (every valid row sits below kv_len).
        visible = jnp.where(ok, k_pos, jnp.iinfo(jnp.int32).max)[None, :] <= q_pos[:, None]
        window = mods.window_mask(q_pos, k_pos)
        s2 = jnp.where(visible if window is None else visible & window, s2, -jnp.inf)
        return softmax.online_softmax_step(state, s2, v, dot)

    return step


def paged_tile_plan(q_first, q_last, kv_len, block_n: int, split, num_splits: int, split_size: int | None,
                    mods: masks.ScoreMods, guarded):
    """The key tiles of one program of the paged kernels, whose rows sit at absolute positions ``[q_first,
    q_last]``: ``(tile_start, full_start | None, full_end, kv_end, kv_first | None)`` for
    :func:`pallas_attn.core.softmax.kv_loop` and :func:`paged_kv_step`. With a left window the split shares out only
    the tiles from the first row's window on, and ``kv_first`` is that first key. ``guarded`` (a page outside the
    pool: every tile goes through the masked step) is a scalar, or a function of the program's keys
    ``(key_start, key_end) -> guarded`` that checks them (:func:`program_pages_in_pool`)."""
    kv_first = jnp.maximum(q_first - mods.window_left, 0) if mods.window_left >= 0 else None
    tile_start, tile_end = split_tile_range(split, num_splits, kv_len, block_n, split_size,
                                            0 if kv_first is None else kv_first // block_n)
    full_start = None
    if mods.windowed:
        tile_start, full_start, full_end, kv_end = masks.window_tile_ranges(
            q_first, q_last, kv_len, block_n, (mods.window_left, mods.window_right), tile_start=tile_start,
            tile_end=tile_end)
    else:
        full_end, kv_end = masks.kv_tile_ranges(q_first, q_last, kv_len, block_n, tile_start=tile_start,
                                                tile_end=tile_end)
    if callable(guarded):
        key_start = tile_start * block_n if kv_first is None else jnp.maximum(tile_start * block_n, kv_first)
        guarded = guarded(key_start, jnp.minimum(kv_end * block_n, kv_len))
    if full_start is not None:
        full_start = jnp.where(guarded, tile_start, full_start)
    return tile_start, full_start, jnp.where(guarded, tile_start, full_end), kv_end, kv_first


def split_tile_range(split, num_splits: int, kv_len, block_n: int, split_size: int | None, first_tile=0):
    """Key tiles ``[tile_start, tile_end)`` of split ``split`` (split-KV segments, aligned to ``block_n``).

    Fixed ``split_size`` (tokens, a multiple of ``block_n``): segment ``s`` is ``[s*split_size, (s+1)*split_size)``
    whatever else is in the batch (batch invariant). Otherwise the request's tiles from ``first_tile`` on (a
    window's first) are shared out evenly among ``num_splits`` segments.
    """
    if split_size is not None:
        per = split_size // block_n
        return split * per, (split + 1) * per
    tiles_total = (kv_len + block_n - 1) // block_n
    per = (tiles_total - first_tile + num_splits - 1) // num_splits
    return first_tile + split * per, jnp.minimum(first_tile + (split + 1) * per, tiles_total)
