"""Anchor implementations, measured in the same process as ours.

Every anchor's ``prepare`` does its layout work OUTSIDE the timing (padding, page gathering for contiguous
layouts, transposes, head repetition) and records in ``note`` what it had to do. An anchor that cannot run here
(cuDNN on a CPU, an internal API that moved) raises; the harness turns that into an ``error`` row.

  cudnn              jax.nn.dot_product_attention(implementation="cudnn") on the padded [B, L_max, H, D] layout
                     with query_seq_lengths / key_value_seq_lengths (P1, P2)
  cudnn/packed       JAX's internal cuDNN entry point on the packed layout (q_offsets), P1; internal API
  cudnn/paged        JAX's internal cuDNN paged attention (D1, D2); internal API, pool padded to B·max_blocks pages
  jax_pallas_mha     jax.experimental.pallas.ops.gpu.attention.mha (P1 packed into one sequence with segment_ids,
                     P2 as is); K/V heads repeated to Hq (mha has no GQA)
  jax_pallas_mgpu    jax.experimental.pallas.ops.gpu.attention_mgpu.attention, the Mosaic GPU (Hopper) kernel, GPU
                     only, GQA native, on dense [n, L, H, D]: P1 one call per length group (requests gathered
                     per group first), P2 one call; q/k/v cast to fp16 (its smem is fp16-only in jax 0.11.2), q
                     pre-scaled (it applies no softmax scale)
  jax_pallas_decode  jax.experimental.pallas.ops.gpu.decode_attention (its gqa kernel) on contiguous K/V: pages
                     gathered and transposed to [B, Hkv, L, D] first (D1, D2)
  jax_pallas_paged   jax.experimental.pallas.ops.gpu.paged_attention on [Hkv, pages, page_size, D] (transposed
                     first); D1, D2, and V1 as one call per draft token
  jnp                jitted jnp gather + dense attention (float32 scores, bf16 P·V), every standard workload: the
                     floor; the only anchor with the model-family features (window: only the pages of the window
                     are gathered, soft-cap, ALiBi, sinks), so the only one on W1 and W2. Dense MLA (L1, L2):
                     each request's latent pages gathered once into [B, max_pages · block_size, 576], keys all
                     576 dims, values the first 512, masked causally from absolute positions
  sparse_mla_attention/all
                     dense MLA (L1, L2) through this library's sparse_mla_attention with every position selected:
                     top-k = the longest request, token t's indices 0..its position, -1 after (built outside the
                     timing); cu_query_lens and seq_lens passed as to mla_attention
  paged_attention/latent
                     dense MLA (L1, L2) through this library's paged_attention: the latent cache as one KV head
                     whose keys and values are both the 576-dim rows (output sliced to 512). paged_attention takes
                     head dims up to 512, so it serves no 576-dim workload (``--list`` names the limit); a latent
                     of 512 dims or fewer runs (tests/test_benchmarks_smoke.py runs one of 96)

The other anchors declare no feature (``Impl.features``): the harness does not run them on a workload, or a
``--variant``, that uses one.
  naive_triton       naive Triton varlen prefill (one program per request tile, no tile classes) through
                     jax-triton (P1, P2; :mod:`benchmarks.naive_triton`)

Training steps (P1-bwd, P2-bwd): the forward anchors above, in the same layouts, wrapped by
:func:`benchmarks.impls.with_grads` (forward + backward through ``jax.vjp``, the cotangent laid out like the output
outside the timing), and one anchor of their own:
  cudnn              cuDNN's fused backward (JAX's custom_vjp of the cuDNN call), padded as above; the cotangent
                     is zero in the padding
  jax_pallas_mha     mha's Triton backward (its custom_vjp): backward blocks 64 (dK/dV and dQ tiles alike), the
                     dK/dV of the repeated heads summed over each group for the check only (outside the timing)
  jnp                jax.grad through the floor, each query chunk rematerialised (jax.checkpoint): the backward
                     recomputes a chunk's scores instead of storing every chunk's (P2's would take 137 GB)
  tokamax_mosaic     tokamax.dot_product_attention(implementation="mosaic"), tokamax's Mosaic GPU (Hopper) kernel
                     and its Mosaic GPU VJP, padded [B, L_max, H, D] with key_value_seq_lengths (the padding
                     queries' rows get a zero cotangent, so they reach no gradient); only where the tokamax
                     package is installed (an error row says so otherwise); GPU only
jax_pallas_mgpu sits them out (jax 0.11.2's attention_mgpu backward refuses causal attention), and so do
cudnn/packed and naive_triton (no backward here).
"""

from __future__ import annotations

import functools
import inspect
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.impls import Impl, Options, Prepared, identity, mla_cu_query_lens, with_grads
from benchmarks.workloads import FEATURE_KWARGS, Batch, HostBatch, Spec

SCORE_BUDGET_BYTES = 4 * 2**30  # jnp baseline: f32 score block per query chunk


def _scale(spec: Spec) -> float:
    return 1.0 / math.sqrt(spec.head_dim)


