"""``paged_decode_attention``: one query per request over a paged cache — validation, split choice, the jitted
public function.

Kernels: :mod:`pallas_attn.kernels.triton.decode`, and on Hopper the ragged kernel of
:mod:`pallas_attn.kernels.mosaic.paged` with one token per request. Reference:
:func:`pallas_attn.reference.paged_decode_attention`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_attn.core import backend as backend_lib, config as config_lib, masks, tiles, validation
from pallas_attn.kernels.triton import decode as triton_decode
from pallas_attn.ops import common, paged
from pallas_attn.ops.common import renamed_argument

_OPTIONAL_INT = functools.partial(validation.check_static_int, optional=True)
_OPTIONAL_BOOL = functools.partial(validation.check_static_bool, optional=True)


def _validate(q, k_cache, v_cache, block_tables, seq_lens, k_scale, v_scale) -> str | None:
    """The rules of the arguments' shapes and dtypes; an FP8 cache's scale mode ("tensor", "token"), else None."""
    validation.check_paged_kv(q, k_cache, v_cache, block_tables, "[num_seqs, num_q_heads, head_dim]")
    scale_mode = validation.check_kv_scales(k_cache, v_cache, k_scale, v_scale)
    validation.check_rank("seq_lens", seq_lens, 1, "i32[num_seqs]")
    validation.check_int32("seq_lens", seq_lens)
    validation.check_shape("seq_lens", seq_lens, (q.shape[0],), "i32[num_seqs] with num_seqs = q.shape[0]")
    if block_tables.shape[0] != q.shape[0]:
        raise ValueError(f"block_tables must be i32[num_seqs, max_blocks] with num_seqs = q.shape[0] = "
                         f"{q.shape[0]}; got {tuple(block_tables.shape)}")
    return scale_mode


def split_plan(q, k_cache, block_tables, mods: masks.ScoreMods, cfg: config_lib.DecodeConfig,
               num_splits: int | None, split_size: int | None) -> tuple[int, int | None]:
    """The Triton decode kernel's static ``(num_splits, split_size)``: a program a request × KV head, the keys of
    its window or capacity (:func:`pallas_attn.ops.paged.keys_read`); arguments: arrays or
    ``jax.ShapeDtypeStruct``, only shapes are read. The Mosaic kernel's: :func:`pallas_attn.ops.paged.mosaic_plan`."""
    keys = paged.keys_read(block_tables, k_cache, mods, 1, cfg.block_n)
    return config_lib.resolve_splits(q.shape[0] * k_cache.shape[2], keys, cfg.block_n, num_splits, split_size)


@renamed_argument("context_lens", "seq_lens")
@common.front(arrays=("q", "k_cache", "v_cache", "alibi_slopes", "sinks"), int_arrays=("block_tables", "seq_lens"),
              statics=dict(softmax_scale=validation.check_softmax_scale, window_size=validation.check_window_size,
                           softcap=validation.check_softcap, num_splits=_OPTIONAL_INT,
                           split_size=_OPTIONAL_INT, return_lse=validation.check_static_bool,
                           interpret=_OPTIONAL_BOOL),
              scalars=dict(k_scale=validation.check_kv_scale, v_scale=validation.check_kv_scale))
@functools.partial(jax.jit, static_argnames=("softmax_scale", "window_size", "softcap", "num_splits", "split_size",
                                             "return_lse", "interpret", "config", "backend"))
def paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, *, softmax_scale: float | None = None,
                           window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0, alibi_slopes=None,
                           sinks=None, k_scale=None, v_scale=None, num_splits: int | None = None,
                           split_size: int | None = None, return_lse: bool = False, interpret: bool | None = None,
                           config: config_lib.DecodeConfig | None = None, backend: str | None = None):
    """One query per request against its paged K/V.

    Args:
      q: ``[num_seqs, num_q_heads, head_dim]`` float32 / bfloat16 / float16.
      k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` page pool (block_size a power of two
        up to 16 or a multiple of 16 up to 1024; head_dim a multiple of 8 in [16, 512]), q's dtype or FP8
        (float8_e4m3fn / float8_e5m2, both the same, with ``k_scale`` and ``v_scale``).
      block_tables: ``i32[num_seqs, max_blocks]``; entry ``[b, i]`` is the physical page of request b's logical
        page i. Entries past a request's last page may hold anything (-1 included): they are never read.
      seq_lens: ``i32[num_seqs]`` keys each query sees, its own included (as :func:`pallas_attn.paged_attention`'s
        ``seq_lens`` and :attr:`pallas_attn.BatchMetadata.seq_lens`); 0 gives output 0 and LSE -inf. Its former name
        ``context_lens=`` still works for one release, with a ``DeprecationWarning``.
      softmax_scale: None (``1/sqrt(head_dim)``) or a finite Python float > 0.
      window_size, softcap, alibi_slopes, sinks: as :func:`pallas_attn.varlen_attention`, on absolute positions
        (the query sits at ``seq_lens[b] - 1``). With a left window only its keys are read and split, and pages
        wholly before it may already be freed (their table entries are never read).
      k_scale, v_scale: with an FP8 cache only (required there): float32 scalars (Python floats or ``[]``
        arrays, traced or not: a new value does not recompile), finite and positive, the cache holding ``value /
        scale``; or per-(token, head) scale caches ``f32[num_blocks, block_size, num_kv_heads]``
        (:func:`pallas_attn.allocate_kv_scales`, filled by :func:`pallas_attn.write_kv_cache`). Dequantised inside
        the kernel: a scalar K scale joins the softmax scale and a V scale multiplies the output; per-token scales
        multiply their keys' scores and their values' probabilities (docs/design.md#fp8-kv-caches).
      num_splits: split-KV segments per request (static Python int >= 1). None: heuristic from num_seqs ×
        num_kv_heads, the table's capacity ``max_blocks * block_size`` and the SM count; 1: single pass, no merge.
      split_size: fixed segment length in tokens (multiple of ``config.block_n``) instead of a count: outputs are
        then bit-identical whatever else is in the batch (batch invariance), at the price of a merge pass even
        when the GPU is already full.
      return_lse: also return ``f32[num_seqs, num_q_heads]`` natural-log LSE.
      interpret: None → compiled on GPU, interpreted on CPU.
      config: :class:`pallas_attn.core.config.DecodeConfig`; None → tuned default.
      backend: "triton" or "mosaic" (the Hopper kernel of :mod:`pallas_attn.kernels.mosaic.paged`, whose rules
        :func:`pallas_attn.paged_attention` lists); None: the Triton kernel while JAX ships its backend (or a config
        is given), else the Mosaic kernel where it applies.

    Returns:
      ``out [num_seqs, num_q_heads, head_dim]`` in q's dtype (and ``lse``). ``num_seqs == 0``, ``max_blocks == 0``
      or an empty page pool give zeros (LSE -inf) without a kernel. Array arguments may be numpy arrays or lists
      (converted; integer lists to int32). No backward pass: ``jax.grad`` raises ``NotImplementedError``.

    Example:
      >>> out = paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens)
    """
    scale_mode = _validate(q, k_cache, v_cache, block_tables, seq_lens, k_scale, v_scale)
    for name, x in (("alibi_slopes", alibi_slopes), ("sinks", sinks)):
        if x is not None:
            validation.check_head_vector(name, x, q.shape[1])
    mods = masks.ScoreMods(*window_size, softcap, alibi_slopes is not None, sinks is not None)
    backend = paged.select_backend("paged_decode_attention", backend, q, k_cache, split_size, config)
    interpret = backend_lib.resolve_interpret(interpret)
    scale = float(softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5)
    if backend == "mosaic":  # the ragged kernel, one token per request
        cu_query_lens = jnp.arange(q.shape[0] + 1, dtype=jnp.int32)
        return paged._mosaic(q, k_cache, v_cache, block_tables, seq_lens, cu_query_lens, alibi_slopes, sinks,
                             max_query_len=1, scale=scale, mods=mods, num_splits=num_splits, split_size=split_size,
                             return_lse=return_lse, interpret=interpret, name="paged_decode_attention",
                             kv_scales=tiles.kv_scale_args(scale_mode, k_scale, v_scale))
    cfg = config or config_lib.default_decode_config(q.shape[-1], k_cache.shape[1], q.dtype.itemsize)
    splits, split_size = split_plan(q, k_cache, block_tables, mods, cfg, num_splits, split_size)
    if 0 in (q.shape[0], block_tables.shape[1], k_cache.shape[0]):  # no request, no page: no key, no kernel
        return common.no_rows(*q.shape, q.dtype, return_lse)
    run = functools.partial(triton_decode.paged_decode_triton, scale=scale, num_splits=splits,
                            split_size=split_size, interpret=interpret, cfg=cfg,
                            mods=mods)
    kv_scales = tiles.kv_scale_args(scale_mode, k_scale, v_scale)
    out, lse = common.no_backward("paged_decode_attention", run)(q, k_cache, v_cache, block_tables, seq_lens,
                                                                 alibi_slopes, sinks, kv_scales)
    return (out, lse) if return_lse else out
