"""``paged_attention``: decode, verification, chunked and fresh prefill in one call over a paged cache —
validation, split choice per launch, the jitted public function.

Kernels: :mod:`pallas_attn.kernels.triton.paged` and :mod:`pallas_attn.kernels.mosaic.paged` (Hopper).
Reference: :func:`pallas_attn.reference.paged_attention`.
"""

from __future__ import annotations

import functools

import jax
from jax.experimental import pallas as pl

from pallas_attn.core import backend as backend_lib, config as config_lib, masks, metadata, tiles, validation
from pallas_attn.kernels.mosaic import paged as mosaic_paged
from pallas_attn.kernels.triton import paged as triton_paged
from pallas_attn.ops import common

_OPTIONAL_INT = functools.partial(validation.check_static_int, optional=True)
_OPTIONAL_BOOL = functools.partial(validation.check_static_bool, optional=True)


def _validate(q, k_cache, v_cache, block_tables, seq_lens, cu_query_lens, k_scale, v_scale) -> str | None:
    """The rules of the arguments' shapes and dtypes; an FP8 cache's scale mode ("tensor", "token"), else None."""
    validation.check_paged_kv(q, k_cache, v_cache, block_tables, "[num_tokens, num_q_heads, head_dim]")
    scale_mode = validation.check_kv_scales(k_cache, v_cache, k_scale, v_scale)
    num_seqs = block_tables.shape[0]
    validation.check_int32("seq_lens", seq_lens)
    validation.check_shape("seq_lens", seq_lens, (num_seqs,), "i32[num_seqs] with num_seqs = block_tables.shape[0]")
    validation.check_int32("cu_query_lens", cu_query_lens)
    validation.check_shape("cu_query_lens", cu_query_lens, (num_seqs + 1,),
                           "i32[num_seqs + 1] with num_seqs = block_tables.shape[0]")
    return scale_mode


def mosaic_unsupported(q, k_cache, split_size: int | None) -> str | None:
    """None when the Mosaic paged kernel (:mod:`pallas_attn.kernels.mosaic.paged`) takes these arguments, else the
    reason it does not; :func:`pallas_attn.paged_decode_attention` shares the rule."""
    reason = mosaic_paged.supported(q, k_cache)
    if reason is None and split_size is not None and split_size % mosaic_paged.BLOCK_N:
        reason = f"{split_size=} (a multiple of its {mosaic_paged.BLOCK_N}-key tiles)"
    return reason


def select_backend(function: str, backend: str | None, q, k_cache, split_size: int | None, *configs) -> str:
    """The backend of a paged call: the Triton kernel by default while JAX ships it (on the model grid the Mosaic
    kernel leads on a few long launches and trails on short ones and over FP8 pages, with no static rule between them:
    docs/performance.md#the-backends-across-the-model-grid), the Mosaic kernel where asked or where the Pallas Triton
    backend is gone (:func:`pallas_attn.core.backend.select_backend`). ``configs`` tune the Triton kernel: one
    given picks it, and ``backend="mosaic"`` with one raises ``ValueError``."""
    given = next((c for c in configs if c is not None), None)
    return backend_lib.select_backend(backend, config=given, default=lambda: "triton",
                                      mosaic_unsupported=lambda: mosaic_unsupported(q, k_cache, split_size),
                                      function=function)


def keys_read(block_tables, k_cache, mods: masks.ScoreMods, block_tokens: int, block_n: int) -> int:
    """The most keys, in whole ``block_n``-key tiles, that one query block of ``block_tokens`` tokens reads: the
    table's capacity, or with a left window its rows' window (``left + block_tokens - 1`` keys before its last row)
    and the two tiles it may straddle at its ends. Split-KV counts its segments from the window's first tile
    (:func:`pallas_attn.core.tiles.split_tile_range`), so ``cdiv(keys, split_size)`` of them cover every key read;
    the split heuristics cap their counts by it."""
    keys = block_tables.shape[1] * k_cache.shape[1]
    if mods.window_left >= 0:
        keys = min(keys, mods.window_left + block_tokens + 2 * block_n)
    return keys