def _pad_to(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class _Padded:
    """The padded ``[B, L_max, ...]`` layout of a packed prefill batch, for anchors without varlen: request ``b``'s
    rows at ``[b, :q_lens[b]]``."""

    def __init__(self, host: HostBatch):
        self.length = int(host.q_lens.max())  # L_max
        i = np.arange(self.length)[None, :]
        valid = i < host.q_lens[:, None]  # bool[B, L_max]
        rows = np.where(valid, host.cu_query_lens[:-1, None] + i, 0).astype(np.int32)  # padding points at row 0
        self.rows, self.valid = jnp.asarray(rows), jnp.asarray(valid)
        self.b_idx, self.i_idx = np.nonzero(valid)  # row-major = packed order

    def pad(self, x):
        """``[T, ...]`` -> ``[B, L_max, ...]``, the padding holding row 0 (masked by the sequence lengths)."""
        return x[self.rows]

    def pad_zeros(self, x):
        """``[T, H, D]`` -> ``[B, L_max, H, D]``, zeros in the padding (a cotangent: padding rows reach nothing)."""
        return jnp.where(self.valid[..., None, None], x[self.rows], jnp.zeros((), x.dtype))

    def pack(self, y):
        """``[B, L_max, ...]`` -> packed ``[T, ...]``."""
        return y[self.b_idx, self.i_idx]

    def pack_all(self, ys):
        return tuple(self.pack(y) for y in ys)


# ----------------------------------------------------------------------------------------------------- cuDNN
def _prepare_cudnn(batches: list[Batch], options: Options) -> Prepared:
    host = batches[0].host
    layout = _Padded(host)
    lens = jnp.asarray(host.q_lens, jnp.int32)

    @jax.jit
    def fn(q, k, v, q_lens):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, query_seq_lengths=q_lens,
                                            key_value_seq_lengths=q_lens, implementation="cudnn")

    args = [(layout.pad(b.arrays["q"]), layout.pad(b.arrays["k"]), layout.pad(b.arrays["v"]), lens) for b in batches]
    return Prepared(fn, args, layout.pack, note=f"padded to [{host.num_seqs}, {layout.length}]")


def _prepare_cudnn_bwd(batches: list[Batch], options: Options) -> Prepared:
    layout = _Padded(batches[0].host)
    return with_grads(_prepare_cudnn(batches, options), batches, cotangent=layout.pad_zeros, grads=layout.pack_all)


def _prepare_cudnn_packed(batches: list[Batch], options: Options) -> Prepared:
    from jax._src.cudnn import fused_attention_stablehlo as cudnn_fa
    host, spec = batches[0].host, batches[0].spec
    B = host.num_seqs
    q_offsets = jnp.asarray(host.cu_query_lens[None, :], jnp.int32)  # [1, B + 1]
    seqlen = jnp.asarray(host.q_lens[None, :], jnp.int32)  # [1, B]

    @jax.jit
    def fn(q, k, v, seqlen, offsets):
        return cudnn_fa.dot_product_attention(q, k, v, q_seqlen=seqlen, kv_seqlen=seqlen, q_offsets=offsets,
                                              kv_offsets=offsets, scale=_scale(spec),
                                              mask_type=cudnn_fa.MaskType.PADDING_CAUSAL, qkv_layout="BTNH")

    args = [(b.arrays["q"][None], b.arrays["k"][None], b.arrays["v"][None], seqlen, q_offsets) for b in batches]
    return Prepared(fn, args, lambda out: out[0], note=f"internal API, {B} segments in one row")


def _prepare_cudnn_paged(batches: list[Batch], options: Options) -> Prepared:
    from jax._src.cudnn import fused_attention_stablehlo as cudnn_fa
    host, spec = batches[0].host, batches[0].spec
    B, max_blocks = host.block_tables.shape
    extra = B * max_blocks - host.num_pages  # cuDNN wants exactly B·max_blocks pages in the pool
    tables = jnp.asarray(host.block_tables[:, None, :, None], jnp.int32)  # [B, 1, max_blocks, 1]
    ones = jnp.ones((B,), jnp.int32)
    ctx = jnp.asarray(host.seq_lens, jnp.int32)

    @jax.jit
    def fn(q, kc, vc, tables, q_len, kv_len):
        return cudnn_fa.paged_attention(q, kc, vc, q_len, kv_len, tables, tables, scale=_scale(spec),
                                        mask_type=cudnn_fa.MaskType.PADDING, qkv_layout="BTNH")

    def pad_pool(c):
        return jnp.concatenate([c, jnp.zeros((extra, *c.shape[1:]), c.dtype)]) if extra > 0 else c

    args = [(b.arrays["q"][:, None], pad_pool(b.arrays["k_cache"]), pad_pool(b.arrays["v_cache"]), tables, ones,
             ctx) for b in batches]
    return Prepared(fn, args, lambda out: out[:, 0], note=f"internal API, pool padded by {extra} pages")


