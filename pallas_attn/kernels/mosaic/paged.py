"""Ragged paged attention on the Mosaic GPU backend (Hopper: wgmma, TMA page copies, warp specialisation).

The same contract as :mod:`pallas_attn.kernels.triton.paged` — decode, verification, chunked and fresh prefill
of many requests in one call over a paged K/V cache — for the backend JAX keeps (the Pallas Triton backend is
deprecated since JAX 0.11). :func:`pallas_attn.paged_attention` and :func:`pallas_attn.paged_decode_attention`
run it with ``backend="mosaic"``, and by default where the Pallas Triton backend is gone.

* work items ``(query block, KV head, split)``. A query block is ``block_q`` tokens of one request × the ``group``
  query heads of one KV head, ``block_q · group <= 64`` rows: the M dim of both wgmmas, so each K/V tile is read
  once for all of them (a decode step's GQA group, a verification's draft tokens). The static number of blocks
  bounds any batch of the bucketed shapes (no host sync, no recompilation); blocks past the batch's last are no
  work. A program loops over items in the order :func:`item_order` gives it, its K/V slots turning on from one
  item to the next, so the memory warpgroup loads the next item's first tiles while the compute warpgroups finish
  the last one's. At head dim 64, and at 128 with an item an SM before splits, the grid is **persistent**
  (:func:`persistent`): as many programs as the GPU holds at once, the items dealt longest first; otherwise a
  program an item.
* warpgroups: one for memory, one or two for compute (:func:`compute_wgs`). The **memory** warpgroup reads the block
  table in the kernel and brings each 64-key tile of K and V into a ring of shared-memory slots with TMA, in copies
  of ``gcd(block_size, 64)`` rows (:func:`copy_rows`): one a tile for pages of a multiple of 64, one a page for 8,
  16 or 32, 16 rows at a time for 48 or 80, 32 for Qwen3-Next's 544; a copy never crosses a page. A page that is not
  the request's — past its keys, wholly before its window, or an id outside the pool — is never copied (the memory
  warpgroup arrives on the slot's barrier without bytes instead). A **compute** warpgroup runs ``S = Q Kᵀ``, the
  online softmax in registers (exp2, the scale folded into its FMA) and ``O += P V``, and releases each slot to the
  memory warpgroup. At head dim 128 two take turns on a program's tiles (even and odd), each
  with its own running state; the second hands its state to the first through shared memory, which merges the two
  before the output.
* isolation (docs/design.md#isolation-whatever-the-inputs): a tile with a key the rows may not read — past the
  request's length, before its window, on a page not copied — masks those scores and zeroes those rows of V in
  shared memory before ``P V`` (``0 · NaN`` is NaN: a neighbour's NaN or a stale slot must meet zeros). Tiles
  wholly inside the request's keys, the common case, skip the zeroing (a branch on one scalar); their scores pass
  one select on their pages' ids.
* the tile plan is the Triton kernels' (:func:`pallas_attn.core.tiles.paged_tile_plan`): tiles before a window
  are never loaded, the causal and window edges are masked, the rest run unmasked; split-KV shares the tiles out
  by count or by a fixed ``split_size`` (batch invariant). Soft-cap, ALiBi and sinks are applied in registers;
  sinks join the denominator where a program sees its rows' whole context, else the split merge applies them.
* outputs go out as whole tiles, ``[splits, blocks, Hkv, rows, D]`` in q's dtype (split partials too, as the
  Mosaic MLA kernel's: the merge adds their rounding, ~2^-9 relative in bf16) and an LSE ``[splits, blocks, Hkv,
  rows]``, one TMA store each; the wrapper gathers the token rows (padding rows: 0 and -inf) and merges split
  partials with :func:`pallas_attn.core.softmax.merge_split_outputs`. A batch with prefill chunks runs two launches,
  short queries and chunks, each with its own split plan (as the Triton kernel's).
* FP8 caches: the scores run in fp16. Pages land as stored and the compute warpgroup widens each tile to fp16 in
  shared memory (one conversion per pair of values; wgmma takes no mixed operands: docs/design.md#fp8-kv-caches),
  freeing the FP8 slot at once; each token's query is scaled by a power of two into fp16's range, whose inverse
  and the K scale multiply its raw scores. Per-tensor scales: the V scale multiplies the fp16 output once, outside.
  Per-(token, head) scales: the wrapper gathers each request's scales by KV head (:func:`scale_bands`: over the
  window's tiles with a window), the memory warpgroup copies a tile's 64 with its K and V rows, each key's scale
  multiplies its score column in float32, and each value row is widened times its own scale into bf16 (float32's
  range), so that P, V and the output are bf16.

Head dims 64, 128 and 256, bf16 / fp16 queries over a cache of q's dtype or FP8 (either scale mode), page sizes
that are multiples of 8, groups up to 64 (:func:`supported`); the Triton kernel takes the rest.

Interpret mode (CPU): the Mosaic GPU interpreter runs this kernel with the same two limits as the Mosaic prefill's
(:mod:`pallas_attn.kernels.mosaic.prefill`): P reaches wgmma through shared memory, and each ``P V`` is a fresh
accumulator added to the rescaled one. Reference: :func:`pallas_attn.reference.paged_attention`.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_attn.core import backend, config as config_lib, masks, metadata, softmax, tiles
from pallas_attn.kernels.mosaic import columns

BLOCK_M = 64  # rows of a query block (tokens × group): one wgmma M tile
BLOCK_N = 64  # keys per K/V slot
HEAD_DIMS = (64, 128, 256)  # whole 128-byte swizzle tiles (narrower ones: docs/performance.md#paged-backends)
SWIZZLE = 128  # bytes: a 64-wide bf16 column tile per 8-row group, the wgmma operand layout
TILE_COLS = 64  # 16-bit columns of one swizzle tile
ROW_ALIGN = 8  # rows of the tiled shared-memory layout: output tiles are stored in whole 8-row groups
FEATURE_ROWS = 2  # ALiBi slopes and sinks, one 64-row vector each per KV head
SHORT_QUERY_LEN = 16  # decode and verification; longer queries are prefill chunks (a launch of their own)


def supported(q, k_cache) -> str | None:
    """None when the Mosaic paged kernel applies to these inputs, else the reason it does not (an FP8 cache runs
    with either scale mode)."""
    head_dim = q.shape[-1]
    block_size, num_kv_heads = k_cache.shape[1:3]
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        return f"dtype {q.dtype} (bf16 / fp16 only)"
    if tiles.fp8_format(k_cache.dtype) is None and k_cache.dtype != q.dtype:
        return f"a {k_cache.dtype} cache (q's dtype or FP8 only)"
    if head_dim not in HEAD_DIMS:
        return f"head_dim={head_dim} (supported: {', '.join(map(str, HEAD_DIMS))})"
    if block_size % ROW_ALIGN:
        return f"block_size={block_size} (supported: multiples of {ROW_ALIGN}: a TMA copy lands whole 8-row groups)"
    if q.shape[1] // num_kv_heads > BLOCK_M:
        return f"{q.shape[1] // num_kv_heads} query heads per KV head (at most {BLOCK_M})"
    return None


def copy_rows(block_size: int) -> int:
    """Rows of one TMA copy of K or V: the largest power of two that divides both the page and the 64-key tile, so
    that every copy lies within one page and a tile is ``64 / copy_rows`` copies."""
    return math.gcd(block_size, BLOCK_N)


def compute_wgs(head_dim: int) -> int:
    """Compute warpgroups of a program: two taking turns on its key tiles at head dim 128, where one warpgroup's
    chain a tile (two wgmmas and a softmax, and over FP8 pages the tile's widening) is the bound; one at 64 (a third
    warpgroup's registers leave one program an SM instead of two) and at 256 (the second's float32 state would not
    fit shared memory beside the slots for the merge). Over FP8 pages each warpgroup widens its own tiles.
    docs/performance.md#two-compute-warpgroups-at-head-dim-128 has the measurements."""
    return 2 if head_dim == 128 else 1


