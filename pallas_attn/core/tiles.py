"""Tile memory access shared by the kernels: rows addressed by index vectors (docs/design.md#the-grid).

Every kernel sees its arrays flattened to 2-D ``[rows, head_dim]`` (a free reshape in the wrapper) and addresses a
tile as a vector of row indices — packed tokens ``(seq_start + pos) * num_heads + head``, or paged slots
``(block_table[pos // block_size] * block_size + pos % block_size) * num_kv_heads + kv_head``. In Triton this is
plain pointer arithmetic (each row is ``head_dim`` contiguous elements, so loads stay coalesced); in interpret mode
it is a gather. Head dims that are not a power of two are padded inside the kernel: the block is
``[rows, next_pow2(D)]`` and the extra columns are masked off on load and store.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_attn.core import config as config_lib, masks, softmax, validation
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
    return plgpu.load(view, mask=mask, other=jnp.zeros((), ref.dtype))


def load_parts(ref, rows, cols, row_mask=None):
    """:func:`load_rows`, or a tuple of them for a tuple of column groups (:func:`pair_cols`)."""
    if isinstance(cols, tuple):
        return tuple(load_rows(ref, rows, c, row_mask) for c in cols)
    return load_rows(ref, rows, cols, row_mask)


def latent_cols(kv_lora_rank: int, rope_dim: int) -> tuple[Cols, Cols | None]:
    """The two column groups of an MLA latent row ``[kv_lora_rank + rope_dim]``: the latent part (the values, and
    the keys' first dims) and the rope part padded to a power of two (None without one), so no 576-wide
    (non-power-of-two) tile exists."""
    rope = Cols(rope_dim, config_lib.next_pow2(rope_dim), offset=kv_lora_rank) if rope_dim else None
    return Cols(kv_lora_rank, kv_lora_rank), rope


def load_latent(ref, rows, cols: tuple[Cols, Cols | None], row_mask=None):
    """``([R, kv_lora_rank], [R, rope] | None)``: the latent and rope parts of MLA rows (:func:`latent_cols`)."""
    latent, rope = cols
    return load_rows(ref, rows, latent, row_mask), (load_rows(ref, rows, rope, row_mask) if rope else None)


def load_fp8_latent(ref, rows, kv_lora_rank: int, rope_dim: int, dtype, row_mask=None):
    """FP8 latent rows (``uint8``, FlashMLA's layout: :func:`pallas_attn.quantize_latent`) as the dots take them:
    ``(values, scales, rope)``. ``values``: a ``[R, 128]`` tile per scale group, the e4m3 values widened to
    ``dtype`` (exact: every e4m3 value is a bf16 and an fp16); ``scales``: each group's ``f32[R]``, applied to the
    products, never to the values (:func:`pallas_attn.core.softmax.scaled_probabilities`); ``rope [R, rope] | None`` in
    ``dtype``. Masked rows read as 0."""
    group = validation.FP8_LATENT_GROUP
    values, scales = [], []
    for g in range(kv_lora_rank // group):
        raw = load_rows(ref, rows, Cols(group, group, offset=g * group), row_mask)
        values.append(jax.lax.bitcast_convert_type(raw, jnp.float8_e4m3fn).astype(dtype))
        # the scale's four bytes, each shifted into place: disjoint bits, so their sum is the word
        word = load_rows(ref, rows, Cols(4, 4, offset=kv_lora_rank + 4 * g), row_mask).astype(jnp.int32)
        word = jnp.sum(jax.lax.shift_left(word, 8 * jnp.arange(4)[None, :]), axis=1)
        scales.append(jax.lax.bitcast_convert_type(word, jnp.float32))
    if not rope_dim:
        return tuple(values), tuple(scales), None
    padded = config_lib.next_pow2(rope_dim)
    col = jnp.arange(padded)
    mask = (col < rope_dim)[None, :]
    mask = mask if row_mask is None else row_mask[:, None] & mask
    first = kv_lora_rank + 4 * len(values) + 2 * col

    def half(offset):  # the low (0) or high (1) byte of each bf16 rope value, as int32
        return plgpu.load(ref.at[rows[:, None], (first + offset)[None, :]], mask=mask,
                          other=jnp.zeros((), ref.dtype)).astype(jnp.int32)

    bits = (half(0) | jax.lax.shift_left(half(1), 8)).astype(jnp.uint16)
    return tuple(values), tuple(scales), jax.lax.bitcast_convert_type(bits, jnp.bfloat16).astype(dtype)


def store_parts(ref, rows, cols, value, row_mask=None):
    """:func:`store_rows`, or one per column group of a tuple (``value`` then the tuple of their tiles)."""
    if isinstance(cols, tuple):
        for c, v in zip(cols, value):
            store_rows(ref, rows, c, v, row_mask)
    else:
        store_rows(ref, rows, cols, value, row_mask)


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


def page_guard(block_table_ref, table_base, block_size: int, num_pages: int, max_blocks: int):
    """The ``guarded(key_start, key_end)`` of :func:`paged_tile_plan` for the request whose table row starts at
    ``table_base``: True when a page of those keys is outside the pool (:func:`program_pages_in_pool`), so every
    tile goes through the masked step."""
    def guarded(key_start, key_end):
        return ~program_pages_in_pool(block_table_ref, table_base, key_start, key_end, block_size, num_pages,
                                      max_blocks)

    return guarded


def query_block_frame(cu_query_lens_ref, seq_lens_ref, req, first, tok_in_block, capacity: int):
    """Where a query block of the ragged kernels sits in request ``req``: ``(q_start, q_len, seq_len, context,
    tok)``, its rows' request-local tokens ``tok = first + tok_in_block`` (``[M]``), the request's new tokens at
    ``[q_start, q_start + q_len)`` of the packed rows and at absolute positions ``context + tok``. ``seq_len`` is
    clamped to the table's ``capacity``: past it nothing more is read."""
    q_start = cu_query_lens_ref[req]
    q_len = cu_query_lens_ref[req + 1] - q_start
    seq_len = jnp.clip(seq_lens_ref[req], 0, capacity)
    return q_start, q_len, seq_len, seq_len - q_len, first + tok_in_block


def dot_precision(dtype):
    """float32 inputs use full-precision (IEEE) dots; bf16/fp16 the tensor-core default."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def kv_scale_args(mode: str | None, k_scale, v_scale) -> tuple:
    """A paged launch's FP8 scale arrays for ``mode`` (:func:`pallas_attn.core.validation.check_kv_scales`): ``()``
    without FP8, ``(f32[2],)`` per tensor, the two scale caches per token and head."""
    if mode is None:
        return ()
    if mode == "tensor":
        return (jnp.stack([k_scale, v_scale]).astype(jnp.float32),)
    return k_scale, v_scale


def kv_scales_mode(kv_scales) -> str | None:
    """The mode of a paged launch's FP8 scale arrays: ``()`` None, ``(f32[2],)`` "tensor", two scale caches
    "token"."""
    return {0: None, 1: "tensor", 2: "token"}[len(kv_scales)]


def kv_scales(refs: list, mode: str | None, scale):
    """``(score scale, v_scale | None, token_scales | None)`` of a paged kernel, popping its scale refs from the
    front of ``refs``. Per tensor (``mode`` "tensor", one ref ``f32[2]`` = k_scale, v_scale) the K scale folds into
    the softmax scale and the V scale multiplies the normalised output once (the cache's values are ``stored ·
    scale``; both products are exact algebra, docs/design.md#fp8-kv-caches). Per token and head ("token", two refs
    ``f32[num_blocks * block_size * Hkv]``, indexed like the cache's rows) ``token_scales`` is the pair of refs,
    for :func:`paged_kv_step`. Without an FP8 cache, the static ``scale``."""
    if mode is None:
        return scale, None, None
    if mode == "tensor":
        ref = refs.pop(0)
        return scale * ref[0], ref[1], None
    return scale, None, (refs.pop(0), refs.pop(0))


FP8_QUERY_TOP = 14  # an FP8 cache's fp16 query tile has its largest magnitude in [2**14, 2**15)
FP8_FORMATS = {jnp.dtype(jnp.float8_e4m3fn): "e4m3", jnp.dtype(jnp.float8_e5m2): "e5m2"}


def fp8_format(cache_dtype) -> str | None:
    """``"e4m3"`` / ``"e5m2"`` for an FP8 cache dtype, else None."""
    return FP8_FORMATS.get(jnp.dtype(cache_dtype))


def as_fp8_pairs(cache):
    """An FP8 cache ``[..., D]`` as ``uint16[..., D/2]``, each element two neighbouring head dims (a free bitcast).

    The paged kernels read FP8 pages this way: the tiles are 16-bit, so they are copied and laid out for the dots as
    bf16 tiles are, where an FP8 tile is read from shared memory one byte at a time (``ld.shared.b8``: see
    ``pallas-attn inspect`` and docs/performance.md#fp8-kv-caches), and :func:`fp8_pairs` converts two dims with one
    instruction."""
    return jax.lax.bitcast_convert_type(cache.reshape(*cache.shape[:-1], cache.shape[-1] // 2, 2), jnp.uint16)


def pair_cols(head_dim: int, padded: int) -> tuple[Cols, Cols]:
    """The even and odd head dims of a ``[rows, padded]`` array: two :class:`Cols` of ``padded // 2`` columns."""
    even, odd = Cols(head_dim // 2, padded // 2), Cols(head_dim // 2, padded // 2)
    even.idx, odd.idx = 2 * even.idx, 2 * odd.idx + 1
    return even, odd


def fp8_pairs(pairs, fmt: str, dtype, compiled: bool):
    """``uint16[N, W]`` FP8 pairs (:func:`as_fp8_pairs`) → ``(even, odd)`` dims, each ``dtype[N, W]``, exact (NaN
    and the e5m2 infinities included). Compiled: one ``cvt.rn.f16x2.{e4m3,e5m2}x2`` per pair (the low byte is the
    even dim, into the low half); interpreted: the same through a bitcast."""
    if compiled:
        (both,) = plgpu.elementwise_inline_asm(
            f"cvt.rn.f16x2.{fmt}x2 $0, $1;", args=[pairs], constraints="=r,h", pack=1,
            result_shape_dtypes=[jax.ShapeDtypeStruct(pairs.shape, jnp.int32)])  # Triton takes signless ints only
        half = lambda bits: jax.lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.float16)  # noqa: E731
        even, odd = half(both & 0xFFFF), half(jax.lax.shift_right_logical(both, 16))
    else:
        fp8 = jnp.float8_e4m3fn if fmt == "e4m3" else jnp.float8_e5m2
        both = jax.lax.bitcast_convert_type(pairs, fp8).astype(jnp.float16)  # [N, W, 2], little-endian
        even, odd = both[..., 0], both[..., 1]
    return even.astype(dtype), odd.astype(dtype)


def fp8_tile(pairs, fmt: str, dtype, compiled: bool):
    """``uint16[N, W]`` FP8 pairs (:func:`as_fp8_pairs`) → ``dtype[N, 2W]``, the head dims in their natural order,
    exact: :func:`fp8_pairs` joined back pair by pair. Compiled, the join (``tt.join``) costs nothing when the tile
    is a dot's K-major operand (``Q Kᵀ``): each converted pair is already two neighbouring dims of one register."""
    even, odd = fp8_pairs(pairs, fmt, dtype, compiled)
    return jnp.stack([even, odd], axis=-1).reshape(pairs.shape[0], 2 * pairs.shape[1])


def fp16_shift(top):
    """The power of two that puts a largest magnitude ``top`` in ``[2**14, 2**15)`` (1 where ``top <= 0``): every
    bf16 value within 2**24 of the largest is then an fp16 value, exactly, and none overflows."""
    exponent = jnp.where(top > 0, jnp.floor(jnp.log2(jnp.where(top > 0, top, 1.0))), 0.0)
    return jnp.exp2(FP8_QUERY_TOP - exponent)  # a power of two: exact in both directions


def query_for_cache(q, fp8: str | None, scale):
    """``(q, scale)`` for the dots with a cache read as ``fp8`` pairs (None: not FP8): unchanged unless ``fp8``
    and ``q`` 16-bit (``q`` may be a tuple of column groups: :func:`pair_cols`).

    Then the tiles are converted to fp16 (:func:`fp8_pairs`; bf16 would take one more conversion per element),
    and so is the query tile, after a power-of-two scale that puts its largest magnitude in ``[2**14, 2**15)``:
    every bf16 value within 2**24 of the largest is then an fp16 value, exactly (fp16's 11 significant bits hold
    bf16's 8), none overflows, and the scale leaves the score scale as a power of two, exactly. The probabilities
    then meet V in fp16 too."""
    parts = q if isinstance(q, tuple) else (q,)
    if fp8 is None or parts[0].dtype.itemsize != 2:
        return q, scale
    shift = fp16_shift(functools.reduce(jnp.maximum, [jnp.max(jnp.abs(x.astype(jnp.float32))) for x in parts]))
    parts = tuple((x.astype(jnp.float32) * shift).astype(jnp.float16) for x in parts)
    return (parts if isinstance(q, tuple) else parts[0]), scale / shift


def query_rows_for_cache(q):
    """``(q16 [T, Hq, D] fp16, shift f32[T])``: each token's query rows times its own :func:`fp16_shift`, for a
    kernel whose operands are fp16 over an FP8 cache; the scores of token ``t`` are then ``shift[t]`` times too
    large. Per token, so that one token's values (a NaN, a huge row) change only its own rows."""
    top = jnp.max(jnp.abs(q.astype(jnp.float32)), axis=tuple(range(1, q.ndim)))
    shift = fp16_shift(jnp.where(jnp.isfinite(top), top, 0.0))  # a non-finite token keeps its values: its own NaN
    return (q.astype(jnp.float32) * shift.reshape(-1, *[1] * (q.ndim - 1))).astype(jnp.float16), shift


def paged_kv_step(q, q_pos, k_ref, v_ref, block_table_ref, table_base, kv_len, kv_head, *, cols: Cols,
                  block_n: int, block_size: int, num_kv_heads: int, num_pages: int, scale: float, dot,
                  mods: masks.ScoreMods = masks.NO_MODS, slope2=None, kv_first=None, fp8: str | None = None,
                  compiled: bool = True, token_scales=None):
    """The per-KV-tile step shared by paged decode and ragged paged attention (``mods``: window, soft-cap and
    ALiBi on absolute positions; ``slope2 [M]`` the rows' ALiBi slopes in base 2).

    ``q [M, Dp]`` rows sit at absolute positions ``q_pos [M]`` of a request with ``kv_len`` keys; key tile ``j``
    covers positions ``[j*block_n, (j+1)*block_n)``, read through the request's block table. Unmasked tiles (■)
    build no mask at all: the kernels send tiles here only for a program whose pages are all in the pool
    (:func:`program_pages_in_pool`). Masked tiles mask loads past ``kv_len`` (the table is not
    read there) and apply ``key_pos <= query_pos`` (a full rectangle plus a bottom-right triangle), and keys on a
    page id outside the pool are never loaded and score ``-inf``. ``kv_first``: with a left window, the first key
    any row of the tile sees; masked tiles neither read the table nor load keys below it (those slots, or whole
    pages, may be freed and hold anything). ``fp8``: the refs hold an FP8 cache as ``uint16`` pairs
    (:func:`as_fp8_pairs`) and ``cols`` are their ``Dp/2`` columns, converted exactly. Each value tile becomes its
    even and odd dims, ``[N, Dp/2]`` each (:func:`fp8_pairs`), whose ``P V`` products the state's accumulator holds
    as a pair (:func:`pair_cols` stores them). A key tile follows ``q``: with ``q`` as its ``(even, odd)`` dims
    (:func:`pair_cols`) it splits the same way and the scores sum two dots; with ``q [M, Dp]`` in the dims' order it
    is joined back (:func:`fp8_tile`) for one dot. Which is faster depends on the kernel (the decode kernel keeps the
    pairs: docs/performance.md#fp8-kv-caches). ``scale`` then carries a per-tensor K scale (:func:`kv_scales`).
    ``token_scales``: per-(token, head) scale refs ``(k_scales, v_scales)``, read with the tile's rows: each key's
    scale multiplies its column of raw scores, each value's joins its column of probabilities for ``P V``
    (:func:`softmax.online_softmax_step`).
    """
    key_pairs = isinstance(q, tuple)  # the query as (even, odd) dims: FP8 key tiles split the same way
    dtype = (q[0] if key_pairs else q).dtype

    def load_kv(rows, row_mask=None):  # [N, Dp] each, or (even, odd) [N, Dp/2] pairs; in q's dtype
        k, v = load_rows(k_ref, rows, cols, row_mask), load_rows(v_ref, rows, cols, row_mask)
        if fp8:
            keys = fp8_pairs if key_pairs else fp8_tile
            return keys(k, fp8, dtype, compiled), fp8_pairs(v, fp8, dtype, compiled)
        return k, v

    def qk(k):  # [M, N] raw scores
        if key_pairs:
            return dot(q[0], k[0].T) + dot(q[1], k[1].T)
        return dot(q, k.T)

    def scores(k, rows, row_mask=None):  # [M, N] base 2, and the values' scales [N] (per token and head)
        raw = qk(k)
        v_scale = None
        if token_scales is not None:
            raw = raw * load_vector(token_scales[0], rows, row_mask)[None, :]
            v_scale = load_vector(token_scales[1], rows, row_mask)
        return raw, v_scale

    def step(j, state, masked):
        k_pos = j * block_n + jnp.arange(block_n)  # [N]
        if not masked:
            rows, _ = paged_rows(block_table_ref, table_base, k_pos, block_size, num_kv_heads, kv_head, num_pages,
                                 guard=False)
            k, v = load_kv(rows)
            raw, v_scale = scores(k, rows)
            return softmax.online_softmax_step(state, mods.scores(raw, scale, q_pos, k_pos, slope2), v, dot,
                                               v_scale=v_scale)
        k_valid = k_pos < kv_len if kv_first is None else (k_pos < kv_len) & (k_pos >= kv_first)
        rows, page_ok = paged_rows(block_table_ref, table_base, k_pos, block_size, num_kv_heads, kv_head, num_pages,
                                   k_valid)
        ok = k_valid & page_ok  # [N]
        k, v = load_kv(rows, ok)
        raw, v_scale = scores(k, rows, ok)  # a masked key's scales read as 0
        s2 = mods.scores(raw, scale, q_pos, k_pos, slope2)  # [M, N] base 2
        # A key past the request, before every row's window or on a page outside the pool moves past every query:
        # one [M, N] compare is the whole causal, length and page mask (every valid row sits below kv_len).
        visible = jnp.where(ok, k_pos, jnp.iinfo(jnp.int32).max)[None, :] <= q_pos[:, None]
        window = mods.window_mask(q_pos, k_pos)
        s2 = jnp.where(visible if window is None else visible & window, s2, -jnp.inf)
        return softmax.online_softmax_step(state, s2, v, dot, v_scale=v_scale)

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
    """Key tiles ``[tile_start, tile_end)`` of split ``split`` (split-KV segments, aligned to ``block_n``), counted
    from ``first_tile`` (a left window's first tile, else 0: tiles before it are never read).

    Fixed ``split_size`` (tokens, a multiple of ``block_n``): segment ``s`` is ``[s*split_size, (s+1)*split_size)``
    keys past ``first_tile``'s first, whatever else is in the batch (batch invariant: ``first_tile`` is the
    program's own). Otherwise the request's tiles from ``first_tile`` on are shared out evenly among ``num_splits``
    segments. Either way ``num_splits`` segments must cover the keys a program reads
    (:func:`pallas_attn.ops.paged.keys_read`).
    """
    if split_size is not None:
        per = split_size // block_n
        return first_tile + split * per, first_tile + (split + 1) * per
    tiles_total = (kv_len + block_n - 1) // block_n
    per = (tiles_total - first_tile + num_splits - 1) // num_splits
    return first_tile + split * per, jnp.minimum(first_tile + (split + 1) * per, tiles_total)