# ---------------------------------------------------------------------------------------------- JAX Pallas
# mha's backward tiles: the 64 × 64 tokamax's Triton VJP picks by default (mha's BlockSizes.get_default() has 32)
MHA_BACKWARD_BLOCK = 64


def _prepare_jax_mha(batches: list[Batch], options: Options) -> Prepared:
    from jax.experimental.pallas.ops.gpu import attention as jax_attention
    host, spec = batches[0].host, batches[0].spec
    T = host.num_tokens
    block = 128 if T >= 128 else T
    T_pad = _pad_to(T, block)
    group = spec.num_q_heads // spec.num_kv_heads
    segments = None
    if host.num_seqs > 1 or T_pad != T:  # one packed row; each request (and the padding tail) its own segment
        seg = np.repeat(np.arange(host.num_seqs), host.q_lens)
        seg = np.concatenate([seg, np.full(T_pad - T, host.num_seqs)]).astype(np.int32)
        segments = jnp.asarray(seg[None])
    backward = spec.kind == "prefill-bwd"
    blocks = jax_attention.BlockSizes(block_q=block, block_k=block, **(_mha_backward_blocks(T_pad) if backward
                                                                         else {}))

    @jax.jit
    def fn(q, k, v, segment_ids):
        return jax_attention.mha(q, k, v, segment_ids, sm_scale=_scale(spec), causal=True, block_sizes=blocks,
                                 interpret=options.interpret)

    def prep(x, repeat):
        x = jnp.pad(x, ((0, T_pad - T), (0, 0), (0, 0)))
        return (jnp.repeat(x, group, axis=1) if repeat else x)[None]

    args = [(prep(b.arrays["q"], False), prep(b.arrays["k"], True), prep(b.arrays["v"], True), segments)
            for b in batches]
    note = f"K/V heads repeated x{group}" + (", packed with segment_ids" if segments is not None else "")
    forward = Prepared(fn, args, lambda out: out[0, :T], note=note)
    if not backward:
        return forward

    def grads(g):  # [1, T_pad, Hq, D] each; dK and dV of the repeated heads, summed over each group
        dq, dk, dv = (x[0, :T] for x in g)
        return dq, *(x.reshape(T, spec.num_kv_heads, group, spec.head_dim).sum(axis=2) for x in (dk, dv))

    forward.note += f"; backward blocks {blocks.block_q_dkv}, dK/dV summed over the group outside the timing"
    return with_grads(forward, batches, cotangent=lambda d: prep(d, False), grads=grads)


def _mha_backward_blocks(length: int) -> dict:
    """mha's backward tiles for a packed row of ``length`` (a multiple of its forward block): one size for its
    dK/dV and dQ loops (its fused backward wants as many query tiles as key tiles), the largest of 64, 32, 16
    dividing ``length``."""
    size = next((b for b in (MHA_BACKWARD_BLOCK, 32, 16) if length % b == 0), None)
    if size is None:
        raise NotImplementedError(f"jax_pallas_mha's backward needs a length divisible by 16, got {length}")
    return dict(block_q_dkv=size, block_kv_dkv=size, block_q_dq=size, block_kv_dq=size)


# what attention_mgpu's own benchmark settles on at D=128 (its first try, block_kv 256, overflows smem)
MGPU_CONFIG = dict(block_q=64, block_kv=128, max_concurrent_steps=2)


def _length_groups(host: HostBatch) -> tuple[list[np.ndarray], np.ndarray]:
    """Prefill requests grouped by length, for kernels that take dense ``[n, L, H, D]`` and no varlen.

    Returns the packed rows of each group, i32[n, L] (the n requests of length L, lengths ascending), and
    i32[num_tokens]: the permutation that takes the groups' outputs, flattened and concatenated, back to packed order.
    """
    rows = [(host.cu_query_lens[idx, None] + np.arange(host.q_lens[idx[0]])[None, :]).astype(np.int32)
            for idx in _jnp_groups(host)]
    # the groups cover every packed row exactly once: the inverse of their concatenation is a gather, no scatter
    inverse = np.argsort(np.concatenate([r.ravel() for r in rows])).astype(np.int32)
    return rows, inverse


def _ungroup(outs, inverse):
    """Per-group outputs ``[n, L, H, D]`` -> packed ``[num_tokens, H, D]`` (``inverse`` from :func:`_length_groups`)."""
    return jnp.concatenate([o.reshape(-1, *o.shape[2:]) for o in outs])[inverse]


def _mgpu_fn(config):
    """One jitted call per length group: fn(qs, ks, vs) with tuples of [n, L, Hq, D] / [n, L, Hkv, D]."""
    from jax.experimental.pallas.ops.gpu import attention_mgpu

    @jax.jit
    def fn(qs, ks, vs):
        return tuple(attention_mgpu.attention(q, k, v, config=config) for q, k, v in zip(qs, ks, vs))

    return fn