def num_slots(head_dim: int) -> int:
    """K/V tiles in flight: four up to head dim 128 (128 KB of 16-bit shared memory, 64 KB of FP8), two at 256."""
    return 4 if head_dim <= 128 else 2


def query_block_tokens(max_query_len: int, group: int) -> int:
    """Tokens per query block: as many as fit 64 rows with the group, no more than a request can have."""
    return max(1, min(BLOCK_M // group, config_lib.next_pow2(max(1, max_query_len))))


def num_query_blocks(num_tokens: int, num_seqs: int, block_q: int) -> int:
    """A static bound on the query blocks of any batch: Σ_b cdiv(q_len_b, block_q) <= (T + S·(block_q - 1)) /
    block_q, since Σ_b q_len_b <= T (``cu_query_lens`` is clamped: :func:`pallas_attn.core.metadata.clamp_cu`)."""
    return max(1, (num_tokens + num_seqs * (block_q - 1)) // block_q)


def persistent(head_dim: int, work: int) -> bool:
    """Whether a launch's programs loop over items; ``work``: its query blocks × KV heads (the items before splits).
    At head dim 64, where two programs share an SM and a 16 KB tile leaves a program's fixed cost (its query, its
    pipeline's fill, its output) the most weight: always. At 128 when ``work`` gives every SM an item: looping, with
    no tail-balance segments, measured D1 +5.2%, V1 +2.8% and 64 mixed Llama-3.1-8B requests +4.2%, where a few long
    requests split to fill the GPU lost (D2 −3.6%: its power-of-two segments already fill whole waves of a program
    an item). At 256 never (not measured). docs/performance.md#persistent-programs. The launch's plan
    (:class:`Launch`, made by :func:`pallas_attn.ops.paged.mosaic_plan`) decides it once, with its splits."""
    if head_dim == 64:
        return True
    return head_dim == 128 and work >= backend.num_sms()


class Launch(NamedTuple):
    """A launch's static plan: its split-KV (:func:`pallas_attn.core.config.resolve_splits`) and whether its
    programs loop over items (:func:`persistent`), decided together: looping programs take no tail-balance
    segments."""
    num_splits: int
    split_size: int | None
    persistent: bool


def persistent_programs(num_items: int, head_dim: int, persistent: bool) -> int:
    """Programs of a launch: when ``persistent``, as many as the GPU holds at once (two an SM at head dim 64, one at
    128, whose three warpgroups take about 190 KB of shared memory), each looping over its share of the items;
    else one an item."""
    if not persistent:
        return max(1, num_items)
    return max(1, min(num_items, backend.num_sms() * (2 if head_dim == 64 else 1)))


def item_order(block_req, block_first, cu_query_lens, seq_lens, *, num_kv_heads: int, num_programs: int,
               block_q: int, capacity: int, num_splits: int, split_size: int | None, mods: masks.ScoreMods):
    """``i32[rounds · num_programs]``: entry ``r · num_programs + g`` is the item program ``g`` runs in its round
    ``r`` (-1: none). Items (query block × KV head × split, split fastest) are dealt longest first, by key tiles,
    in snake order (round 0 to programs 0, 1, ..., round 1 back from the last), so that programs finish together
    whatever the mix of lengths; items past the batch's last block come last. Traceable: the order is data, the
    kernel the same for every batch of the bucketed shapes. With a program an item, the grid's own order (query
    blocks fastest, then KV heads, then splits), as a ``(blocks, Hkv, splits)`` grid dispatches them."""
    num_items = block_req.shape[0] * num_kv_heads * num_splits
    if num_programs >= num_items:
        launch = jnp.arange(num_programs, dtype=jnp.int32)
        p, h, s = launch % block_req.shape[0], launch // block_req.shape[0] % num_kv_heads, \
            launch // (block_req.shape[0] * num_kv_heads)
        return jnp.where(launch < num_items, (p * num_kv_heads + h) * num_splits + s, -1)
    splits = jnp.arange(num_splits, dtype=jnp.int32)

    def item_tiles(req, first, split):
        return _item_plan(cu_query_lens, seq_lens, req, first, split, block_q=block_q, capacity=capacity,
                          num_splits=num_splits, split_size=split_size, mods=mods)[-1]

    tiles_n = jax.vmap(jax.vmap(item_tiles, (None, None, 0)), (0, 0, None))(block_req, block_first, splits)
    cost = jnp.where((block_req >= 0)[:, None], tiles_n + 1, 0)  # + 1: an item costs something with no tiles
    cost = jnp.broadcast_to(cost[:, None, :], (block_req.shape[0], num_kv_heads, num_splits)).reshape(-1)
    rounds = pl.cdiv(num_items, num_programs)
    ranked = jnp.argsort(-cost, stable=True).astype(jnp.int32)
    ranked = jnp.where(cost[ranked] > 0, ranked, -1)
    rank = jnp.arange(num_items, dtype=jnp.int32)
    r, g = rank // num_programs, rank % num_programs
    g = jnp.where(r % 2 == 0, g, num_programs - 1 - g)
    return jnp.full((rounds * num_programs,), -1, jnp.int32).at[r * num_programs + g].set(ranked)


def fp8_tile_cols(head_dim: int) -> int:
    """Columns of one swizzle tile of an FP8 page in shared memory: rows of up to 128 one-byte values."""
    return min(SWIZZLE, head_dim)


def band_tiles(capacity: int, num_tokens: int, window_left: int) -> int:
    """Key tiles of a request's per-token scale band (:func:`scale_bands`): every tile of the table, or with a
    left window the tiles its readable keys ``[max(context - left, 0), seq_len)`` can touch: ``q_len + left`` keys
    (``q_len <= num_tokens``) touch at most one tile more than they fill."""
    tiles_total = pl.cdiv(capacity, BLOCK_N)
    if window_left < 0:
        return tiles_total
    return min(tiles_total, pl.cdiv(num_tokens + window_left, BLOCK_N) + 1)


def scale_bands(k_scales, v_scales, block_tables, seq_lens, cu_query_lens, num_tokens: int, window_left: int):
    """``(band_first i32[S], k_band, v_band f32[S, Hkv, band_tiles · 64])``: per request, the per-(token, head)
    scales of the keys it can read, gathered through its block table (an XLA gather) from the tile ``band_first``
    on and laid out by KV head, so that the memory warpgroup brings a tile's 64 scales in one contiguous copy (the
    scale caches keep a page's heads innermost: a head's scales are strided). Keys past the request's length or on
    a page outside the pool get 0 (the kernel masks them anyway). It costs 4 bytes per key and head, gathered over
    the band (the table's capacity without a window, the window's tiles with one)."""
    num_pages, block_size, _ = k_scales.shape
    num_seqs, max_blocks = block_tables.shape
    capacity = max_blocks * block_size
    tiles_n = band_tiles(capacity, num_tokens, window_left)
    seq = jnp.clip(seq_lens, 0, capacity)
    if window_left < 0:
        first = jnp.zeros((num_seqs,), jnp.int32)
    else:  # the tile of the first key any of its tokens sees (kv_first of its first query block)
        context = seq - (cu_query_lens[1:] - cu_query_lens[:-1])
        first = jnp.maximum(context - window_left, 0) // BLOCK_N
    pos = (first[:, None] * BLOCK_N + jnp.arange(tiles_n * BLOCK_N, dtype=jnp.int32)[None, :])  # [S, N]
    logical = pos // block_size
    page = jnp.take_along_axis(block_tables, jnp.minimum(logical, max_blocks - 1), axis=1)
    ok = (pos < seq[:, None]) & (logical < max_blocks) & (page >= 0) & (page < num_pages)
    page, row = jnp.where(ok, page, 0), pos % block_size
    bands = [jnp.where(ok[..., None], x[page, row], 0.0).transpose(0, 2, 1) for x in (k_scales, v_scales)]
    return first.astype(jnp.int32), *bands


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


# ---------------------------------------------------------------------------------------------- kernel body
def _tile_pages(table_ref, table_base, j, seq_len, key_lo, *, block_size: int, max_blocks: int, num_pages: int):
    """The copies of key tile ``j`` of a request: ``[(page, first row in the page, rows, copy it)]``, ``64 /
    copy_rows(block_size)`` of them, each within one page. A copy is made when its rows hold keys in ``[key_lo,
    seq_len)`` and its page id is in the pool; ``page`` is then a valid id (else 0: never read)."""
    pages = []
    rows = copy_rows(block_size)
    for i in range(BLOCK_N // rows):
        first_key = j * BLOCK_N + i * rows
        logical = first_key // block_size
        holds = (first_key < seq_len) & (first_key + rows > key_lo)
        page = table_ref[table_base + jnp.where(holds, jnp.minimum(logical, max_blocks - 1), 0)]
        ok = holds & (page >= 0) & (page < num_pages)
        pages.append((jnp.where(ok, page, 0), first_key % block_size, rows, ok))
    return pages


class _Item(NamedTuple):
    """One work item of a program: query block ``p`` × KV head × split, and its key tiles ``[tile_start, kv_end)``
    (``num_tiles`` of them; 0 for an item past the batch's last block)."""
    p: jax.Array
    kv_head: jax.Array
    split: jax.Array
    live: jax.Array
    b: jax.Array
    first: jax.Array
    q_start: jax.Array
    q_len: jax.Array
    seq_len: jax.Array
    q_first: jax.Array
    plan: tuple  # paged_tile_plan's (tile_start, full_start, full_end, kv_end, kv_first)
    num_tiles: jax.Array


def _item_plan(cu_query_lens, seq_lens, req, first, split, *, block_q: int, capacity: int, num_splits: int,
               split_size: int | None, mods: masks.ScoreMods):
    """``(q_start, q_len, seq_len, q_first, plan, num_tiles)`` of the query block of request ``req`` (-1: none) whose
    first token is ``first``, split ``split``: its key tiles by :func:`pallas_attn.core.tiles.paged_tile_plan`.
    The kernel's programs and the wrapper's item order (:func:`item_order`) both count tiles with it."""
    b = jnp.maximum(req, 0)
    q_start, q_len, seq_len, context, _ = tiles.query_block_frame(cu_query_lens, seq_lens, b, first, 0, capacity)
    q_first = context + first
    q_last = context + jnp.minimum(first + block_q, q_len) - 1
    plan = tiles.paged_tile_plan(q_first, q_last, seq_len, BLOCK_N, split, num_splits, split_size, mods,
                                 guarded=False)
    count = jnp.where(req >= 0, jnp.maximum(plan[3] - plan[0], 0), 0)
    return q_start, q_len, seq_len, q_first, plan, count


def _kernel(order_ref, block_req_ref, block_first_ref, cu_query_lens_ref, seq_lens_ref, table_ref, q_ref, k_ref,
            v_ref, *refs, group: int, block_q: int, rows_pad: int, max_blocks: int, block_size: int, slots: int,
            num_splits: int, split_size: int | None, scale: float, mods: masks.ScoreMods, scale_mode: str | None,
            band_tiles: int, wgs: int, num_programs: int, rounds: int, compiled: bool):
    # refs: [features f32[Hkv, FEATURE_ROWS, 64]] (ALiBi slopes / sinks by row), [FP8: f32[T], each token's raw
    # scores' factor], [per-token scales: i32[S] each request's first band tile, the K and V scale bands f32[S, Hkv,
    # band_tiles * 64] (:func:`scale_bands`)], o, lse, the scratch
    refs = list(refs)
    feat_ref = refs.pop(0) if (mods.alibi or mods.sinks) else None
    fp8 = scale_mode is not None
    per_token = scale_mode == "token"
    scales_ref = refs.pop(0) if fp8 else None
    band_first_ref, k_band_ref, v_band_ref = (refs.pop(0), refs.pop(0), refs.pop(0)) if per_token else (None,) * 3
    o_ref, lse_ref, scoped = refs
    (q_smem, stage, k_smem, v_smem, lse_smem, feat_smem, p_smem, (k16, v16), (ks_smem, vs_smem), merge_smem), \
        (q_bar, k_bar, v_bar), (k_free, v_free), (q_ready, merged) = scoped
    program, wg = lax.axis_index("program"), lax.axis_index("wg")
    dtype = q_ref.dtype
    pv_dtype = jnp.bfloat16 if per_token else dtype  # per-token V rows carry their scales: bf16's range
    head_dim = q_ref.shape[-1]
    num_kv_heads = q_ref.shape[1]
    num_pages = k_ref.shape[0]
    row_layout = plgpu.Layout.WGMMA.reduce(1)  # a vector of the score rows: m, l, per-row factors

    def item_at(r):
        """The item of this program's round ``r`` (:func:`item_order`; -1: none)."""
        it = order_ref[r * num_programs + program]
        live = it >= 0
        it = jnp.maximum(it, 0)
        split = lax.rem(it, jnp.int32(num_splits))
        kv_head = lax.rem(lax.div(it, jnp.int32(num_splits)), jnp.int32(num_kv_heads))
        p = lax.div(it, jnp.int32(num_splits * num_kv_heads))
        req = jnp.where(live, block_req_ref[p], -1)
        first = block_first_ref[p]
        q_start, q_len, seq_len, q_first, plan, count = _item_plan(
            cu_query_lens_ref, seq_lens_ref, req, first, split, block_q=block_q, capacity=max_blocks * block_size,
            num_splits=num_splits, split_size=split_size, mods=mods)
        return _Item(p, kv_head, split, req >= 0, jnp.maximum(req, 0), first, q_start, q_len, seq_len, q_first,
                     plan, count)

    def over_items(body):
        """``body(item, base)`` for each live item of this program in its order; ``base`` counts the key tiles of
        the items before it, which fixes each tile's slot (the ring turns on across items)."""
        def one(r, base):
            item = item_at(r)
            pl.when(item.live)(functools.partial(body, item, base))
            return base + item.num_tiles

        return lax.fori_loop(0, rounds, one, jnp.int32(0))

    def tile_index(item, base, j):
        """Key tile ``j`` of ``item`` in the program's sequence of tiles (slot: that mod ``slots``)."""
        return base + j - item.plan[0]

    def pages_of(item):
        key_lo = jnp.int32(0) if item.plan[4] is None else item.plan[4]
        return key_lo, functools.partial(_tile_pages, table_ref, item.b * max_blocks, seq_len=item.seq_len,
                                         key_lo=key_lo, block_size=block_size, max_blocks=max_blocks,
                                         num_pages=num_pages)

    def compute_item(item, base):
        p, kv_head, split, first = item.p, item.kv_head, item.split, item.first
        q_start, q_len, seq_len, q_first = item.q_start, item.q_len, item.seq_len, item.q_first
        tile_start, full_start, full_end, kv_end, _ = item.plan
        key_lo, pages = pages_of(item)

        def _finish(state):
            """Warpgroup 0: the (merged) state normalised, the output tile and its LSE stored."""
            sink2 = None
            if mods.sinks and num_splits == 1:  # split partials leave the sink to their merge
                sink2 = plgpu.load(feat_smem.at[1], layout=row_layout) * softmax.LOG2E
            out, lse = softmax.finalize(state, sink2)
            # the output tile: into Q's (its last readers, each warpgroup's last Q Kᵀ, have completed), or per token
            # into the widened V tile's (bf16, as the output is: the values' own scale)
            out_smem = v16.at[0] if per_token else q_smem
            out_smem[...] = out.astype(out_smem.dtype)
            lse_smem[...] = lse
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out_smem.at[pl.ds(0, rows_pad)], o_ref.at[split, p, kv_head])
            plgpu.copy_smem_to_gmem(lse_smem.at[pl.ds(0, rows_pad)], lse_ref.at[split, p, kv_head])
            # the next item's query lands where this one's output leaves from: wait until the copies have read it
            # (their writes to global memory complete on their own, as in JAX's persistent Hopper matmul)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        @pl.when(wg == 0)
        def _load_query():
            if feat_ref is not None:
                plgpu.copy_gmem_to_smem(feat_ref.at[kv_head], feat_smem, q_bar)
            # the block's tokens × group rows, a copy per token (one for decode); rows past the request's tokens are
            # left as they are: garbage rows, their scores their own, never stored
            for i in range(block_q):
                tok = first + i
                pl.when(tok < q_len)(functools.partial(plgpu.copy_gmem_to_smem, q_ref.at[q_start + tok, kv_head],
                                                       stage.at[pl.ds(i * group, group)], q_bar))
                pl.when(tok >= q_len)(functools.partial(plgpu.barrier_arrive, q_bar))
            plgpu.barrier_wait(q_bar)
            # into the swizzled wgmma layout. Unoptimized: Mosaic GPU's layout search plans an optimized load of an
            # untiled [64, 256] buffer for minutes (jax 0.11.2); one load an item, its speed does not matter
            q_smem[...] = plgpu.load(stage, layout=plgpu.Layout.WGMMA, optimized=False)
            plgpu.commit_smem()
            if wgs > 1:  # the other compute warpgroup reads Q (and the feature rows) once they are in place
                plgpu.barrier_arrive(q_ready)

        if wgs > 1:
            pl.when(wg > 0)(lambda: plgpu.barrier_wait(q_ready))
        # this warpgroup's widened K / V tiles (FP8) and P (the interpreter)
        k16_wg, v16_wg = (None, None) if k16 is None else (k16.at[wg], v16.at[wg])
        p_tile = None if p_smem is None else p_smem.at[wg]

        m_i = plgpu.layout_cast(jnp.full((BLOCK_M,), -jnp.inf, jnp.float32), row_layout)
        l_i = plgpu.layout_cast(jnp.full((BLOCK_M,), 0.0, jnp.float32), row_layout)
        acc = plgpu.layout_cast(jnp.full((BLOCK_M, head_dim), 0.0, jnp.float32), plgpu.Layout.WGMMA)

        def iota(shape, dim):
            return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)

        row_token = lax.div(plgpu.broadcasted_iota(jnp.int32, (BLOCK_M,), 0, layout=row_layout), jnp.int32(group))
        q_row = q_first + row_token  # each row's absolute query position

        k_factor = None
        if fp8:  # by row: the factor of the row's token (rows past the request's tokens: its last token's)
            k_factor = plgpu.layout_cast(jnp.zeros((BLOCK_M,), jnp.float32), row_layout)
            for i in range(block_q):
                factor = scales_ref[q_start + jnp.minimum(first + i, q_len - 1)]
                k_factor = jnp.where(row_token == i, factor, k_factor)

        def widen(fp8_tile, tile, row_scales=None):
            """``tile`` (16-bit, swizzled) ← the FP8 tile as stored, for wgmma (which takes no mixed operands): 32-bit
            shared-memory loads of four FP8 values, converted to fp16 in pairs (exact: every e4m3 and e5m2 value is
            an fp16 value), one shuffle into the 16-bit layout. ``row_scales`` (per-token V scales, ``f32[64]`` in
            shared memory): each row times its scale in float32, rounded once to ``tile``'s bf16 (whose exponent
            range is float32's: no scale overflows or underflows it, where fp16 would), one FP8 swizzle tile of
            columns at a time (float32 rows of 256 dims would take 128 registers a thread)."""
            chunks = 1 if row_scales is None else head_dim // fp8_tile_cols(head_dim)
            width = head_dim // chunks
            for c in range(chunks):
                src, dst = (fp8_tile, tile) if chunks == 1 else (fp8_tile.at[:, pl.ds(c * width, width)],
                                                                 tile.at[:, pl.ds(c * width, width)])
                x = plgpu.load(src, layout=plgpu.Layout.WGMMA_UPCAST_2X).astype(jnp.float16)
                x = plgpu.layout_cast(x, plgpu.Layout.WGMMA)
                if row_scales is not None:
                    factor = lax.broadcast_in_dim(plgpu.load(row_scales, layout=row_layout), x.shape, [0])
                    x = (x.astype(jnp.float32) * factor).astype(tile.dtype)
                dst[...] = x
            plgpu.commit_smem()
            return tile

        exp_scale = (mods.softcap if mods.softcap > 0 else scale) * softmax.LOG2E
        slope = None
        if mods.alibi:  # in the units of the scores the exponential's FMA scales (see the Mosaic prefill)
            slope = plgpu.load(feat_smem.at[0], layout=row_layout) * (softmax.LOG2E / exp_scale)

        def key_ok(j, pos, tile_pages):
            """bool (of ``pos``'s shape): the key at absolute position ``pos`` of tile ``j`` may be read."""
            ok = (pos >= key_lo) & (pos < seq_len)
            if len(tile_pages) == 1:
                return ok & tile_pages[0][3]
            copied = functools.reduce(lambda acc, i: acc | jnp.where(tile_pages[i][3], 1 << i, 0),
                                      range(len(tile_pages)), jnp.int32(0))  # bit i: copy i was made
            copy = lax.shift_right_logical(pos - j * BLOCK_N, jnp.int32(copy_rows(block_size).bit_length() - 1))
            return ok & ((lax.shift_right_logical(copied, copy) & 1) == 1)

        def step(j, state, masked: bool):
            acc, m_i, l_i = state
            slot = lax.rem(tile_index(item, base, j), jnp.int32(slots))
            tile_pages = pages(j)
            plgpu.barrier_wait(k_bar.at[slot])
            k_tile = k_smem.at[slot]
            if fp8:  # into 16 bits for wgmma, through registers; the FP8 slot is free again at once
                k_tile = widen(k_tile, k16_wg)
                if per_token:  # each key's scale, by column (read before the slot is refilled)
                    key_scales = plgpu.load(ks_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
                plgpu.barrier_arrive(k_free.at[slot])

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, q_smem, k_tile.transpose((1, 0)))
                return acc_ref[...]

            s = pl.run_scoped(qk, plgpu.ACC((BLOCK_M, BLOCK_N), jnp.float32))
            if not fp8:
                plgpu.barrier_arrive(k_free.at[slot])
            if fp8:  # K scale over the query's power-of-two shift: q · k as the cache means it, in float32
                s = s * lax.broadcast_in_dim(k_factor, s.shape, [0])
                if per_token:  # and each key's own
                    s = s * lax.broadcast_in_dim(key_scales, s.shape, [1])
            # positions as a column and a row vector, broadcast where a score needs them: as two [64, 64] int
            # tiles they held 24 more registers a thread at head dim 64 (docs/performance.md#paged-backends)
            k_col = columns.columns(j * BLOCK_N, BLOCK_N, compiled=compiled)
            k_pos = lax.broadcast_in_dim(k_col, s.shape, [1])
            q_pos = lax.broadcast_in_dim(q_row, s.shape, [0])
            if mods.softcap > 0:  # tanh.approx.f32 (approx_math)
                s = jnp.tanh(s * (scale / mods.softcap))
            if mods.alibi:
                s = s + lax.broadcast_in_dim(slope, s.shape, [0]) * (k_pos - q_pos).astype(jnp.float32)
            if masked:  # causal, window and length edges, pages not copied
                visible = key_ok(j, k_pos, tile_pages) & (k_pos <= q_pos)
                window = mods.window(q_pos, k_pos)
                s = jnp.where(visible if window is None else visible & window, s, -jnp.inf)
            else:  # every key is the request's and every row sees it; a page id outside the pool is still masked
                ok = lax.broadcast_in_dim(key_ok(j, k_col, tile_pages).astype(jnp.int32), s.shape, [1])
                s = jnp.where(ok != 0, s, -jnp.inf)
            m_i, alpha, p16, l_i = softmax.softmax_update_packed(m_i, l_i, s, pv_dtype, 1, scale=exp_scale)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            plgpu.barrier_wait(v_bar.at[slot])
            v_slot = v_smem.at[slot]
            if fp8:
                v_slot = widen(v_slot, v16_wg, vs_smem.at[slot] if per_token else None)
                plgpu.barrier_arrive(v_free.at[slot])
            whole = (j * BLOCK_N >= key_lo) & ((j + 1) * BLOCK_N <= seq_len)
            whole = functools.reduce(lambda w, page: w & page[3], tile_pages, whole)

            @pl.when(jnp.logical_not(whole))
            def _zero_unread_values():  # rows of V the scores masked may hold anything: 0 · NaN is NaN
                v = plgpu.load(v_slot, layout=plgpu.Layout.WGMMA)
                v_slot[...] = jnp.where(key_ok(j, iota(v.shape, 0) + j * BLOCK_N, tile_pages), v, jnp.zeros_like(v))
                plgpu.commit_smem()

            if compiled:  # wgmma into the scaled accumulator itself
                def pv(acc_ref):
                    plgpu.wgmma(acc_ref, p16, v_slot)

                acc = pl.run_state(pv)(plgpu.ACC.init(acc))
            else:  # the interpreter: A from shared memory, a fresh accumulator
                p_tile[...] = p16
                plgpu.commit_smem()

                def pv_fresh(acc_ref):
                    plgpu.wgmma(acc_ref, p_tile, v_slot)
                    return acc_ref[...]

                acc = acc + pl.run_scoped(pv_fresh, plgpu.ACC((BLOCK_M, head_dim), jnp.float32))
            if not fp8:
                plgpu.barrier_arrive(v_free.at[slot])
            return acc, m_i, l_i

        # warpgroup w takes every wgs-th tile of the program's sequence (a slot is released by one warpgroup); the
        # second's state joins the first's through shared memory
        phase = lax.rem(wg - lax.rem(base, jnp.int32(wgs)) + wgs, jnp.int32(wgs))
        state = softmax.kv_loop((acc, m_i, l_i), tile_start, full_end, kv_end, step, full_start, stride=wgs,
                                phase=phase)
        if wgs > 1:
            acc_smem, m_smem, l_smem = merge_smem

            @pl.when(wg == 1)
            def _hand_over():
                acc_smem[...], m_smem[...], l_smem[...] = state
                plgpu.commit_smem()
                plgpu.barrier_arrive(merged)

            @pl.when(wg == 0)
            def _merge_and_finish():
                plgpu.barrier_wait(merged)
                other = (plgpu.load(acc_smem, layout=plgpu.Layout.WGMMA, optimized=False),
                         plgpu.load(m_smem, layout=row_layout), plgpu.load(l_smem, layout=row_layout))
                _finish(softmax.merge_states(state, other))
        else:
            _finish(state)

    @pl.when(wg < wgs)
    def _compute():
        over_items(compute_item)

    @pl.when(wg == wgs)
    def _memory():
        band = (k_band_ref, ks_smem), (v_band_ref, vs_smem)

        def memory_item(item, base):
            _, pages = pages_of(item)

            @pl.loop(item.plan[0], item.plan[3])
            def _load(j):
                t = tile_index(item, base, j)
                slot = lax.rem(t, jnp.int32(slots))
                tile_pages = pages(j)
                for cache, smem, bar, free, (band_ref, scales_smem) in (
                        (k_ref, k_smem, k_bar, k_free, band[0]), (v_ref, v_smem, v_bar, v_free, band[1])):
                    # the slot's previous tile, of this item or an earlier one, has been read
                    pl.when(t >= slots)(functools.partial(plgpu.barrier_wait, free.at[slot]))
                    for i, (page, offset, n, ok) in enumerate(tile_pages):
                        # a page not copied still arrives, with no bytes (a predicated copy, which the interpreter
                        # lacks)
                        pl.when(ok)(functools.partial(plgpu.copy_gmem_to_smem,
                                                      cache.at[page, pl.ds(offset, n), item.kv_head],
                                                      smem.at[slot, pl.ds(i * n, n)], bar.at[slot]))
                        pl.when(jnp.logical_not(ok))(functools.partial(plgpu.barrier_arrive, bar.at[slot]))
                    if per_token:  # the tile's 64 scales, contiguous in the band (a tile the band lacks is all masked)
                        at = jnp.clip(j - band_first_ref[item.b], 0, band_tiles - 1) * BLOCK_N
                        plgpu.copy_gmem_to_smem(band_ref.at[item.b, item.kv_head, pl.ds(at, BLOCK_N)],
                                                scales_smem.at[slot], bar.at[slot])

        total = over_items(memory_item)

        # the releases of the last tiles, which no load waited for (the interpreter wants every arrival observed)
        @pl.loop(jnp.maximum(total - slots, 0), total)
        def _drain(t):
            slot = lax.rem(t, jnp.int32(slots))
            plgpu.barrier_wait(k_free.at[slot])
            plgpu.barrier_wait(v_free.at[slot])


# -------------------------------------------------------------------------------------------- pallas_call
def token_rows(cu_query_lens, cu_blocks, num_tokens: int, num_kv_heads: int, group: int, block_q: int,
                rows_pad: int):
    """``(rows i32[T, Hq], owned bool[T])``: where token ``t``, head ``h`` sits in the flattened
    ``[blocks · Hkv · rows_pad]`` output tiles, and whether a request owns token ``t`` (else a padding row)."""
    req = metadata.token_requests(cu_query_lens, num_tokens)
    b = jnp.maximum(req, 0)
    local = jnp.arange(num_tokens, dtype=jnp.int32) - cu_query_lens[b]
    block = cu_blocks[b] + local // block_q
    heads = jnp.arange(num_kv_heads * group, dtype=jnp.int32)
    kv_head, g = heads // group, heads % group
    rows = ((block[:, None] * num_kv_heads + kv_head[None, :]) * rows_pad
            + (local % block_q)[:, None] * group + g[None, :])
    return jnp.where((req >= 0)[:, None], rows, 0), req >= 0


def paged_attention_mosaic(q, k_cache, v_cache, block_tables, seq_lens, cu_query_lens, alibi_slopes=None, sinks=None,
                           kv_scales=(), *, max_query_len: int, scale: float, plan: Launch, interpret: bool,
                           mods: masks.ScoreMods = masks.NO_MODS, short_plan: Launch | None = None):
    """``(out [T, Hq, D], lse f32[T, Hq])``; arguments validated by :func:`pallas_attn.paged_attention` and
    :func:`supported`, ``cu_query_lens`` clamped (:func:`pallas_attn.core.metadata.clamp_cu`). ``alibi_slopes``
    / ``sinks`` ``f32[Hq]`` exactly when ``mods`` says; ``kv_scales`` an FP8 cache's scales
    (:func:`pallas_attn.core.tiles.kv_scale_args`). Per tensor (``(f32[2],)``: k_scale, v_scale) the kernel runs
    in fp16 whatever q's dtype: each token's query goes in after a power-of-two shift
    (:func:`pallas_attn.core.tiles.query_rows_for_cache`; its inverse joins the K scale on the raw scores), the
    outputs come out in fp16 and the V scale multiplies them once, in float32, on the way to q's dtype. Per token
    and head (the two scale caches ``f32[num_blocks, block_size, Hkv]``, brought by :func:`scale_bands`) the
    scores are the same, each column times its key's scale in float32; each widened V row is multiplied by its
    own scale into bf16 (whose range is float32's), so the probabilities and the output are bf16.

    ``plan``: the launch's splits (``split_size`` a multiple of 64 or None) and whether its programs loop over items.
    ``short_plan``: a batch with prefill chunks (``max_query_len > 16``) runs as two launches, the short queries
    (decode, verification) by ``short_plan`` and the chunks by ``plan``, each request's rows taken from its own
    launch: decodes beside chunks still split their long contexts (as
    :func:`pallas_attn.kernels.triton.paged.launch_splits` decides for the Triton kernel). None: one launch.
    :func:`pallas_attn.ops.paged.mosaic_plan` makes both."""
    reason = supported(q, k_cache)
    if reason is not None:
        raise ValueError(f"the Mosaic paged kernel does not support {reason}")
    for size in (plan.split_size, short_plan.split_size if short_plan else None):
        if size is not None and size % BLOCK_N:
            raise ValueError(f"split_size={size} must be a multiple of the Mosaic paged kernel's {BLOCK_N}-key tiles")
    features = []
    if mods.alibi or mods.sinks:  # per KV head, the 64 tile rows' slopes and sinks (row r: head r % group)
        num_q_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
        group = num_q_heads // num_kv_heads
        heads = jnp.arange(num_kv_heads)[:, None] * group + jnp.arange(BLOCK_M)[None, :] % group
        vectors = [x.astype(jnp.float32) if x is not None else jnp.zeros((num_q_heads,), jnp.float32)
                   for x in (alibi_slopes, sinks)]
        features = [jnp.stack([v[heads] for v in vectors], axis=1)]  # [Hkv, FEATURE_ROWS, 64]
    q_in, v_scale, scale_mode = q, None, tiles.kv_scales_mode(kv_scales)
    if scale_mode is not None:  # fp16 operands (one conversion of the pages), the query shifted into fp16's range
        q, shift = tiles.query_rows_for_cache(q)
        if scale_mode == "tensor":
            (scales,) = kv_scales
            kv_scales, v_scale = (scales[0] / shift,), scales[1]  # [T]: each token's raw scores' factor
        else:
            kv_scales = (1 / shift, *scale_bands(*kv_scales, block_tables, seq_lens, cu_query_lens, q.shape[0],
                                                 mods.window_left))
    launch = functools.partial(_launch, q, k_cache, v_cache, block_tables, seq_lens, cu_query_lens,
                               [*features, *kv_scales], sinks, scale=scale, interpret=interpret, mods=mods,
                               scale_mode=scale_mode)
    if short_plan is None or max_query_len <= SHORT_QUERY_LEN:
        out, lse = launch(max_query_len=max_query_len, plan=plan)
    else:
        short = launch(max_query_len=SHORT_QUERY_LEN, plan=short_plan, query_class="short")
        long = launch(max_query_len=max_query_len, plan=plan, query_class="long")
        q_lens = cu_query_lens[1:] - cu_query_lens[:-1]
        req = metadata.token_requests(cu_query_lens, q.shape[0])
        is_short = (q_lens[jnp.maximum(req, 0)] <= SHORT_QUERY_LEN)[:, None]
        out, lse = jnp.where(is_short[..., None], short[0], long[0]), jnp.where(is_short, short[1], long[1])
    if v_scale is not None:  # once, on the normalised (and merged: merging is linear in it) fp16 output
        out = out.astype(jnp.float32) * v_scale
    return out.astype(q_in.dtype), lse


def _launch(q, k_cache, v_cache, block_tables, seq_lens, cu_query_lens, extra, sinks, *, max_query_len: int,
            scale: float, plan: Launch, interpret: bool, mods: masks.ScoreMods, scale_mode: str | None,
            query_class: str | None = None):
    """One launch over the query blocks of the requests of ``query_class`` ("short": ``q_len <= 16``, "long": the
    others, None: all), its output tiles gathered into ``(out [T, Hq, D], lse f32[T, Hq])``: rows of other
    requests and padding rows 0 and -inf. ``extra``: the kernel's feature rows and FP8 scales (:func:`_kernel`)."""
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs, max_blocks = block_tables.shape
    num_splits, split_size = plan.num_splits, plan.split_size
    group = num_q_heads // num_kv_heads
    block_q = query_block_tokens(max_query_len, group)
    rows_pad = _round_up(block_q * group, ROW_ALIGN)
    q_lens = cu_query_lens[1:] - cu_query_lens[:-1]
    if query_class is None:
        counts, num_blocks = q_lens, num_query_blocks(num_tokens, num_seqs, block_q)
    else:
        short = q_lens <= SHORT_QUERY_LEN
        counts = jnp.where(short if query_class == "short" else ~short, q_lens, 0)
        num_blocks = (num_seqs * pl.cdiv(SHORT_QUERY_LEN, block_q) if query_class == "short"
                      else num_query_blocks(num_tokens, num_seqs, block_q))
    block_req, block_first, cu_blocks = metadata.segment_items((counts + block_q - 1) // block_q, num_blocks)
    block_first = block_first * block_q
    slots, wgs = num_slots(head_dim), compute_wgs(head_dim)
    fp8, per_token = scale_mode is not None, scale_mode == "token"
    pv_dtype = jnp.bfloat16 if per_token else q.dtype  # P, V and the output tiles
    has_features = mods.alibi or mods.sinks

    tiled = dict(transforms=(plgpu.TilingTransform((8, TILE_COLS)), plgpu.SwizzleTransform(SWIZZLE)))
    # FP8 pages land as stored, in swizzled rows of up to 128 values (bytes): the compute warpgroup's 32-bit loads
    # widen them into the 16-bit tiles wgmma reads
    fp8_cols = fp8_tile_cols(head_dim)
    cache_layout = dict(transforms=(plgpu.TilingTransform((8, fp8_cols)), plgpu.SwizzleTransform(fp8_cols))) \
        if fp8 else tiled
    scratch = (
        (plgpu.SMEM((BLOCK_M, head_dim), q.dtype, **tiled),  # Q, then the output tile
         plgpu.SMEM((BLOCK_M, head_dim), q.dtype),  # Q as it lands, untiled: tokens × group rows
         plgpu.SMEM((slots, BLOCK_N, head_dim), k_cache.dtype, **cache_layout),
         plgpu.SMEM((slots, BLOCK_N, head_dim), v_cache.dtype, **cache_layout),
         plgpu.SMEM((BLOCK_M,), jnp.float32),
         plgpu.SMEM((FEATURE_ROWS, BLOCK_M), jnp.float32) if has_features else None,
         plgpu.SMEM((wgs, BLOCK_M, BLOCK_N), pv_dtype, **tiled) if interpret else None,  # P (interpreter)
         # K, V widened, per compute warpgroup (V per token: then the output)
         (plgpu.SMEM((wgs, BLOCK_N, head_dim), q.dtype, **tiled),
          plgpu.SMEM((wgs, BLOCK_N, head_dim), pv_dtype, **tiled)) if fp8 else (None, None),
         (plgpu.SMEM((slots, BLOCK_N), jnp.float32),) * 2 if per_token else (None, None),  # K, V scales by key
         # the second compute warpgroup's state (acc, m, l), handed over for the merge
         (plgpu.SMEM((BLOCK_M, head_dim), jnp.float32), plgpu.SMEM((BLOCK_M,), jnp.float32),
          plgpu.SMEM((BLOCK_M,), jnp.float32)) if wgs > 1 else None),
        (plgpu.Barrier(num_arrivals=block_q + int(has_features)),  # a slot: its copies, and its scales per token
         *[plgpu.Barrier(num_arrivals=BLOCK_N // copy_rows(block_size) + int(per_token), num_barriers=slots)] * 2),
        (plgpu.Barrier(num_barriers=slots),) * 2,
        (plgpu.Barrier(), plgpu.Barrier()) if wgs > 1 else (None, None),  # Q in place; the state handed over
    )
    num_items = num_blocks * num_kv_heads * num_splits
    num_programs = persistent_programs(num_items, head_dim, plan.persistent)
    order = item_order(block_req, block_first, cu_query_lens, seq_lens, num_kv_heads=num_kv_heads,
                       num_programs=num_programs, block_q=block_q, capacity=max_blocks * block_size,
                       num_splits=num_splits, split_size=split_size, mods=mods)
    body = functools.partial(
        _kernel, group=group, block_q=block_q, rows_pad=rows_pad, max_blocks=max_blocks, block_size=block_size,
        slots=slots, num_splits=num_splits, split_size=split_size, scale=scale, mods=mods, scale_mode=scale_mode,
        band_tiles=extra[-1].shape[-1] // BLOCK_N if per_token else 0, wgs=wgs, num_programs=num_programs,
        rounds=order.shape[0] // num_programs, compiled=not interpret)

    def paged_kernel(*refs):
        pl.run_scoped(lambda *s: body(*refs, s), *scratch, collective_axes="wg")

    interpret_params = None
    if interpret:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
        interpret_params = InterpretGPUParams()
    o_tiles, lse_tiles = plgpu.kernel(
        paged_kernel,
        out_type=[jax.ShapeDtypeStruct((num_splits, num_blocks, num_kv_heads, rows_pad, head_dim), pv_dtype),
                  jax.ShapeDtypeStruct((num_splits, num_blocks, num_kv_heads, rows_pad), jnp.float32)],
        grid=(num_programs,), grid_names=("program",),
        num_threads=wgs + 1, thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0),
        interpret=interpret_params,
    )(order, block_req, block_first, cu_query_lens, seq_lens, block_tables.reshape(-1),
      q.reshape(num_tokens, num_kv_heads, group, head_dim), k_cache, v_cache, *extra)

    rows, owned = token_rows(cu_query_lens, cu_blocks, num_tokens, num_kv_heads, group, block_q, rows_pad)
    out_dtype = pv_dtype if num_splits == 1 else jnp.float32  # partials merge in float32
    out = o_tiles.reshape(num_splits, -1, head_dim)[:, rows].astype(out_dtype)
    lse = lse_tiles.reshape(num_splits, -1)[:, rows]
    out = jnp.where(owned[None, :, None, None], out, jnp.zeros((), out_dtype))
    lse = jnp.where(owned[None, :, None], lse, -jnp.inf)
    return softmax.merge_split_outputs(out, lse, num_splits, q.shape, pv_dtype, sinks if num_splits > 1 else None)
