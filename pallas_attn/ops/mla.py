"""``mla_attention``: dense MLA decode and multi-token steps over a paged latent cache — validation, split choice,
the jitted public function.

Kernels: :mod:`pallas_attn.kernels.triton.mla`, and on Hopper the Mosaic GPU kernel of
:mod:`pallas_attn.kernels.mosaic.sparse_mla` walking every position (:func:`~pallas_attn.kernels.mosaic.sparse_mla.
dense_mla_mosaic`). Reference: :func:`pallas_attn.reference.mla_attention`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_attn.core import backend as backend_lib, config as config_lib, metadata, softmax, validation
from pallas_attn.kernels.mosaic import sparse_mla as mosaic_mla
from pallas_attn.kernels.triton import mla as triton_mla, paged as triton_paged
from pallas_attn.ops import common

_OPTIONAL_INT = functools.partial(validation.check_static_int, optional=True)
_OPTIONAL_BOOL = functools.partial(validation.check_static_bool, optional=True)


def _validate(q, kv_cache, block_tables, seq_lens, cu_query_lens, kv_lora_rank, max_query_len):
    validation.check_latent_cache(q, kv_cache, block_tables, kv_lora_rank, fp8=True)
    num_seqs = block_tables.shape[0]
    validation.check_int32("seq_lens", seq_lens)
    validation.check_shape("seq_lens", seq_lens, (num_seqs,), "i32[num_seqs] with num_seqs = block_tables.shape[0]")
    if cu_query_lens is None:
        if num_seqs != q.shape[0]:
            raise ValueError(f"without cu_query_lens every token is its own request (decode): block_tables must be "
                             f"i32[num_tokens={q.shape[0]}, max_blocks]; got {tuple(block_tables.shape)}")
    else:
        validation.check_int32("cu_query_lens", cu_query_lens)
        validation.check_shape("cu_query_lens", cu_query_lens, (num_seqs + 1,),
                               "i32[num_seqs + 1] with num_seqs = block_tables.shape[0]")
    if max_query_len < 1:
        raise ValueError(f"{max_query_len=} must be >= 1 (a static bound on the new tokens of a request)")


def _mosaic_unsupported(q, kv_cache, kv_lora_rank: int) -> str | None:
    """Why the Mosaic kernel does not apply, or None."""
    if kv_cache is not None and validation.is_fp8_latent(kv_cache):
        return "an FP8 latent cache"
    return mosaic_mla.supported(q, kv_lora_rank)


def default_backend(q, kv_lora_rank: int, interpret: bool, kv_cache=None) -> str:
    """``mla_attention``'s ``backend=None``: "mosaic" on a compiled Hopper GPU wherever its kernel applies (faster on
    L1, L2 and every cell of the ``mla-shapes`` grid but one, a launch-bound cell where the two are within their
    rounds' spread: docs/performance.md#dense-mla-default-backend), else "triton" (an FP8 latent cache among
    them)."""
    if interpret or not backend_lib.is_hopper():
        return "triton"
    return "mosaic" if _mosaic_unsupported(q, kv_cache, kv_lora_rank) is None else "triton"


def _token_keys(cu_query_lens, seq_lens, token_req, capacity: int):
    """``i32[T]``: the keys each token sees, ``[0, keys)`` of its request (its own position included: the causal
    bound of a multi-token step); 0 for padding tokens."""
    req = jnp.maximum(token_req, 0)
    seq = jnp.clip(seq_lens[req], 0, capacity)
    start = cu_query_lens[req]
    q_len = cu_query_lens[req + 1] - start
    local = jnp.arange(token_req.shape[0], dtype=jnp.int32) - start
    keys = jnp.clip(seq - q_len + local + 1, 0, seq)
    return jnp.where(token_req >= 0, keys, 0).astype(jnp.int32)


@common.front(arrays=("q", "kv_cache", "sinks"), int_arrays=("block_tables", "seq_lens", "cu_query_lens"),
              statics=dict(max_query_len=validation.check_static_int, kv_lora_rank=validation.check_static_int,
                           softmax_scale=validation.check_softmax_scale, num_splits=_OPTIONAL_INT,
                           split_size=_OPTIONAL_INT, return_lse=validation.check_static_bool,
                           interpret=_OPTIONAL_BOOL))
@functools.partial(jax.jit, static_argnames=("max_query_len", "kv_lora_rank", "softmax_scale", "num_splits",
                                             "split_size", "return_lse", "interpret", "config", "backend"))
def mla_attention(q, kv_cache, block_tables, seq_lens, cu_query_lens=None, *, max_query_len: int = 1,
                  kv_lora_rank: int = 512, softmax_scale: float | None = None, num_splits: int | None = None,
                  split_size: int | None = None, sinks=None, return_lse: bool = False,
                  interpret: bool | None = None, config: config_lib.MLAConfig | None = None,
                  backend: str | None = None):
    """Dense MLA (DeepSeek-V3 / Kimi-K2): every head of each new token attends to every key of its request in a
    paged latent cache.

    Args:
      q: ``[num_tokens, num_heads, kv_lora_rank + rope_dim]`` absorbed queries (DeepSeek: 512 + 64 = 576),
        bfloat16 (float16 / float32 also run).
      kv_cache: ``[num_blocks, block_size, kv_lora_rank + rope_dim]``, one shared latent row per position, in q's
        dtype; keys are the rows' full dims, values their first ``kv_lora_rank``. The new tokens' rows are already
        written. Block sizes as :func:`pallas_attn.paged_decode_attention` (64 is FlashMLA's). Or an FP8 latent
        cache, ``uint8[num_blocks, block_size, 656]`` for DeepSeek's rows (FlashMLA's layout, rows written by
        :func:`pallas_attn.quantize_latent`), read as stored by the Triton kernel only (bf16 / fp16 queries).
      block_tables: ``i32[num_seqs, max_blocks]``; entries past a request's last page are never read, and a page
        id outside ``[0, num_blocks)`` is never dereferenced (its keys are masked).
      seq_lens: ``i32[num_seqs]`` keys of each request, its new tokens included (clamped to the table's capacity).
      cu_query_lens: ``i32[num_seqs + 1]`` cumulative new-token counts (``q_len`` 0 allowed): request ``b``'s
        tokens are the last ``q_len`` of its keys, causal among themselves (MTP, speculative verification). Rows at
        or past ``cu_query_lens[-1]`` are padding (output 0, LSE -inf). None: decode, one token per request
        (``num_tokens == num_seqs``).
      max_query_len: static bound on ``q_len`` (bucketed); it sizes the query blocks, any ``q_len`` is correct.
      kv_lora_rank: value dims; output ``[num_tokens, num_heads, kv_lora_rank]``.
      softmax_scale: None (``1/sqrt(q.shape[-1])``) or a finite Python float > 0.
      num_splits / split_size: split-KV as :func:`pallas_attn.paged_decode_attention` (None, None: split only a
        batch that cannot fill the GPU); ``split_size`` keys per segment makes a request's output independent of
        the rest of the batch.
      sinks: ``f32[num_heads]`` or None: attention sinks (FlashMLA's ``attn_sink``): ``exp(sink_h)`` joins each
        row's denominator with no value, once, after any split merge; the LSE stays over the keys.
      return_lse: also return ``f32[num_tokens, num_heads]``.
      interpret: None → compiled on GPU, interpreted on CPU.
      config: :class:`pallas_attn.MLAConfig` (tiles, heads and tokens per program, warps, stages) of the Triton
        kernel.
      backend: "triton" or "mosaic": the Hopper kernel (warp-specialised, a memory warpgroup gathering each 64-key
        tile through the block table with ``cp.async``, wgmma; one program per token and 64 heads, or below 64
        heads as many tokens of a request as fill 64 rows; bf16/fp16, 64 rope dims, value dims a multiple of 64 in
        (192, 512], compiled only — anything else raises). None: :func:`default_backend` (Mosaic on a compiled
        Hopper GPU where it applies).

    Returns:
      ``out [num_tokens, num_heads, kv_lora_rank]`` in q's dtype (and ``lse``). No tokens, no request, no page or an
      empty pool give zeros (LSE -inf) without a kernel. Array arguments may be numpy arrays or lists. No backward
      pass: ``jax.grad`` raises ``NotImplementedError``.

    Example:
      >>> out = mla_attention(q, kv_cache, block_tables, seq_lens)                 # decode: one token per request
      >>> out = mla_attention(q, kv_cache, block_tables, seq_lens, cu_query_lens, max_query_len=2)   # MTP
    """
    _validate(q, kv_cache, block_tables, seq_lens, cu_query_lens, kv_lora_rank, max_query_len)
    if sinks is not None:
        validation.check_head_vector("sinks", sinks, q.shape[1])
    num_tokens, num_heads, _ = q.shape
    num_seqs, max_blocks = block_tables.shape
    if 0 in (num_tokens, num_seqs, max_blocks, kv_cache.shape[0]):
        return common.no_rows(num_tokens, num_heads, kv_lora_rank, q.dtype, return_lse)
    interpret = backend_lib.resolve_interpret(interpret)
    backend = backend_lib.select_backend(
        backend, config=config, default=lambda: default_backend(q, kv_lora_rank, interpret, kv_cache),
        mosaic_unsupported=lambda: "interpret mode" if interpret else _mosaic_unsupported(q, kv_cache, kv_lora_rank),
        function="mla_attention")
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    decode = cu_query_lens is None
    capacity = max_blocks * kv_cache.shape[1]
    if backend == "mosaic":
        if decode:
            cu_query_lens = jnp.arange(num_seqs + 1, dtype=jnp.int32)
            token_req = jnp.arange(num_tokens, dtype=jnp.int32)
        else:
            cu_query_lens = metadata.clamp_cu(cu_query_lens, num_tokens)
            token_req = metadata.token_requests(cu_query_lens, num_tokens)
        # one program an SM (its shared memory): a batch of as many programs as SMs already fills the GPU, and a
        # split of it measured slower (docs/performance.md#dense-mla-splits)
        query_blocks = pl.cdiv(num_tokens, mosaic_mla.tokens_per_block(num_heads, 1 if decode else max_query_len))
        splits, split_size = config_lib.resolve_splits(
            query_blocks * (num_heads // mosaic_mla.head_block(num_heads)), capacity, mosaic_mla.BLOCK_N, num_splits,
            split_size, programs_per_sm=1)
        run = functools.partial(mosaic_mla.dense_mla_mosaic, kv_lora_rank=kv_lora_rank, scale=float(scale),
                                num_splits=splits, split_size=split_size, max_query_len=1 if decode else max_query_len)
        out, lse = common.no_backward("mla_attention", run)(
            q, kv_cache, block_tables, cu_query_lens, token_req,
            _token_keys(cu_query_lens, seq_lens, token_req, capacity), sinks)
        return (out, lse) if return_lse else out
    cfg = config or config_lib.default_mla_config(num_heads, 1 if decode else max_query_len)
    if decode:  # query block b is request b's one token
        block_q = 1
        cu_query_lens = jnp.arange(num_seqs + 1, dtype=jnp.int32)
        block_req, block_first = jnp.arange(num_seqs, dtype=jnp.int32), jnp.zeros((num_seqs,), jnp.int32)
    else:
        block_q = cfg.block_q or config_lib.default_mla_config(num_heads, max_query_len).block_q
        cu_query_lens = metadata.clamp_cu(cu_query_lens, num_tokens)  # whatever it holds, requests stay disjoint
        block_req, block_first = triton_paged.query_blocks(cu_query_lens, block_q,
                                                           pl.cdiv(num_tokens, block_q) + num_seqs)
    head_blocks = pl.cdiv(num_heads, min(cfg.block_h, config_lib.next_pow2(num_heads)))
    work_blocks = num_seqs if decode else max(num_seqs, pl.cdiv(num_tokens, block_q))
    splits, split_size = config_lib.resolve_splits(work_blocks * head_blocks, capacity, cfg.block_n, num_splits,
                                                   split_size)
    run = functools.partial(triton_mla.mla_triton, kv_lora_rank=kv_lora_rank, scale=float(scale),
                            num_splits=splits, split_size=split_size, interpret=interpret, cfg=cfg, block_q=block_q)
    out, lse = common.no_backward("mla_attention", run)(q, kv_cache, block_tables, seq_lens, cu_query_lens,
                                                        block_req, block_first, sinks)
    out, lse = softmax.merge_split_outputs(out, lse, splits, (num_tokens, num_heads, kv_lora_rank), q.dtype,
                                           sinks if splits > 1 else None)
    if not decode:  # rows no request owns were never written: zeros and -inf
        owned = (metadata.token_requests(cu_query_lens, num_tokens) >= 0)[:, None]
        out = jnp.where(owned[..., None], out, jnp.zeros((), out.dtype))
        lse = jnp.where(owned, lse, -jnp.inf)
    return (out, lse) if return_lse else out