def _prepare_jax_mgpu(batches: list[Batch], options: Options) -> Prepared:
    from jax.experimental.pallas.ops.gpu import attention_mgpu
    if options.interpret:
        raise NotImplementedError("jax_pallas_mgpu is a Mosaic GPU (Hopper) kernel: GPU only, no interpret mode")
    host, spec = batches[0].host, batches[0].spec
    config = attention_mgpu.TuningConfig(**MGPU_CONFIG, causal=True)
    if spec.head_dim % 64:
        raise NotImplementedError(f"jax_pallas_mgpu needs head_dim a multiple of 64, got {spec.head_dim=}")
    tile = math.lcm(2 * config.block_q, config.block_kv)  # two compute warpgroups of block_q rows per program
    if np.any(host.q_lens % tile):  # P1/P2 lengths are multiples of 256: no tail padding written for others
        raise NotImplementedError(f"jax_pallas_mgpu needs every length a multiple of {tile}, got "
                                  f"{sorted(set(host.q_lens.tolist()))}")
    rows, inverse = _length_groups(host)
    rows_j, inverse_j = [jnp.asarray(r) for r in rows], jnp.asarray(inverse)
    scale = _scale(spec)

    # fp16, not bf16: jax 0.11.2's kernel declares its q/k/v smem as fp16 and its TMA copies refuse bf16; Hopper's
    # wgmma runs both at one rate. The kernel applies no softmax scale, so q carries it (one rounding, in f32).
    def args_for(b: Batch):
        a = b.arrays
        q = (a["q"].astype(jnp.float32) * scale).astype(jnp.float16)
        k, v = a["k"].astype(jnp.float16), a["v"].astype(jnp.float16)
        return tuple(q[r] for r in rows_j), tuple(k[r] for r in rows_j), tuple(v[r] for r in rows_j)

    def canonical(outs):  # per group [n, L, Hq, D] fp16 -> packed [T, Hq, D] in the workload's dtype
        return _ungroup(outs, inverse_j).astype(spec.jnp_dtype)

    shapes = ", ".join(f"{r.shape[0]}x{r.shape[1]}" for r in rows)
    note = (f"{len(rows)} call(s), one per length group [{shapes}]; fp16, q pre-scaled; block_q {config.block_q}, "
            f"block_kv {config.block_kv}, {config.max_concurrent_steps} stages")
    return Prepared(_mgpu_fn(config), [args_for(b) for b in batches], canonical, note=note)


def _contiguous_kv(batch: Batch, L_pad: int):
    """Paged cache -> contiguous [B, Hkv, L_pad, D] (pages gathered, positions past a request's end are pages
    of the table's zero padding: never visible)."""
    host, spec = batch.host, batch.spec
    pages = L_pad // spec.block_size
    tables = np.zeros((host.num_seqs, pages), np.int32)
    tables[:, :min(pages, host.block_tables.shape[1])] = host.block_tables[:, :pages]
    tables = jnp.asarray(tables)

    def gather(cache):
        x = cache[tables].reshape(host.num_seqs, L_pad, spec.num_kv_heads, spec.head_dim)
        return jnp.swapaxes(x, 1, 2)

    return gather(batch.arrays["k_cache"]), gather(batch.arrays["v_cache"])


def _prepare_jax_decode(batches: list[Batch], options: Options) -> Prepared:
    from jax.experimental.pallas.ops.gpu import decode_attention as jax_decode
    host, spec = batches[0].host, batches[0].spec
    k_splits, block_k = (2, 16) if options.tiny else (16, 128)
    L_pad = _pad_to(int(host.seq_lens.max()), k_splits * block_k)
    B, Hkv, G = host.num_seqs, spec.num_kv_heads, spec.num_q_heads // spec.num_kv_heads
    inner = functools.partial(jax_decode.decode_attn_unbatched, sm_scale=_scale(spec), block_h=16, block_k=block_k,
                              k_splits=k_splits, num_warps=None, num_stages=2, grid=None,
                              interpret=options.interpret, debug=False, return_residuals=False,
                              normalize_output=True)

    @jax.jit
    def fn(q, k_t, v_t, kv_len):  # what jax_decode.gqa does, minus its swapaxes of K/V (done outside timing)
        q = q.reshape(B, Hkv, G, spec.head_dim)
        lens = jnp.broadcast_to(kv_len[:, None], (B, Hkv))
        out = jax.vmap(jax.vmap(inner))(q, k_t, v_t, None, lens)
        return out.reshape(B, spec.num_q_heads, spec.head_dim)

    ctx = jnp.asarray(host.seq_lens, jnp.int32)
    args = [(b.arrays["q"], *_contiguous_kv(b, L_pad), ctx) for b in batches]
    return Prepared(fn, args, identity, note=f"contiguous [B, Hkv, {L_pad}, D], pre-transposed, k_splits={k_splits}")


def _paged_tables_for_jax(host: HostBatch, multiple: int) -> jax.Array:
    B, max_blocks = host.block_tables.shape
    tables = np.zeros((B, _pad_to(max_blocks, multiple)), np.int32)  # 0 = a real page: in range, never visible
    tables[:, :max_blocks] = host.block_tables
    return jnp.asarray(tables)