@common.front(arrays=("q", "k_cache", "v_cache", "alibi_slopes", "sinks"),
              int_arrays=("block_tables", "seq_lens", "cu_query_lens"),
              statics=dict(max_query_len=validation.check_static_int, softmax_scale=validation.check_softmax_scale,
                           window_size=validation.check_window_size, softcap=validation.check_softcap,
                           num_splits=_OPTIONAL_INT, split_size=_OPTIONAL_INT,
                           return_lse=validation.check_static_bool, interpret=_OPTIONAL_BOOL),
              scalars=dict(k_scale=validation.check_kv_scale, v_scale=validation.check_kv_scale))
@functools.partial(jax.jit, static_argnames=("max_query_len", "softmax_scale", "window_size", "softcap", "num_splits",
                                             "split_size", "return_lse", "interpret", "config", "chunk_config",
                                             "backend"))
def paged_attention(q, k_cache, v_cache, block_tables, seq_lens, cu_query_lens, *, max_query_len: int,
                    softmax_scale: float | None = None, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                    alibi_slopes=None, sinks=None, k_scale=None, v_scale=None, num_splits: int | None = None,
                    split_size: int | None = None, return_lse: bool = False, interpret: bool | None = None,
                    config: config_lib.DecodeConfig | None = None, chunk_config: config_lib.DecodeConfig | None = None,
                    backend: str | None = None):
    """Mixed batch of decode / verification / chunked-prefill / prefill requests over a paged K/V cache.

    Args:
      q: ``[num_tokens, num_q_heads, head_dim]`` packed new tokens; rows at or past ``cu_query_lens[-1]`` are
        padding (output 0, LSE -inf).
      k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``; the new tokens' K/V are already written
        (see :func:`pallas_attn.write_kv_cache`). Pages, head dims and FP8 caches as
        :func:`pallas_attn.paged_decode_attention`.
      block_tables: ``i32[num_seqs, max_blocks]``; entries past a request's last page are never read.
      seq_lens: ``i32[num_seqs]`` keys of each request, its new tokens included.
      cu_query_lens: ``i32[num_seqs + 1]`` cumulative new-token counts (``q_len`` may be 0).
      max_query_len: static Python int >= 1 bounding ``q_len`` (bucketed); picks the query block size.
      softmax_scale: None (``1/sqrt(head_dim)``) or a finite Python float > 0.
      window_size, softcap, alibi_slopes, sinks: as :func:`pallas_attn.varlen_attention`, on absolute positions
        (query ``i`` of a request sits at ``seq_lens[b] - q_len + i``). With a left window a query block reads and
        splits only its window's keys, and pages wholly before its first query's window may already be freed
        (their table entries are never read). Sinks are applied once per row, after any split-KV merge.
      k_scale, v_scale: an FP8 cache's scales, as :func:`pallas_attn.paged_decode_attention`.
      num_splits / split_size: split-KV as in :func:`pallas_attn.paged_decode_attention`, for any ``q_len``.
      return_lse: also return ``f32[num_tokens, num_q_heads]``.
      interpret: None → compiled on GPU, interpreted on CPU.
      config: :class:`pallas_attn.core.config.DecodeConfig` (``block_q`` = tokens per query block) for decode and
        verification rows; a fixed ``block_q`` runs the whole batch in one launch with it.
      chunk_config: the same for prefill chunks (``q_len > 16``) of a mixed batch, which run in a second launch with
        prefill-sized tiles; default :func:`pallas_attn.core.config.default_chunk_config`.
      backend: "triton" or "mosaic": the Hopper kernel of :mod:`pallas_attn.kernels.mosaic.paged` (64-row query
        blocks, 64-key tiles, TMA page copies; bf16 / fp16 queries over a cache of q's dtype or FP8 (either
        scale mode), head dims 64, 128, 256, page sizes 8 or a multiple of 16,
        ``split_size`` a multiple of 64 — anything else raises ``ValueError`` naming it; interpreted on CPU by the
        Mosaic GPU interpreter). None: the Triton kernel while JAX ships its backend (or a config is given), else
        the Mosaic kernel where it applies.

    Returns:
      ``out [num_tokens, num_q_heads, head_dim]`` in q's dtype (and ``lse``). No tokens, no request
      (``cu_query_lens == [0]``: every row is padding), ``max_blocks == 0`` or an empty page pool give zeros (LSE
      -inf) without a kernel. Array arguments may be numpy arrays or lists (converted; integer lists to int32).
      No backward pass: ``jax.grad`` raises ``NotImplementedError``.

    Example:
      >>> md = build_metadata(query_lens=[1, 6, 512], context_lens=[900, 4000, 0], block_size=16)
      >>> out = paged_attention(q, k_cache, v_cache, md.block_tables, md.seq_lens, md.cu_query_lens,
      ...                       max_query_len=md.max_query_len)
    """
    scale_mode = _validate(q, k_cache, v_cache, block_tables, seq_lens, cu_query_lens, k_scale, v_scale)
    for name, x in (("alibi_slopes", alibi_slopes), ("sinks", sinks)):
        if x is not None:
            validation.check_head_vector(name, x, q.shape[1])
    mods = masks.ScoreMods(*window_size, softcap, alibi_slopes is not None, sinks is not None)
    cu_query_lens = metadata.clamp_cu(cu_query_lens, q.shape[0])  # whatever it holds, requests stay disjoint
    backend = select_backend("paged_attention", backend, q, k_cache, split_size, config, chunk_config)
    interpret = backend_lib.resolve_interpret(interpret)
    scale = float(softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5)
    if backend == "mosaic":
        return _mosaic(q, k_cache, v_cache, block_tables, seq_lens, cu_query_lens, alibi_slopes, sinks,
                       max_query_len=max_query_len, scale=scale, mods=mods, num_splits=num_splits,
                       split_size=split_size, return_lse=return_lse, interpret=interpret,
                       kv_scales=tiles.kv_scale_args(scale_mode, k_scale, v_scale))
    cfg = config or config_lib.default_decode_config(q.shape[-1], k_cache.shape[1], q.dtype.itemsize)
    chunk_cfg = chunk_config or config_lib.default_chunk_config(q.shape[-1], k_cache.shape[1], q.dtype.itemsize)
    group_padded = config_lib.next_pow2(q.shape[1] // k_cache.shape[2])
    block_q = triton_paged.query_block_tokens(max_query_len, group_padded, cfg.block_q)
    two_pass = triton_paged.two_launches(max_query_len, cfg)
    # Fixed split_size segments must be whole tiles of both passes (block_n are powers of two: the max divides).
    split_block_n = max(cfg.block_n, chunk_cfg.block_n) if two_pass else cfg.block_n
    if split_size is not None and two_pass and split_size % split_block_n:
        raise ValueError(f"{split_size=} must be a multiple of both passes' KV tiles (config.block_n={cfg.block_n}, "
                         f"chunk_config.block_n={chunk_cfg.block_n}) when max_query_len={max_query_len} > "
                         f"{triton_paged.SHORT_QUERY_LEN}; pass a larger split_size or a chunk_config with a smaller "
                         f"block_n")
    block_tokens = block_q
    if two_pass:  # the prefill chunks' blocks
        block_tokens = max(block_q, triton_paged.chunk_block_tokens(max_query_len, group_padded, chunk_cfg,
                                                                    q.shape[-1], q.dtype.itemsize))
    keys = keys_read(block_tables, k_cache, mods, block_tokens, max(cfg.block_n, chunk_cfg.block_n))
    short_splits = None
    if two_pass and num_splits is None and split_size is None:
        short_splits, chunk_splits = triton_paged.launch_splits(q.shape, q.dtype.itemsize, k_cache.shape,
                                                                block_tables.shape, max_query_len, cfg, chunk_cfg, keys)
    if short_splits is not None and chunk_splits == 1:
        splits = 1
    else:  # one launch, a split size given, or chunks that split: one split plan for every row
        short_splits = None
        work_blocks = max(block_tables.shape[0], pl.cdiv(q.shape[0], block_q))
        splits, split_size = config_lib.resolve_splits(work_blocks * k_cache.shape[2], keys, split_block_n,
                                                       num_splits, split_size)
    if 0 in (q.shape[0], block_tables.shape[0], block_tables.shape[1], k_cache.shape[0]):
        return common.no_rows(*q.shape, q.dtype, return_lse)  # no token, request or page: no key, no kernel
    run = functools.partial(triton_paged.ragged_paged_triton, max_query_len=max_query_len, scale=scale,
                            num_splits=splits, split_size=split_size, interpret=interpret,
                            cfg=cfg, chunk_cfg=chunk_cfg, short_splits=short_splits, mods=mods)
    kv_scales = tiles.kv_scale_args(scale_mode, k_scale, v_scale)
    out, lse = common.no_backward("paged_attention", run)(q, k_cache, v_cache, block_tables, seq_lens,
                                                          cu_query_lens, alibi_slopes, sinks, kv_scales)
    return (out, lse) if return_lse else out


def mosaic_plan(q, k_cache, block_tables, mods: masks.ScoreMods, *, max_query_len: int, num_splits: int | None,
                split_size: int | None) -> tuple[mosaic_paged.Launch, mosaic_paged.Launch | None]:
    """``(plan, short_plan)``: the Mosaic paged kernel's static launch plans (arguments: arrays or
    ``jax.ShapeDtypeStruct``; only shapes are read). Short queries alone: one launch, the heuristic over its query
    blocks × KV heads, its segments rounded to a power of two (one program an SM runs in waves of the SMs:
    docs/performance.md#split-kv-heuristic); ``short_plan`` None. With prefill chunks and no split given: two
    launches, decided apart as the Triton kernel's are (short queries like decode, ``short_plan``; chunks only when
    their programs cannot fill the GPU); a split given: one plan for both. Each launch's query blocks × KV heads
    decide at once whether its programs loop over items (:func:`~pallas_attn.kernels.mosaic.paged.persistent`) and
    its splits: looping programs, dealt items longest first, balance the batch's tail themselves, so they take no
    tail-balance segments (those only add partials to merge: docs/performance.md#persistent-programs)."""
    block_n, head_dim = mosaic_paged.BLOCK_N, q.shape[-1]
    num_seqs, num_kv_heads = block_tables.shape[0], k_cache.shape[2]
    block_q = mosaic_paged.query_block_tokens(max_query_len, q.shape[1] // num_kv_heads)  # the largest launch's
    keys = keys_read(block_tables, k_cache, mods, block_q, block_n)

    def plan(blocks: int, given_splits, given_size) -> mosaic_paged.Launch:
        loop = mosaic_paged.persistent(head_dim, blocks * num_kv_heads)
        splits, size = config_lib.resolve_splits(blocks * num_kv_heads, keys, block_n, given_splits, given_size,
                                                 pow2_segments=True, tail_balance=not loop)
        return mosaic_paged.Launch(splits, size, loop)

    if max_query_len > mosaic_paged.SHORT_QUERY_LEN and num_splits is None and split_size is None:
        chunk_blocks = pl.cdiv(q.shape[0], block_q)
        splits = config_lib.choose_num_splits(chunk_blocks * num_kv_heads, keys, block_n)
        loop = mosaic_paged.persistent(head_dim, chunk_blocks * num_kv_heads)
        return mosaic_paged.Launch(splits, None, loop), plan(num_seqs, None, None)
    return plan(max(num_seqs, pl.cdiv(q.shape[0], block_q)), num_splits, split_size), None


def _mosaic(q, k_cache, v_cache, block_tables, seq_lens, cu_query_lens, alibi_slopes, sinks, *, max_query_len: int,
            scale: float, mods: masks.ScoreMods, num_splits: int | None, split_size: int | None, return_lse: bool,
            interpret: bool, kv_scales: tuple = (), name: str = "paged_attention"):
    """The Mosaic kernel's call, shared with :func:`pallas_attn.paged_decode_attention`: its plan
    (:func:`mosaic_plan`), then the kernel."""
    plan, short_plan = mosaic_plan(q, k_cache, block_tables, mods, max_query_len=max_query_len,
                                   num_splits=num_splits, split_size=split_size)
    if 0 in (q.shape[0], block_tables.shape[0], block_tables.shape[1], k_cache.shape[0]):
        return common.no_rows(*q.shape, q.dtype, return_lse)  # no token, request or page: no key, no kernel
    run = functools.partial(mosaic_paged.paged_attention_mosaic, max_query_len=max_query_len, scale=scale,
                            plan=plan, interpret=interpret, mods=mods, short_plan=short_plan)
    out, lse = common.no_backward(name, run)(q, k_cache, v_cache, block_tables, seq_lens, cu_query_lens,
                                             alibi_slopes, sinks, kv_scales)
    return (out, lse) if return_lse else out
