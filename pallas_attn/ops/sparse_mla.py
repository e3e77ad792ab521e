"""``sparse_mla_attention``: top-k sparse MLA over a paged latent cache — validation, backend choice, the jitted
public function.

Kernels: :mod:`pallas_attn.kernels.triton.sparse_mla` and :mod:`pallas_attn.kernels.mosaic.sparse_mla` (Hopper).
Reference: :func:`pallas_attn.reference.sparse_mla_attention`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_attn.core import backend as backend_lib, config as config_lib, metadata, validation
from pallas_attn.kernels.mosaic import sparse_mla as mosaic_sparse
from pallas_attn.kernels.triton import sparse_mla as triton_sparse
from pallas_attn.ops import common

_OPTIONAL_BOOL = functools.partial(validation.check_static_bool, optional=True)


def _validate(q, kv_cache, block_tables, topk_indices, cu_query_lens, seq_lens, kv_lora_rank):
    validation.check_latent_cache(q, kv_cache, block_tables, kv_lora_rank)
    validation.check_rank("topk_indices", topk_indices, 2, "i32[num_tokens, topk]")
    validation.check_int32("topk_indices", topk_indices)
    if topk_indices.shape[0] != q.shape[0]:
        raise ValueError(f"topk_indices must be i32[num_tokens={q.shape[0]}, topk]; got {tuple(topk_indices.shape)}")
    if cu_query_lens is None:
        if block_tables.shape[0] != q.shape[0]:
            raise ValueError(f"without cu_query_lens every token is its own request: block_tables must be "
                             f"i32[num_tokens={q.shape[0]}, max_blocks]; got {tuple(block_tables.shape)}")
    else:
        validation.check_rank("cu_query_lens", cu_query_lens, 1, "i32[num_seqs + 1]")
        validation.check_int32("cu_query_lens", cu_query_lens)
        validation.check_shape("cu_query_lens", cu_query_lens, (block_tables.shape[0] + 1,),
                               "i32[num_seqs + 1] with num_seqs = block_tables.shape[0]")
    if seq_lens is not None:
        validation.check_int32("seq_lens", seq_lens)
        validation.check_shape("seq_lens", seq_lens, (block_tables.shape[0],),
                               "i32[num_seqs] with num_seqs = block_tables.shape[0]")


BACKENDS = backend_lib.BACKENDS


def _padded_topk(topk: int) -> int:
    return pl.cdiv(topk, mosaic_sparse.BLOCK_N) * mosaic_sparse.BLOCK_N


# Dims where the Mosaic kernel is the default: it beat the Triton kernel on every decode batch measured there
# (docs/performance.md#sparse-mla); other dims were neither measured nor tested compiled, so they stay on Triton.
MOSAIC_DIMS = ((576, 512),)


def default_backend(q, kv_lora_rank: int, interpret: bool) -> str:
    """``sparse_mla_attention``'s ``backend=None``: "mosaic" on a compiled Hopper GPU where it applies and was
    measured (576 / 512 dims, heads a multiple of 64), else "triton"."""
    if interpret or not backend_lib.is_hopper() or (q.shape[-1], kv_lora_rank) not in MOSAIC_DIMS:
        return "triton"
    if q.shape[1] % mosaic_sparse.BLOCK_H:  # fewer heads than a tile: Mosaic when asked, never measured as default
        return "triton"
    return "mosaic" if mosaic_sparse.supported(q, kv_lora_rank) is None else "triton"


@common.front(arrays=("q", "kv_cache", "sinks"),
              int_arrays=("block_tables", "topk_indices", "cu_query_lens", "seq_lens"),
              statics=dict(kv_lora_rank=validation.check_static_int, softmax_scale=validation.check_softmax_scale,
                           return_lse=validation.check_static_bool, interpret=_OPTIONAL_BOOL))
@functools.partial(jax.jit, static_argnames=("kv_lora_rank", "softmax_scale", "return_lse", "interpret", "config",
                                             "backend"))
def sparse_mla_attention(q, kv_cache, block_tables, topk_indices, *, cu_query_lens=None, seq_lens=None,
                         kv_lora_rank: int = 512, softmax_scale: float | None = None, sinks=None,
                         return_lse: bool = False,
                         interpret: bool | None = None, config: config_lib.SparseConfig | None = None,
                         backend: str | None = None):
    """Each query token attends to its own top-k positions of its request's paged latent cache.

    Args:
      q: ``[num_tokens, num_heads, kv_lora_rank + rope_dim]`` bfloat16 (float16/float32 also run), absorbed.
      kv_cache: ``[num_blocks, block_size, kv_lora_rank + rope_dim]`` one shared latent head per position.
      block_tables: ``i32[num_seqs, max_blocks]``.
      topk_indices: ``i32[num_tokens, topk]`` request-local positions; ``-1`` = unused; duplicates count twice.
        An index past the request's keys (``seq_lens[b]``, else the table row's capacity), below ``-1`` or on a
        page id outside the pool is ignored like ``-1`` (:func:`pallas_attn.checked` reports it).
      cu_query_lens: ``i32[num_seqs + 1]``; None means one token per request (decode, ``num_tokens == num_seqs``).
        Tokens at or past ``cu_query_lens[-1]`` are padding (output 0, LSE -inf).
      seq_lens: ``i32[num_seqs]`` keys of each request (clamped to the table's capacity), or None: indices are
        then bounded by the capacity only, and a stale slot of an owned page past the request's keys is read.
      kv_lora_rank: value dims (the first ``kv_lora_rank`` of each row); output ``[num_tokens, num_heads,
        kv_lora_rank]``.
      softmax_scale: None (``1/sqrt(q.shape[-1])``, ``1/sqrt(576)``) or a finite Python float > 0.
      sinks: ``f32[num_heads]`` or None: attention sinks (FlashMLA's ``attn_sink``, as in
        :func:`pallas_attn.varlen_attention`): ``exp(sink_h)`` joins each row's softmax denominator, with no value.
        The LSE stays over the selected keys only; a row that sees no key still gives 0 and -inf.
      return_lse: also return ``f32[num_tokens, num_heads]``; a row whose indices are all -1 gives 0 and -inf.
      interpret: None → compiled on GPU, interpreted on CPU (see :mod:`pallas_attn.core.backend`).
      config: tiles / warps / stages of the Triton kernel (:class:`pallas_attn.SparseConfig`).
      backend: "triton" or "mosaic": the Hopper kernel of :mod:`pallas_attn.kernels.mosaic.sparse_mla`
        (warp-specialised, cp.async gather, wgmma; bf16/fp16, heads a multiple of 64, 64 rope dims, value dims a
        multiple of 64 in (192, 512], any top-k, compiled only — anything else raises). None:
        :func:`default_backend` — Mosaic on a compiled sm_90 GPU at 576 / 512 dims where it applies, else Triton.

    Returns:
      ``out [num_tokens, num_heads, kv_lora_rank]`` in q's dtype (and ``lse``). No tokens, no request (every token
      padding), ``topk == 0``, ``max_blocks == 0`` or an empty pool give zeros (LSE -inf) without a kernel. Array
      arguments may be numpy arrays or lists (converted; integer lists to int32). No backward pass: ``jax.grad``
      raises ``NotImplementedError``.

    Example:
      >>> out = sparse_mla_attention(q, kv_cache, block_tables, topk_indices)   # decode: one token per request
      >>> out = sparse_mla_attention(q, kv_cache, block_tables, topk_indices, sinks=jnp.zeros(q.shape[1]))
    """
    _validate(q, kv_cache, block_tables, topk_indices, cu_query_lens, seq_lens, kv_lora_rank)
    if sinks is not None:
        validation.check_head_vector("sinks", sinks, q.shape[1])
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    interpret = backend_lib.resolve_interpret(interpret)
    backend = backend_lib.select_backend(
        backend, config=config, default=lambda: default_backend(q, kv_lora_rank, interpret),
        mosaic_unsupported=lambda: "interpret mode" if interpret else mosaic_sparse.supported(q, kv_lora_rank),
        function="sparse_mla_attention")
    if 0 in (q.shape[0], block_tables.shape[0], block_tables.shape[1], kv_cache.shape[0], topk_indices.shape[1]):
        # no token, request, page or index: no key, no kernel
        return common.no_rows(q.shape[0], q.shape[1], kv_lora_rank, q.dtype, return_lse)
    num_tokens = q.shape[0]
    token_req = (jnp.arange(num_tokens, dtype=jnp.int32) if cu_query_lens is None
                 else metadata.token_requests(cu_query_lens, num_tokens))
    capacity = block_tables.shape[1] * kv_cache.shape[1]
    keys = capacity if seq_lens is None else jnp.clip(seq_lens, 0, capacity)[jnp.maximum(token_req, 0)]
    token_keys = jnp.where(token_req >= 0, keys, 0).astype(jnp.int32)  # indices a token may use: [0, keys)
    topk = _padded_topk(topk_indices.shape[1])
    if backend == "mosaic":
        if topk != topk_indices.shape[1]:
            topk_indices = jnp.pad(topk_indices, ((0, 0), (0, topk - topk_indices.shape[1])), constant_values=-1)
        run = functools.partial(mosaic_sparse.sparse_mla_mosaic, kv_lora_rank=kv_lora_rank, scale=float(scale))
    else:
        run = functools.partial(triton_sparse.sparse_mla_triton, kv_lora_rank=kv_lora_rank, scale=float(scale),
                                interpret=interpret, cfg=config or config_lib.default_sparse_config(q.shape[1]))
    out, lse = common.no_backward("sparse_mla_attention", run)(q, kv_cache, block_tables, topk_indices, token_req,
                                                               token_keys, sinks)
    return (out, lse) if return_lse else out