def _prepare_jax_paged(batches: list[Batch], options: Options) -> Prepared:
    from jax.experimental.pallas.ops.gpu import paged_attention as jax_paged
    host = batches[0].host
    k_splits, pages_per_block = (2, 2) if options.tiny else (16, 8)
    tables = _paged_tables_for_jax(host, k_splits * pages_per_block)
    call = functools.partial(jax_paged.paged_attention, k_splits=k_splits, pages_per_compute_block=pages_per_block,
                             interpret=options.interpret)
    # the kernel scales nothing itself: fold softmax_scale into q (outside: part of what a caller does anyway)
    scale = _scale(batches[0].spec)
    q_len = host.max_query_len
    if not np.all(host.q_lens == q_len):
        raise NotImplementedError("jax_pallas_paged runs only equal q_len batches (decode, verification)")
    base = jnp.asarray(host.seq_lens - q_len, jnp.int32)

    @jax.jit
    def fn(q, k_pages, v_pages, tables, base):
        if q_len == 1:
            return call(q, k_pages, v_pages, tables, base + 1)
        q = q.reshape(-1, q_len, *q.shape[1:])  # [B, q_len, Hq, D]: one call per draft token
        outs = [call(q[:, i], k_pages, v_pages, tables, base + i + 1) for i in range(q_len)]
        return jnp.stack(outs, axis=1).reshape(-1, *q.shape[2:])

    def args_for(b: Batch):
        def tr(c):
            return jnp.transpose(c, (2, 0, 1, 3))  # [Hkv, pages, page_size, D]

        return (b.arrays["q"] * jnp.asarray(scale, b.arrays["q"].dtype), tr(b.arrays["k_cache"]),
                tr(b.arrays["v_cache"]), tables, base)

    note = f"[Hkv, pages, page_size, D] pre-transposed, k_splits={k_splits}, q pre-scaled"
    if q_len > 1:
        note += f", {q_len} calls (one per draft token)"
    return Prepared(fn, [args_for(b) for b in batches], identity, note=note)


