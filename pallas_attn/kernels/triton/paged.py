"""Ragged paged attention: decode, multi-token verification, chunked and fresh prefill in one call.

See docs/design.md#the-ragged-paged-kernel.

Request ``b`` brings ``q_len = cu_query_lens[b+1] - cu_query_lens[b]`` new tokens, already written into the paged
cache as the last ``q_len`` of its ``seq_lens[b]`` keys; ``context_len = seq_lens[b] - q_len``. Query ``i`` sits at
absolute position ``context_len + i`` and sees keys ``<= context_len + i``::

    seq_len = 7, q_len = 3 (context 4)     k0 k1 k2 k3 | k4 k5 k6
                                       q0   ✓  ✓  ✓  ✓ |  ✓  ·  ·      a full [q_len, context] rectangle
                                       q1   ✓  ✓  ✓  ✓ |  ✓  ✓  ·      plus a bottom-right triangle
                                       q2   ✓  ✓  ✓  ✓ |  ✓  ✓  ✓

The grid is ``(q_blocks, num_kv_heads, num_splits)`` with a static number of query blocks
``cdiv(num_tokens, block_q) + num_seqs`` (an upper bound: no host sync, no recompilation per batch). A query
block is ``block_q`` tokens of one request × the whole GQA group (padded to a power of two): those rows are the M
dimension of every dot, so verification reads each K/V tile once for all its draft tokens and heads. Blocks past
the batch's last one write zeros into the padding rows and exit. A batch whose queries are all short (decode,
verification: ``max_query_len <= 16``) is one launch; with prefill chunks in it, short queries run in one launch
with 16-row tiles and the chunks in a second with prefill-sized ones (``chunk_config``), writing into the same
(aliased) output, so decode rows do not pay for prefill-sized tiles. In those 16-row tiles a verification's 6
tokens × 4 heads are two query blocks that read the same K/V (the second read mostly from L2): cheaper on a mixed
batch than 32-row tiles that fit it whole, which halve the resident decode programs
(docs/performance.md#mixed-batches).

Split-KV works for every query length (vLLM's unified kernel turns it off as soon as one query is longer than 1):
long contexts are cut into segments whatever the query length, and merged by
:func:`pallas_attn.merge_attention_states`.

Reference: :func:`pallas_attn.reference.paged_attention`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_attn.core import config as config_lib, masks, metadata, softmax, tiles
from pallas_attn.core.backend import pallas_triton as plgpu  # None without the backend: the ops say so

SHORT_QUERY_LEN = 16  # decode and verification; longer queries are prefill chunks
SHORT_TILE_ROWS = 16  # rows (tokens x padded group) of the short queries' tiles in a two-launch batch: twice the
#                       resident decode programs of 32-row tiles (docs/performance.md#mixed-batches)


# ---------------------------------------------------------------------------------------------------- config
def query_block_tokens(max_query_len: int, group_padded: int, requested: int | None, target_rows: int = 32) -> int:
    """Tokens per query block: the rows (tokens × padded group) make a 16-row tile for decode, up to
    ``target_rows`` rows otherwise (32 for verification, the chunk config's 128 for prefill chunks)."""
    if requested is not None:
        return requested
    tokens = min(config_lib.next_pow2(max(1, max_query_len)), max(1, target_rows // group_padded))
    return max(tokens, max(1, tiles.MIN_DOT_ROWS // group_padded))


def chunk_block_tokens(max_query_len: int, group_padded: int, chunk_cfg: config_lib.DecodeConfig, head_dim: int,
                       dtype_bytes: int) -> int:
    """Tokens per query block of the prefill-chunk launch (:func:`~pallas_attn.core.config.chunk_rows` rows)."""
    return query_block_tokens(max_query_len, group_padded, chunk_cfg.block_q,
                              config_lib.chunk_rows(head_dim, dtype_bytes))


def two_launches(max_query_len: int, cfg: config_lib.DecodeConfig) -> bool:
    """Prefill chunks may be in the batch (and no fixed ``block_q`` asks for one launch): short queries and chunks
    run in separate launches with their own tiles."""
    return max_query_len > SHORT_QUERY_LEN and cfg.block_q is None


def launch_splits(q_shape, dtype_bytes: int, cache_shape, table_shape, max_query_len: int,
                  cfg: config_lib.DecodeConfig,
                  chunk_cfg: config_lib.DecodeConfig, keys: int | None = None) -> tuple[tuple[int, int | None], int]:
    """Split-KV heuristics per launch of a two-launch batch: ``((num_splits, split_size) of the short queries,
    num_splits of the chunks)``.

    Short queries are memory-bound like decode: :func:`~pallas_attn.core.config.resolve_splits` over one program per
    request and KV head (a short request is one query block), tail-balancing included. Chunks are compute-bound:
    they split only when their programs cannot fill the GPU (:func:`~pallas_attn.core.config.choose_num_splits`), never
    for tail balance (their partial states would cost a write and a read of every chunk row). Counting all of a
    mixed batch's tokens as one launch's programs — M1 counts 2,152 — would leave its decodes unsplit. ``keys``:
    the most keys a query block reads (a window's), default the table's capacity.
    """
    num_tokens, num_q_heads, head_dim = q_shape
    _, block_size, num_kv_heads, _ = cache_shape
    num_seqs, max_blocks = table_shape
    capacity = max_blocks * block_size if keys is None else keys
    short = config_lib.resolve_splits(num_seqs * num_kv_heads, capacity, cfg.block_n, None, None)
    long_q = chunk_block_tokens(max_query_len, config_lib.next_pow2(num_q_heads // num_kv_heads), chunk_cfg, head_dim,
                                dtype_bytes)
    chunk_splits = config_lib.choose_num_splits(pl.cdiv(num_tokens, long_q) * num_kv_heads, capacity,
                                                chunk_cfg.block_n)
    return short, chunk_splits


def query_blocks(cu_query_lens, block_q: int, num_blocks: int, query_class: str | None = None):
    """Map each of the static ``num_blocks`` query blocks to ``(request, first local token)``; -1 past the end.

    ``query_class`` "short" (``q_len <= SHORT_QUERY_LEN``) or "long" keeps only that class's requests (the others get
    no block); None keeps all.
    """
    q_lens = cu_query_lens[1:] - cu_query_lens[:-1]
    blocks = (q_lens + block_q - 1) // block_q
    if query_class is not None:
        short = q_lens <= SHORT_QUERY_LEN
        blocks = jnp.where(short if query_class == "short" else ~short, blocks, 0)
    req, index, cu_blocks = metadata.segment_items(blocks, num_blocks)
    # Blocks past the last request zero padding rows: they carry -1 - (their index among padding blocks).
    pad_index = jnp.arange(num_blocks, dtype=jnp.int32) - cu_blocks[-1]
    return jnp.where(req >= 0, req, -1 - pad_index), index * block_q


# ---------------------------------------------------------------------------------------------- kernel body
def _ragged_kernel(
    # inputs
    block_req_ref,  # i32[num_q_blocks]: request of each query block, or -1 - k for the k-th padding block
    block_first_ref,  # i32[num_q_blocks]: first request-local token of the block
    cu_query_lens_ref,  # i32[num_seqs + 1]
    seq_lens_ref,  # i32[num_seqs]
    block_tables_ref,  # i32[num_seqs * max_blocks]
    q_ref,  # [T * Hq, Dp]
    k_ref,  # [num_blocks * block_size * Hkv, Dp]
    v_ref,  # [num_blocks * block_size * Hkv, Dp]
    *refs,  # [alibi_slopes f32[Hq]], [sinks f32[Hq]] (as mods says), [FP8 scales: tiles.kv_scales], [merge inputs],
    #         [o_prev, lse_prev (aliased to the outputs: a second pass fills in its rows)], o, lse
    zero_padding: bool, compact: bool, merge: tuple | None, num_seqs: int, num_tokens: int, num_q_heads: int,
    num_kv_heads: int, head_dim: int, group_padded: int, block_q: int, max_blocks: int, block_size: int,
    block_n: int, num_splits: int, split_size: int | None, scale: float, mods: masks.ScoreMods, precision,
    kv_scales_mode: str | None, fp8: str | None, compiled: bool,
):
    """``compact``: write f32 partial states tile by tile into ``[num_splits, num_q_blocks, Hkv, M, Dp]`` (a later
    launch merges them) instead of token rows. ``merge = (merge_blocks, merge_block_q, merge_splits)``: program
    ``(i, h)`` also merges the compact partials of the earlier launch's query block ``i``, head ``h``, into the
    output rows (axis 0 is ``max(num_q_blocks, merge_blocks)`` long: the programs that exist anyway; separate merge
    programs measured the same on M1). The merge inputs are that launch's ``block_req, block_first`` and its partial
    ``o, lse``. Sinks join the denominator where a row's state is complete: here when the launch is unsplit, in
    the merge of compact partials, or in :func:`~pallas_attn.core.softmax.merge_split_outputs`."""
    refs = list(refs)
    slopes_ref = refs.pop(0) if mods.alibi else None
    sinks_ref = refs.pop(0) if mods.sinks else None
    scale, v_scale, token_scales = tiles.kv_scales(refs, kv_scales_mode, scale)
    o_ref, lse_ref = refs[-2:]  # [T * Hq, Dp] or [num_splits * T * Hq, Dp] (f32 partials); f32[...] LSE
    p, kv_head, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    num_q_blocks = block_req_ref.shape[0]
    group = num_q_heads // num_kv_heads
    padded = q_ref.shape[-1]
    cols = tiles.Cols(head_dim, padded)  # q, and the output rows of merges and zeroed padding
    # attention output columns: an FP8 cache's pages are uint16 pairs of dims (tiles.as_fp8_pairs) and the output
    # then comes as its even and odd dims (tiles.paged_kv_step)
    out_cols = tiles.pair_cols(head_dim, padded) if fp8 else cols
    kv_cols = tiles.Cols(head_dim // 2, padded // 2) if fp8 else cols
    r = jnp.arange(block_q * group_padded)
    tok_in_block = r // group_padded
    g = r % group_padded
    out_base = split * num_tokens * num_q_heads
    req = block_req_ref[jnp.minimum(p, num_q_blocks - 1)]
    # Masked rows get distinct out-of-range indices (see tiles.store_rows).
    oob = num_tokens * num_q_heads + r
    head_vector = lambda ref: tiles.load_vector(ref, kv_head * group + g, g < group) * softmax.LOG2E  # noqa: E731

    if merge is not None:
        @pl.when(p < merge[0])
        def _merge():
            _merge_partials(p, kv_head, cu_query_lens_ref, *refs[:4], o_ref, lse_ref, cols=cols,
                            merge=merge, num_tokens=num_tokens, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                            group_padded=group_padded, sinks_ref=sinks_ref)

    @pl.when((req >= 0) & (p < num_q_blocks))
    def _attend():
        first = block_first_ref[p]
        q_start, q_len, seq_len, context, tok = tiles.query_block_frame(
            cu_query_lens_ref, seq_lens_ref, req, first, tok_in_block, max_blocks * block_size)
        row_valid = (tok < q_len) & (g < group)
        q_rows = jnp.where(row_valid, (q_start + tok) * num_q_heads + kv_head * group + g, oob)
        # [M, Dp] in the dims' order, also over an FP8 cache: its key tiles are then joined back for one dot, measured
        # faster here than even and odd dims (docs/performance.md#fp8-kv-caches)
        q = tiles.load_rows(q_ref, q_rows, cols, row_valid)
        q, score_scale = tiles.query_for_cache(q, fp8, scale)
        q_pos = context + tok  # absolute positions: the rectangle + triangle of verification
        q_last = context + jnp.minimum(first + block_q, q_len) - 1
        num_pages = k_ref.shape[0] // (block_size * num_kv_heads)

        guarded = tiles.page_guard(block_tables_ref, req * max_blocks, block_size, num_pages, max_blocks)
        tile_start, full_start, full_end, kv_end, kv_first = tiles.paged_tile_plan(
            context + first, q_last, seq_len, block_n, split, num_splits, split_size, mods, guarded=guarded)
        dot = functools.partial(jnp.dot, preferred_element_type=jnp.float32, precision=precision)
        step = tiles.paged_kv_step(q, q_pos, k_ref, v_ref, block_tables_ref, req * max_blocks, seq_len, kv_head,
                                   cols=kv_cols, block_n=block_n, block_size=block_size, num_kv_heads=num_kv_heads,
                                   num_pages=num_pages, scale=score_scale, dot=dot, mods=mods,
                                   slope2=head_vector(slopes_ref) if mods.alibi else None,
                                   kv_first=kv_first, fp8=fp8, compiled=compiled,
                                   token_scales=token_scales)
        state = softmax.kv_loop(softmax.init_state(r.shape[0], padded // 2 if fp8 else padded, 2 if fp8 else 1),
                                tile_start, full_end, kv_end, step, full_start)
        # split partials (compact or not) leave the sink to their merge
        sink2 = head_vector(sinks_ref) if mods.sinks and num_splits == 1 else None
        out, lse = softmax.finalize(state, sink2)
        if v_scale is not None:  # before any merge: merging is linear in the outputs
            out = jax.tree.map(lambda o: o * v_scale, out)
        if compact:  # the whole tile, invalid rows included: the merge reads only valid ones
            rows = ((split * num_q_blocks + p) * num_kv_heads + kv_head) * r.shape[0] + r
            tiles.store_parts(o_ref, rows, out_cols, out)
            tiles.store_vector(lse_ref, rows, lse)
        else:
            tiles.store_parts(o_ref, out_base + q_rows, out_cols, out, row_valid)
            tiles.store_vector(lse_ref, out_base + q_rows, lse, row_valid)

    if not zero_padding:  # a later pass: the first one zeroed the padding rows
        return

    @pl.when((req < 0) & (p < num_q_blocks))
    def _zero_padding():  # rows no request owns, [0, cu[0]) and [cu[-1], T): zeros and -inf, no second pass
        pad_block = -1 - req
        num_pad_blocks = num_q_blocks - (p - pad_block)
        stride = num_pad_blocks * block_q

        def zero_rows(first, end):
            def zero(i, carry):
                tok = first + i * stride + tok_in_block
                valid = (tok < end) & (g < group)
                rows = out_base + jnp.where(valid, tok * num_q_heads + kv_head * group + g, oob)
                tiles.store_rows(o_ref, rows, cols, jnp.zeros((r.shape[0], q_ref.shape[-1]), jnp.float32), valid)
                tiles.store_vector(lse_ref, rows, jnp.full(r.shape, -jnp.inf, jnp.float32), valid)
                return carry

            jax.lax.fori_loop(0, pl.cdiv(jnp.maximum(end - first, 0), stride), zero, 0)

        # cu_query_lens is clamped (metadata.clamp_cu): both ranges lie inside [0, T)
        zero_rows(pad_block * block_q, cu_query_lens_ref[0])
        zero_rows(cu_query_lens_ref[num_seqs] + pad_block * block_q, num_tokens)


def _merge_partials(i, kv_head, cu_query_lens_ref, block_req_ref, block_first_ref, part_o_ref, part_lse_ref,
                    o_ref, lse_ref, *, cols, merge: tuple, num_tokens: int, num_q_heads: int, num_kv_heads: int,
                    group_padded: int, sinks_ref=None):
    """Merge the ``merge_splits`` compact partial states of query block ``i`` (of the launch that wrote them) into
    its output rows: the split-KV reduction for the rows of one launch, run by programs of the next one. Sinks
    (``sinks_ref f32[Hq]``) join the merged rows' denominators, once."""
    merge_blocks, block_q, num_splits = merge
    req = block_req_ref[i]
    r = jnp.arange(block_q * group_padded)
    group = num_q_heads // num_kv_heads

    @pl.when(req >= 0)
    def _():
        q_start = cu_query_lens_ref[req]
        tok = block_first_ref[i] + r // group_padded
        g = r % group_padded
        row_valid = (tok < cu_query_lens_ref[req + 1] - q_start) & (g < group)
        rows = jnp.where(row_valid, (q_start + tok) * num_q_heads + kv_head * group + g, num_tokens * num_q_heads + r)
        tile = lambda s: ((s * merge_blocks + i) * num_kv_heads + kv_head) * r.shape[0] + r  # noqa: E731
        out, lse = softmax.fold_split_states(
            num_splits, lambda s: tiles.load_vector(part_lse_ref, tile(s)),
            lambda s: tiles.load_rows(part_o_ref, tile(s), cols), r.shape, (r.shape[0], part_o_ref.shape[-1]),
            loop=lambda n, body, init: jax.lax.fori_loop(0, n, body, init))
        if sinks_ref is not None:
            out = softmax.apply_sink(out, lse, tiles.load_vector(sinks_ref, kv_head * group + g, g < group))
        tiles.store_rows(o_ref, rows, cols, out, row_valid)
        tiles.store_vector(lse_ref, rows, lse, row_valid)


# -------------------------------------------------------------------------------------------- pallas_call
def ragged_paged_triton(q, k_cache, v_cache, block_tables, seq_lens, cu_query_lens, alibi_slopes=None, sinks=None,
                        kv_scales=(), *,
                        max_query_len, scale, num_splits, split_size, interpret, cfg: config_lib.DecodeConfig,
                        chunk_cfg: config_lib.DecodeConfig, short_splits: tuple[int, int | None] | None = None,
                        short_rows: int = SHORT_TILE_ROWS, mods: masks.ScoreMods = masks.NO_MODS):
    """One launch when every query is short (decode / verification) or ``config.block_q`` is fixed; otherwise two
    launches into one output — short queries in small tiles under ``cfg``, prefill chunks in prefill-sized tiles
    under ``chunk_cfg`` — so decode rows do not pay for 128-row tiles and chunks do not run at decode intensity.
    The second launch aliases the first one's output and writes only its own rows.

    ``short_splits = (num_splits, split_size)`` (two launches, the chunks unsplit: ``num_splits == 1``) splits the
    short queries' launch on its own: it writes compact partial states and the chunk launch's programs merge them
    into the output rows, so the chunk rows never go through a split buffer or the merge. ``alibi_slopes`` /
    ``sinks`` ``f32[Hq]`` exactly when ``mods`` says; ``kv_scales`` with an FP8 cache as
    :func:`pallas_attn.kernels.triton.decode.paged_decode_triton`'s."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs, max_blocks = block_tables.shape
    group_padded = config_lib.next_pow2(num_q_heads // num_kv_heads)
    padded = config_lib.next_pow2(head_dim)
    cache_rows = num_blocks * block_size * num_kv_heads
    fp8 = tiles.fp8_format(k_cache.dtype)
    kv_width = padded // 2 if fp8 else padded
    if fp8:
        k_cache, v_cache = tiles.as_fp8_pairs(k_cache), tiles.as_fp8_pairs(v_cache)
    # pass: (block_q, num_q_blocks, query class, config, (num_splits, split_size), compact partial output)
    if not two_launches(max_query_len, cfg):
        block_q = query_block_tokens(max_query_len, group_padded, cfg.block_q)
        passes = [(block_q, pl.cdiv(num_tokens, block_q) + num_seqs, None, cfg, (num_splits, split_size), False)]
    else:
        short_q = query_block_tokens(SHORT_QUERY_LEN, group_padded, None, target_rows=short_rows)
        long_q = chunk_block_tokens(max_query_len, group_padded, chunk_cfg, head_dim, q.dtype.itemsize)
        compact = short_splits is not None and short_splits[0] > 1
        if compact and num_splits != 1:
            raise ValueError(f"short_splits needs an unsplit chunk launch, got {num_splits=}")
        passes = [(short_q, num_seqs * pl.cdiv(SHORT_QUERY_LEN, short_q) + 1, "short", cfg,  # + 1 zeroes padding
                   short_splits if compact else (num_splits, split_size), compact),
                  (long_q, pl.cdiv(num_tokens, long_q) + num_seqs, "long", chunk_cfg, (num_splits, split_size), False)]

    full = lambda n, w=padded: pl.BlockSpec((n, w), lambda *_: (0, 0))  # noqa: E731
    vec = lambda n: pl.BlockSpec((n,), lambda *_: (0,))  # noqa: E731
    features = [x.astype(jnp.float32) for x in (alibi_slopes, sinks) if x is not None]
    features += [x.reshape(-1).astype(jnp.float32) for x in kv_scales]
    args = (cu_query_lens, seq_lens, block_tables.reshape(-1), q.reshape(-1, head_dim),
            k_cache.reshape(cache_rows, -1), v_cache.reshape(cache_rows, -1), *features)
    prev, merge_in = (), None  # the last launch's token-row outputs; compact partials awaiting their merge
    for block_q, num_q_blocks, query_class, pass_cfg, (splits, size), compact in passes:
        rows_per_tile = block_q * group_padded
        out_rows = (splits * num_q_blocks * num_kv_heads * rows_per_tile if compact
                    else (splits if splits > 1 else 1) * num_tokens * num_q_heads)
        block_req, block_first = query_blocks(cu_query_lens, block_q, num_q_blocks, query_class)
        merge = None
        in_specs = [vec(num_q_blocks), vec(num_q_blocks), vec(num_seqs + 1), vec(num_seqs),
                    vec(num_seqs * max_blocks), full(num_tokens * num_q_heads), full(cache_rows, kv_width),
                    full(cache_rows, kv_width)]
        in_specs += [vec(f.shape[0]) for f in features]
        extra = []
        if merge_in is not None:
            m_req, m_first, m_o, m_lse, merge = merge_in
            in_specs += [vec(m_req.shape[0]), vec(m_req.shape[0]), full(m_o.shape[0]), vec(m_lse.shape[0])]
            extra += [m_req, m_first, m_o, m_lse]
        if prev:
            in_specs += [full(prev[0].shape[0]), vec(prev[1].shape[0])]
        kernel = functools.partial(
            _ragged_kernel, zero_padding=not compact and not prev, compact=compact, merge=merge, num_seqs=num_seqs,
            num_tokens=num_tokens, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
            group_padded=group_padded, block_q=block_q, max_blocks=max_blocks, block_size=block_size,
            block_n=pass_cfg.block_n, num_splits=splits, split_size=size, scale=scale, mods=mods,
            precision=tiles.dot_precision(q.dtype), kv_scales_mode=tiles.kv_scales_mode(kv_scales), fp8=fp8,
            compiled=not interpret)
        outs = pl.pallas_call(
            kernel,
            grid=(max(num_q_blocks, merge[0] if merge else 0), num_kv_heads, splits),
            in_specs=in_specs,
            out_specs=[full(out_rows), vec(out_rows)],
            out_shape=[jax.ShapeDtypeStruct((out_rows, head_dim), jnp.float32 if splits > 1 else q.dtype),
                       jax.ShapeDtypeStruct((out_rows,), jnp.float32)],
            input_output_aliases={len(in_specs) - 2: 0, len(in_specs) - 1: 1} if prev else {},
            compiler_params=plgpu.CompilerParams(num_warps=pass_cfg.num_warps, num_stages=pass_cfg.num_stages),
            interpret=interpret,
            name=f"ragged_paged_d{head_dim}_bs{block_size}_q{block_q}" + ("_split" if splits > 1 else "")
            + ("_merge" if merge else ""),
        )(block_req, block_first, *args, *extra, *prev)
        if compact:
            merge_in = (block_req, block_first, *outs, (num_q_blocks, block_q, splits))
        else:
            prev = tuple(outs)
    out, lse = prev
    return softmax.merge_split_outputs(out, lse, num_splits, q.shape, q.dtype, sinks if num_splits > 1 else None)