# --------------------------------------------------------------------------------------------------- jnp
def _dense(q, k, v, visible, scale, *, offset=None, softcap=0.0, alibi_slopes=None, sinks=None):
    """q [n, m, Hq, D], k [n, N, Hkv, D], v [n, N, Hkv, Dv], visible bool[n, m, N] -> [n, m, Hq, Dv] in q.dtype.
    Scores and softmax in float32, P·V with P cast to v's dtype (what a plain bf16 model would run). The model-family
    features in docs/design.md's order: soft-cap, ALiBi (``offset`` i32[n, m, N]: key minus query position), mask,
    softmax with ``exp(sink_h)`` in the denominator."""
    n, m, hq, d = q.shape
    hkv = k.shape[2]
    q = q.reshape(n, m, hkv, hq // hkv, d)
    s = jnp.einsum("bmkgd,bnkd->bkgmn", q, k, preferred_element_type=jnp.float32) * scale
    if softcap:
        s = softcap * jnp.tanh(s / softcap)
    if alibi_slopes is not None:
        s = s + alibi_slopes.reshape(hkv, hq // hkv, 1, 1) * offset[:, None, None].astype(jnp.float32)
    s = jnp.where(visible[:, None, None], s, -jnp.inf)
    if sinks is None:
        p = jax.nn.softmax(s, axis=-1)
    else:  # the sink is one more logit with no value
        row_max = jnp.maximum(jnp.max(s, axis=-1, keepdims=True), sinks.reshape(hkv, hq // hkv, 1, 1))
        e = jnp.exp(s - row_max)
        p = e / (e.sum(axis=-1, keepdims=True) + jnp.exp(sinks.reshape(hkv, hq // hkv, 1, 1) - row_max))
    o = jnp.einsum("bkgmn,bnkd->bmkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return o.reshape(n, m, hq, v.shape[-1]).astype(q.dtype)


def _jnp_groups(host: HostBatch) -> list[np.ndarray]:
    """Requests batched together in the jnp baseline: equal q_len (and, for prefill, equal length)."""
    key = host.q_lens if host.paged else host.seq_lens
    return [np.flatnonzero(key == v) for v in np.unique(key)]


def _prepare_jnp(batches: list[Batch], options: Options, remat: bool = False) -> Prepared:
    """The floor; ``remat``: for a training step, each query chunk under ``jax.checkpoint`` (the backward recomputes
    its scores instead of keeping every chunk's), and a padding row that sees no key attends to every key (its
    output is dropped either way; a softmax over nothing would put 0 · NaN into the gradients)."""
    host, spec = batches[0].host, batches[0].spec
    if spec.kind == "sparse":
        return _prepare_jnp_sparse(batches, options)
    latent = spec.kind == "mla"  # one latent row per key: keys its head_dim dims, values its first kv_lora_rank
    value_dim = spec.kv_lora_rank if latent else spec.head_dim
    T, scale = host.num_tokens, _scale(spec)
    left = spec.window_left
    plans, group_args = [], []
    for idx in _jnp_groups(host):
        n, m = idx.size, int(host.q_lens[idx].max())
        i = np.arange(m)[None, :]
        q_idx = np.where(i < host.q_lens[idx, None], host.cu_query_lens[idx, None] + i, T).astype(np.int32)
        q_pos = (host.context_lens[idx, None] + i).astype(np.int32)
        key_start = np.zeros(n, np.int64)  # position of each request's first gathered key
        if host.paged:
            first = np.zeros(n, np.int64)  # with a left window, the pages before every query's window are skipped
            if left >= 0:
                first = np.maximum(host.context_lens[idx] - left, 0) // spec.block_size
            pages = int(np.max(-(-host.seq_lens[idx] // spec.block_size) - first))
            cols = np.minimum(first[:, None] + np.arange(pages)[None, :], host.block_tables.shape[1] - 1)
            keys = host.block_tables[idx[:, None], cols]  # [n, pages]
            num_keys = pages * spec.block_size
            key_start = first * spec.block_size
        else:
            num_keys = int(host.seq_lens[idx].max())
            j = np.arange(num_keys)[None, :]
            keys = np.where(j < host.seq_lens[idx, None], host.cu_query_lens[idx, None] + j, 0)  # packed rows
        chunk = m
        while chunk > 1 and n * spec.num_q_heads * chunk * num_keys * 4 > SCORE_BUDGET_BYTES:
            chunk //= 2
        num_chunks = -(-m // chunk)
        pad = num_chunks * chunk - m
        q_idx = np.pad(q_idx, ((0, 0), (0, pad)), constant_values=T)
        q_pos = np.pad(q_pos, ((0, 0), (0, pad)), constant_values=-1)
        # [num_chunks, n, chunk]
        q_idx = q_idx.reshape(n, num_chunks, chunk).transpose(1, 0, 2)
        q_pos = q_pos.reshape(n, num_chunks, chunk).transpose(1, 0, 2)
        plans.append((n, num_keys))
        group_args.append(tuple(jnp.asarray(x) for x in (q_idx, q_pos, keys.astype(np.int32),
                                                          host.seq_lens[idx].astype(np.int32),
                                                          key_start.astype(np.int32))))
    softcap = float(spec.softcap)

    def attend_group(q, k_src, v_src, feats, plan, q_idx, q_pos, keys, seq, key_start):
        n, num_keys = plan
        if latent:  # each page gathered once: [n, num_keys, 1, 576], the values a slice of it
            k = k_src[keys].reshape(n, num_keys, 1, spec.head_dim)
            v = k[..., :value_dim]
        elif host.paged:
            k = k_src[keys].reshape(n, num_keys, spec.num_kv_heads, spec.head_dim)
            v = v_src[keys].reshape(n, num_keys, spec.num_kv_heads, spec.head_dim)
        else:
            k, v = k_src[keys], v_src[keys]  # [n, num_keys, Hkv, D]
        key_pos = key_start[:, None, None] + jnp.arange(num_keys)[None, None, :]  # [n, 1, num_keys]

        def one_chunk(c):
            qi, qp = c  # [n, chunk]
            qc = q[jnp.minimum(qi, T - 1)]
            offset = key_pos - qp[..., None]  # [n, chunk, num_keys]: key minus query position
            visible = (offset <= 0) & (key_pos < seq[:, None, None])
            if left >= 0:
                visible &= offset >= -left
            if remat:
                visible |= ~visible.any(axis=-1, keepdims=True)
            return _dense(qc, k, v, visible, scale, offset=offset, softcap=softcap, **feats)

        body = jax.checkpoint(one_chunk) if remat else one_chunk
        out = jax.lax.map(body, (q_idx, q_pos))  # [num_chunks, n, chunk, Hq, D]
        return out, q_idx

    @jax.jit
    def fn(q, k_src, v_src, feats, *gargs):
        out = jnp.zeros((T + 1, spec.num_q_heads, value_dim), q.dtype)  # row T: sink for padding
        for plan, ga in zip(plans, gargs):
            o, q_idx = attend_group(q, k_src, v_src, feats, plan, *ga)
            out = out.at[q_idx.reshape(-1)].set(o.reshape(-1, *o.shape[3:]))
        return out[:T]

    def args_for(b: Batch):
        a = b.arrays
        if latent:
            k_src, v_src = a["kv_cache"], None
        else:
            k_src, v_src = (a["k_cache"], a["v_cache"]) if host.paged else (a["k"], a["v"])
        feats = {k: a[k] for k in ("alibi_slopes", "sinks") if k in spec.features}
        return (a["q"], k_src, v_src, feats, *group_args)

    note = (f"{len(plans)} dense groups" + (", the window's pages only" if host.paged and left >= 0 else "")
            + (", latent rows gathered once (values: their first kv_lora_rank dims)" if latent else "")
            + (", query chunks rematerialised" if remat else ""))
    return Prepared(fn, [args_for(b) for b in batches], identity, note=note)


def _prepare_jnp_bwd(batches: list[Batch], options: Options) -> Prepared:
    return with_grads(_prepare_jnp(batches, options, remat=True), batches)


def _prepare_jnp_sparse(batches: list[Batch], options: Options) -> Prepared:
    host, spec = batches[0].host, batches[0].spec
    token_req = jnp.asarray(np.repeat(np.arange(host.num_seqs), host.q_lens).astype(np.int32))
    scale, bs, rank = _scale(spec), spec.block_size, spec.kv_lora_rank

    @jax.jit
    def fn(q, kv_cache, tables, topk, token_req):
        pos = jnp.maximum(topk, 0)
        rows = kv_cache[tables[token_req[:, None], pos // bs], pos % bs]  # [T, topk, 576] gathered
        s = jnp.einsum("thd,tkd->thk", q, rows, preferred_element_type=jnp.float32) * scale
        s = jnp.where((topk >= 0)[:, None, :], s, -jnp.inf)
        p = jax.nn.softmax(s, axis=-1)
        o = jnp.einsum("thk,tkd->thd", p.astype(q.dtype), rows[..., :rank], preferred_element_type=jnp.float32)
        return o.astype(q.dtype)

    args = [(b.arrays["q"], b.arrays["kv_cache"], b.arrays["block_tables"], b.arrays["topk_indices"], token_req)
            for b in batches]
    return Prepared(fn, args, identity, note="gather + dense")


# ---------------------------------------------------------------------------------------------- tokamax
def _accept_out_shape():
    """Let ``plgpu.kernel`` take ``out_shape=`` and ``scratch_shapes=``, the names tokamax 0.0.12 (the last release
    with its kernels) passes: JAX 0.11 renamed them ``out_type`` / ``scratch_types`` and passes unknown keywords on
    to ``Mesh``, which rejects them."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    kernel = plgpu.kernel
    if "out_shape" in inspect.signature(kernel).parameters or getattr(kernel, "accepts_out_shape", False):
        return

    @functools.wraps(kernel)
    def renamed(*args, out_shape=None, scratch_shapes=None, **kwargs):
        if out_shape is not None:
            kwargs["out_type"] = out_shape
        if scratch_shapes is not None:
            kwargs["scratch_types"] = scratch_shapes
        return kernel(*args, **kwargs)

    renamed.accepts_out_shape = True
    plgpu.kernel = renamed


def _prepare_tokamax_bwd(batches: list[Batch], options: Options) -> Prepared:
    try:
        import tokamax
        from absl import flags
    except ImportError as e:
        raise NotImplementedError("tokamax_mosaic needs the tokamax package (pip install tokamax)") from e
    if not flags.FLAGS.is_parsed():  # tokamax's config parses sys.argv on first read: the harness's flags are not its
        flags.FLAGS(sys.argv[:1])
    _accept_out_shape()
    if options.interpret:
        raise NotImplementedError("tokamax_mosaic is a Mosaic GPU (Hopper) kernel: GPU only, no interpret mode")
    host = batches[0].host
    layout = _Padded(host)
    lens = jnp.asarray(host.q_lens, jnp.int32)

    # Key lengths only: the padding queries' rows (finite, over their request's keys) get a zero cotangent, so they
    # reach no gradient, and the mask stays the kernel's causal + key-length form (no dense mask array).
    @jax.jit
    def fn(q, k, v, kv_lens):
        return tokamax.dot_product_attention(q, k, v, is_causal=True, key_value_seq_lengths=kv_lens,
                                             implementation="mosaic")

    args = [(layout.pad(b.arrays["q"]), layout.pad(b.arrays["k"]), layout.pad(b.arrays["v"]), lens) for b in batches]
    forward = Prepared(fn, args, layout.pack, note=f"padded to [{host.num_seqs}, {layout.length}], key lengths")
    return with_grads(forward, batches, cotangent=layout.pad_zeros, grads=layout.pack_all)


# ---------------------------------------------------------------------------------------------- dense MLA
def all_positions_topk(host: HostBatch) -> np.ndarray:
    """i32[num_tokens, max seq_len]: every key a token sees, as sparse top-k indices: token ``i`` of a request with
    ``ctx`` cached keys sits at position ``ctx + i`` and selects positions ``0 .. ctx + i`` (ascending); ``-1``
    pads the rest."""
    token_req = np.repeat(np.arange(host.num_seqs), host.q_lens)
    token_pos = host.context_lens[token_req] + np.arange(host.num_tokens) - host.cu_query_lens[token_req]
    positions = np.arange(int(host.seq_lens.max()))[None, :]
    return np.where(positions <= token_pos[:, None], positions, -1).astype(np.int32)


def _prepare_sparse_all(batches: list[Batch], options: Options) -> Prepared:
    import pallas_attn
    host, spec = batches[0].host, batches[0].spec
    topk = jnp.asarray(all_positions_topk(host))
    kw = dict(kv_lora_rank=spec.kv_lora_rank, interpret=options.interpret)
    fn = jax.jit(lambda q, kv, bt, ti, sl, cu: pallas_attn.sparse_mla_attention(q, kv, bt, ti, cu_query_lens=cu,
                                                                                 seq_lens=sl, **kw))
    args = [(b.arrays["q"], b.arrays["kv_cache"], b.arrays["block_tables"], topk, b.arrays["seq_lens"],
             mla_cu_query_lens(b)) for b in batches]
    return Prepared(fn, args, identity, note=f"top-k = all {topk.shape[1]} positions, -1 past each token's keys")


def _latent_head_dim_limit(spec: Spec) -> frozenset[str]:
    """paged_attention's head-dim limit, for the latent cache as one KV head of ``head_dim`` dims."""
    from pallas_attn.core.validation import MAX_HEAD_DIM
    return frozenset({f"head_dim {spec.head_dim} > {MAX_HEAD_DIM}"}) if spec.head_dim > MAX_HEAD_DIM else frozenset()


def _prepare_paged_latent(batches: list[Batch], options: Options) -> Prepared:
    import pallas_attn
    host, spec = batches[0].host, batches[0].spec
    kw = dict(max_query_len=host.max_query_len, interpret=options.interpret)
    # paged_attention wants K and V of one shape: both are the whole latent row, and P·V runs over all its dims
    fn = jax.jit(lambda q, kv, bt, sl, cu: pallas_attn.paged_attention(q, kv, kv, bt, sl, cu, **kw))
    args = [(b.arrays["q"], b.arrays["kv_cache"][:, :, None, :], b.arrays["block_tables"], b.arrays["seq_lens"],
             b.arrays["cu_query_lens"]) for b in batches]
    return Prepared(fn, args, lambda out: out[..., :spec.kv_lora_rank],
                    note=f"one KV head of {spec.head_dim} dims as K and V, output sliced to {spec.kv_lora_rank}")


def _lazy_naive_triton(batches: list[Batch], options: Options) -> Prepared:
    from benchmarks.naive_triton import prepare_naive_triton  # imports triton only when this anchor runs
    return prepare_naive_triton(batches, options)


# ---------------------------------------------------------------------------------------------- registry
def _ids(*ids):
    return lambda s: s.id in ids


def _ids_or_model_cells(*ids, kind: str):
    """The standard workloads ``ids``, and the model-shaped grid's cells of ``kind`` (its causal ones: these anchors
    attend causally, so the bidirectional encoder cells have none), so each cell has its best anchor."""
    return lambda s: s.id in ids or (s.family == "models" and s.kind == kind and s.causal)


def _forward_or_step(forward, step):
    """One anchor on the prefill workloads and their training steps: ``step`` for a ``prefill-bwd`` workload."""
    return lambda batches, options: (step if batches[0].spec.kind == "prefill-bwd" else forward)(batches, options)


def _standard_mla(spec: Spec) -> bool:
    return spec.kind == "mla" and not spec.family


def _jnp_features(spec: Spec) -> frozenset[str]:
    """The jnp floor runs every model-family feature except on sparse MLA; the other anchors run none."""
    return frozenset() if spec.kind == "sparse" else frozenset(FEATURE_KWARGS)


ANCHORS: list[Impl] = [
    Impl("cudnn", _ids_or_model_cells("P1", "P2", "P1-bwd", "P2-bwd", kind="prefill"),
         _forward_or_step(_prepare_cudnn, _prepare_cudnn_bwd)),
    Impl("cudnn/packed", _ids("P1"), _prepare_cudnn_packed),
    Impl("cudnn/paged", _ids_or_model_cells("D1", "D2", kind="decode"), _prepare_cudnn_paged),
    Impl("jax_pallas_mha", _ids("P1", "P2", "P1-bwd", "P2-bwd"), _prepare_jax_mha),
    Impl("jax_pallas_mgpu", _ids_or_model_cells("P1", "P2", kind="prefill"), _prepare_jax_mgpu),
    Impl("tokamax_mosaic", _ids("P1-bwd", "P2-bwd"), _prepare_tokamax_bwd),
    Impl("jax_pallas_decode", _ids_or_model_cells("D1", "D2", kind="decode"), _prepare_jax_decode),
    Impl("jax_pallas_paged", _ids_or_model_cells("D1", "D2", "V1", kind="decode"), _prepare_jax_paged),
    Impl("jnp", lambda s: not s.family, _forward_or_step(_prepare_jnp, _prepare_jnp_bwd), features=_jnp_features),
    Impl("sparse_mla_attention/all", _standard_mla, _prepare_sparse_all),
    Impl("paged_attention/latent", _standard_mla, _prepare_paged_latent, limits=_latent_head_dim_limit),
    Impl("naive_triton", _ids("P1", "P2"), _lazy_naive_triton),
]
