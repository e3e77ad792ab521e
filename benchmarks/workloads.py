"""The benchmark workloads as data, their device-array builders and their derived metrics.

A workload is a :class:`Spec`: shapes plus a list of request :class:`Group` s (new query tokens and keys per
request). :func:`build_host` turns it into a :class:`HostBatch` (numpy lengths, page tables, top-k indices),
drawing every random number from ONE ``np.random.default_rng(seed)`` in a fixed order: the groups' lengths first,
then the page permutation (the pool holds exactly the pages needed, logical page ``i`` of the batch in request-major
order is physical page ``perm[i]``), then the sparse top-k sets. :func:`build_arrays` makes the device arrays from a
``jax.random`` key (fast on the GPU, and a new key gives a fresh input set with the same metadata).

Metric formulas (all counted from the host metadata, never from the kernel):

* useful causal FLOPs  = 4 · Σ visible (query, key) pairs · head_dim · num_q_heads
  (request b with ``q_len`` new tokens after ``ctx = seq_len - q_len`` cached ones sees
  ``q_len·ctx + q_len·(q_len+1)/2`` pairs; prefill is ``ctx = 0``, decode ``q_len = 1``; with a left window
  ``left``, the query at position ``p`` sees ``min(p + 1, left + 1)`` keys)
* training-step FLOPs  = 3.5 × the useful causal FLOPs (``prefill-bwd``: P1-bwd, P2-bwd). The timed call is one
  training step of the attention: the forward and, through ``jax.vjp``, the backward for a fixed cotangent
  ``d_out`` (what ``jax.grad`` of a loss through the call runs, the loss aside). Per visible pair and query head
  the forward does two matmuls (QKᵀ, P·V) and the backward five (QKᵀ again, dP = dO·Vᵀ, dV = Pᵀ·dO, dQ = dS·K,
  dK = dSᵀ·Q): 1 + 2.5 = 3.5 forwards, FlashAttention's count. FlashAttention's published backward figures divide
  the 2.5 by the backward's time alone: they are not this metric
* K/V bytes            = Σ keys read · num_kv_heads · head_dim · 2 (K and V) · itemsize  +  q bytes  +  out bytes
  (keys read = ``seq_len``, or with a left window ``min(seq_len, q_len + left)``: the keys inside some query's
  window; a windowed decode reads ``min(seq_len, left + 1)``)
* sparse MLA FLOPs     = Σ_tokens Σ_valid-indices (2 · H · 576  +  2 · H · 512)      (QKᵀ over 576, PV over 512)
* sparse gathered bytes = Σ_tokens Σ_valid-indices 576 · itemsize
* dense MLA FLOPs      = Σ visible (query, key) pairs · H · (2 · 576  +  2 · 512)
  (the exact causal count: token ``i`` of a request's ``q_len`` new tokens sees ``seq_len - q_len + i + 1`` keys, so
  a request adds ``q_len·ctx + q_len·(q_len+1)/2`` pairs; a decode token sees all ``seq_len``)
* dense MLA latent bytes = Σ_requests seq_len · 576 · itemsize  (each latent row read once, keys and values alike)

A spec also carries the model-family features of docs/design.md#model-family-features (``window_size``,
``softcap``, ``sinks`` and ``alibi`` on/off; the f32[num_q_heads] sinks and slopes are drawn in
:func:`build_arrays`), and may name a ``twin``: the workload of the same run it is measured against (W1 against
the same batch at a short context, W2 against P2).

Every workload has a ``--tiny`` twin (same structure, a few dozen tokens, 4 query heads; the MLA ones a few hundred
tokens, 16 heads at their real 576 / 512 dims) so the whole harness runs on CPU in interpret mode in seconds.
Beside the standard workloads, :data:`FAMILIES` holds grids run on demand (``--family NAME``): the split-KV sweep,
the prefill shapes the default-backend rule is set on, and sparse decode batches of other sizes.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

L2_BYTES = 50 * 2**20  # H200 L2 (50 MB): smaller inputs are rotated between several sets when timed
MAX_INPUT_BYTES = 40 * 2**30  # all input sets of a workload together (an H200 holds 141 GB)


# ----------------------------------------------------------------------------------------------- spec as data
@dataclasses.dataclass(frozen=True)
class Draw:
    """Lengths drawn as ``rng.integers(low, high + 1, n)`` (``high`` inclusive)."""
    low: int
    high: int
    n: int


@dataclasses.dataclass(frozen=True)
class Group:
    """Requests that share a query length.

    ``seq_lens``: keys per request, the new tokens included (a tuple or a :class:`Draw`).
    ``q_len``: new query tokens per request; ``None`` means the whole request is new (prefill, q_len = seq_len).
    """
    seq_lens: tuple[int, ...] | Draw
    q_len: int | None = None


@dataclasses.dataclass(frozen=True)
class Spec:
    """One benchmark workload.

    kind: ``prefill`` (packed contiguous q/k/v, :func:`pallas_attn.varlen_attention`), ``prefill-bwd`` (a prefill
    batch as a training step: the forward and its gradients for q, k, v under a fixed cotangent ``d_out``
    ``[num_tokens, num_q_heads, head_dim]``), ``decode`` (one query per request over a paged cache), ``ragged``
    (packed new tokens over a paged cache, :func:`pallas_attn.paged_attention`), ``sparse`` (top-k sparse MLA over
    a paged latent cache) or ``mla`` (dense MLA over a paged latent cache,
    :func:`pallas_attn.mla_attention`: a decode when every request has one new token, else causal multi-token
    steps). Both MLA kinds keep one latent head per position (``num_kv_heads`` 1) of ``head_dim`` dims (576), the
    values its first ``kv_lora_rank``.
    units: the derived metrics reported, primary first.
    family: "" for the standard workloads, else the :data:`FAMILIES` grid the workload belongs to (anchors and the
    jnp floor run on the standard workloads only).
    window_size, softcap, sinks, alibi: the model-family features every call of the workload uses
    (docs/design.md#model-family-features): ``window_size=(left, right)`` (-1: unbounded), ``softcap`` (0: off),
    ``sinks`` / ``alibi``: pass f32[num_q_heads] sinks / ALiBi slopes, drawn by :func:`build_arrays`.
    twin: the id of the workload whose row of the same implementation and unit divides this one's metric
    (``ratio_to_twin``); the harness runs the twin whenever this workload runs.
    kv_dtype: the paged cache's dtype when it is not ``dtype``: an FP8 format (``float8_e4m3fn``), drawn as the
    same normal values quantised with :data:`FP8_KV_SCALE` and passed with ``k_scale`` / ``v_scale``.
    causal: prefill only; False is a bidirectional (encoder) prefill, every query seeing its whole request.
    """
    id: str
    kind: str
    what: str
    groups: tuple[Group, ...]
    seed: int = 0
    num_q_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    dtype: str = "bfloat16"
    block_size: int = 16
    topk: int = 0  # sparse only
    kv_lora_rank: int = 512  # sparse and mla only: value dims (the first kv_lora_rank of head_dim)
    units: tuple[str, ...] = ("TFLOP/s",)
    family: str = ""
    window_size: tuple[int, int] = (-1, -1)  # (left, right); -1 means unbounded
    softcap: float = 0.0  # 0 means off
    sinks: bool = False
    alibi: bool = False
    twin: str = ""
    causal: bool = True
    kv_dtype: str = ""
    kv_scale_mode: str = "tensor"  # with kv_dtype: "token" for per-(token, head) scale caches

    @property
    def jnp_dtype(self):
        return jnp.dtype(self.dtype)

    @property
    def kv_jnp_dtype(self):
        """The dtype of K and V (the paged cache's: ``kv_dtype``, else ``dtype``)."""
        return jnp.dtype(self.kv_dtype or self.dtype)

    @property
    def kv_row_bytes(self) -> int:
        """Bytes of one key's (or value's) row for one KV head: its elements, and with per-(token, head) FP8
        scales its float32 scale."""
        return self.head_dim * self.kv_jnp_dtype.itemsize + (4 if self.kv_dtype and self.kv_scale_mode == "token"
                                                             else 0)

    @property
    def features(self) -> frozenset[str]:
        """The model-family features in use, by keyword of the public functions (:data:`FEATURE_KWARGS`)."""
        used = {"window_size": self.window_size != (-1, -1), "softcap": bool(self.softcap),
                "alibi_slopes": self.alibi, "sinks": self.sinks, **dict.fromkeys(FP8_KWARGS, bool(self.kv_dtype))}
        return frozenset(k for k, on in used.items() if on)

    def feature_kwargs(self, arrays: dict) -> dict:
        """The keyword arguments of the features in use, for a kernel or a reference call (``arrays`` from
        :func:`build_arrays` holds the sinks and slopes); an empty dict for a workload without features."""
        values = {"window_size": self.window_size, "softcap": float(self.softcap),
                  **{k: arrays.get(k) for k in ("alibi_slopes", "sinks", *FP8_KWARGS)}}
        return {k: values[k] for k in sorted(self.features)}

    @property
    def window_left(self) -> int:
        return self.window_size[0]


# The model-family keywords of varlen_attention, paged_decode_attention and paged_attention, and the Spec field
# (or --variant key) that sets each.
FEATURE_KWARGS = {"window_size": "window_size", "softcap": "softcap", "alibi_slopes": "alibi", "sinks": "sinks"}
FP8_KWARGS = ("k_scale", "v_scale")  # the paged functions' scales of an FP8 cache (Spec.kv_dtype)
FP8_KV_SCALE = 1 / 64  # normal K and V of |x| < 7 stored under 448, e4m3's largest finite value
PACKED_KINDS = ("prefill", "prefill-bwd")  # contiguous packed q, k, v (no pages)
# A training step's FLOPs per forward FLOP: the forward's two matmuls per visible pair and the backward's five
# (FlashAttention's count, its backward = 2.5 forwards).
TRAINING_FLOP_FACTOR = 3.5


def _training_step(spec: Spec, what: str) -> Spec:
    """``<id>-bwd``: the prefill workload's batch (groups, heads, dims, dtype, seed: the same q, k, v) timed as a
    training step (kind ``prefill-bwd``)."""
    return dataclasses.replace(spec, id=f"{spec.id}-bwd", kind="prefill-bwd", what=what)


def _gpt_oss_decode(ctx: int, window: int, batch: int, shapes: dict) -> tuple[Spec, Spec]:
    """W1: gpt-oss-shaped decode (sliding window, sinks) at a long context, and W1-short, the same batch at a
    context of one window: W1's ``ratio_to_twin`` is then the cost of the long context beyond its window (1 at
    best; both read the same bytes)."""
    def spec(wid, n, what):
        return Spec(wid, "decode", what, (Group((n,) * batch, 1),), window_size=(window - 1, 0), sinks=True,
                    units=("GB/s",), twin="W1-short" if wid == "W1" else "", **shapes)

    return (spec("W1-short", window, f"W1 at ctx {window}: {batch} requests, sliding window {window}, sinks"),
            spec("W1", ctx, f"gpt-oss-shaped decode, {batch} requests ctx {ctx}, sliding window {window}, sinks"))


_P1_LENS = (8192, 4096, 4096, 2048, 2048, 2048, 1024, 1024, 1024, 1024, 512, 512, 512, 512, 256, 256)
_MLA = dict(num_kv_heads=1, head_dim=576, kv_lora_rank=512, block_size=64)  # the latent cache of L1 and L2

_P1 = Spec("P1", "prefill", "varlen prefill, 16 requests 256..8192", (Group(_P1_LENS),))
_P2 = Spec("P2", "prefill", "long prefill, one request of 32768", (Group((32768,)),))
WORKLOADS: dict[str, Spec] = {s.id: s for s in [
    _P1,
    _P2,
    Spec("D1", "decode", "paged decode, 64 requests ctx 1k..8k, block 16", (Group(Draw(1024, 8192, 64), 1),),
         units=("GB/s",)),
    Spec("D2", "decode", "long-context decode (split-KV), ctx 20000..131072",
         (Group((20000, 35000, 65536, 131072), 1),), units=("GB/s",)),
    Spec("V1", "ragged", "verification, 32 requests 4k..16k, 6 new tokens each", (Group(Draw(4096, 16384, 32), 6),),
         seed=1, units=("GB/s",)),
    Spec("M1", "ragged", "mixed: 4 chunks 512 over 4096 + 56 decodes 1k..8k + 8 verifications q=6",
         (Group((4608,) * 4, 512), Group(Draw(1024, 8192, 56), 1), Group(Draw(1024, 8192, 8), 6)),
         units=("GB/s", "TFLOP/s")),
    Spec("S1", "sparse", "sparse MLA decode, 64 requests ctx 32768, top-k 2048, 128 heads, 576/512",
         (Group((32768,) * 64, 1),), num_q_heads=128, num_kv_heads=1, head_dim=576, block_size=64, topk=2048,
         units=("TFLOP/s", "GB/s")),
    # DeepSeek-V3 / Kimi-K2 attention: 128 heads, 16 on each GPU of a tensor-parallel group of 8
    Spec("L1", "mla", "dense MLA decode, 128 requests ctx 4k..8k, 16 heads (TP-8 of 128), block 64, 576/512",
         (Group(Draw(4096, 8192, 128), 1),), num_q_heads=16, units=("GB/s", "TFLOP/s"), **_MLA),
    Spec("L2", "mla", "dense MLA, 64 requests ctx 8192, 2 new tokens each (MTP), 128 heads, block 64, 576/512",
         (Group((8192,) * 64, 2),), num_q_heads=128, units=("TFLOP/s", "GB/s"), **_MLA),
    # model-family workloads (not in the default run; --only W1,W2 runs them and their twins)
    *_gpt_oss_decode(32768, 128, 64, dict(num_q_heads=64, num_kv_heads=8, head_dim=64)),
    Spec("W2", "prefill", "Mistral-shaped prefill, one request of 32768, sliding window 4096", (Group((32768,)),),
         window_size=(4095, 0), twin="P2"),
    # training steps: forward + backward, TFLOP/s over TRAINING_FLOP_FACTOR × the forward's useful FLOPs
    _training_step(_P1, "P1 as a training step: forward + backward (dq, dk, dv), 16 requests 256..8192"),
    _training_step(_P2, "P2 as a training step: forward + backward (dq, dk, dv), one request of 32768"),
]}

_TINY = dict(num_q_heads=4, num_kv_heads=2, head_dim=32)
_TINY_P1 = Spec("P1", "prefill", "tiny varlen prefill", (Group((48, 32, 17, 16, 8, 7)),), **_TINY)
_TINY_P2 = Spec("P2", "prefill", "tiny long prefill", (Group((96,)),), **_TINY)
TINY_WORKLOADS: dict[str, Spec] = {s.id: s for s in [
    _TINY_P1,
    _TINY_P2,
    Spec("D1", "decode", "tiny paged decode", (Group(Draw(16, 96, 4), 1),), units=("GB/s",), **_TINY),
    Spec("D2", "decode", "tiny long-context decode", (Group((20, 35, 66, 131), 1),), units=("GB/s",), **_TINY),
    Spec("V1", "ragged", "tiny verification", (Group(Draw(16, 64, 3), 6),), seed=1, units=("GB/s",), **_TINY),
    Spec("M1", "ragged", "tiny mixed", (Group((48,), 16), Group(Draw(16, 64, 3), 1), Group(Draw(16, 64, 2), 6)),
         units=("GB/s", "TFLOP/s"), **_TINY),
    Spec("S1", "sparse", "tiny sparse MLA decode", (Group((128,) * 2, 1),), num_q_heads=16, num_kv_heads=1,
         head_dim=576, block_size=16, topk=64, units=("TFLOP/s", "GB/s")),
    Spec("L1", "mla", "tiny dense MLA decode", (Group(Draw(100, 300, 4), 1),), num_q_heads=16,
         units=("GB/s", "TFLOP/s"), **{**_MLA, "block_size": 16}),
    Spec("L2", "mla", "tiny dense MLA, 2 new tokens each", (Group((96, 150, 257), 2),), num_q_heads=16,
         units=("TFLOP/s", "GB/s"), **{**_MLA, "block_size": 16}),
    *_gpt_oss_decode(96, 16, 4, _TINY),
    Spec("W2", "prefill", "tiny windowed prefill", (Group((96,)),), window_size=(31, 0), twin="P2", **_TINY),
    _training_step(_TINY_P1, "tiny varlen prefill as a training step"),
    _training_step(_TINY_P2, "tiny long prefill as a training step"),
]}

SPLIT_SWEEP_BATCHES = (1, 4, 16, 64)
SPLIT_SWEEP_CTX = (1024, 8192, 32768, 131072)
TINY_SPLIT_SWEEP_BATCHES = (1, 2)
TINY_SPLIT_SWEEP_CTX = (32, 128)


def split_sweep_specs(tiny: bool = False) -> list[Spec]:
    """Decode over batch × context (uniform contexts), for the split-KV on/off comparison."""
    batches = TINY_SPLIT_SWEEP_BATCHES if tiny else SPLIT_SWEEP_BATCHES
    contexts = TINY_SPLIT_SWEEP_CTX if tiny else SPLIT_SWEEP_CTX
    extra = _TINY if tiny else {}
    return [Spec(f"split-b{b}-c{c}", "decode", f"decode sweep: batch {b}, ctx {c}", (Group((c,) * b, 1),),
                 units=("GB/s",), family="split", **extra) for b in batches for c in contexts]


def _prefill_rule_lengths() -> dict[str, tuple[tuple[int, ...], int]]:
    """name: (request lengths, head_dim). The draws come from one ``default_rng(0)`` in this order (P1-unaligned,
    R64, mixed-128x1-256), so the shapes stay those of ``results/lab/prefill-backend-rule*.json``."""
    rng = np.random.default_rng(0)
    unaligned = tuple(int(n + d) for n, d in zip(_P1_LENS, rng.integers(-7, 8, len(_P1_LENS))))
    r64 = tuple(int(x) for x in rng.integers(128, 4097, 64))
    mixed = tuple(int(x) for x in rng.integers(1, 257, 128))
    shapes = {"P1-unaligned": (unaligned, 128), "R64": (r64, 128), "mixed-128x1-256": (mixed, 128),
              "P1-d64": (_P1_LENS, 64)}
    for n, length in ((256, 128), (128, 256), (64, 512), (512, 64), (1024, 32)):
        shapes[f"short-{n}x{length}"] = ((length,) * n, 128)
    for length in (64, 128, 256, 512, 1024, 2048):
        shapes[f"one-{length}"] = ((length,), 128)
    for n, length in ((64, 512), (32, 1024), (16, 2048), (8, 4096)):
        shapes[f"d64-{n}x{length}"] = ((length,) * n, 64)
    return shapes


def prefill_rule_specs(tiny: bool = False) -> list[Spec]:
    """Causal prefill shapes that decide ``varlen_attention``'s default backend: unaligned starts, many short
    requests, single requests, head_dim 64 (docs/performance.md#prefill-backend-rule)."""
    if tiny:
        return [Spec("short-4x16", "prefill", "tiny: 4 requests of 16", (Group((16,) * 4),), family="prefill-rule",
                     **_TINY),
                Spec("one-40", "prefill", "tiny: one request of 40", (Group((40,)),), family="prefill-rule", **_TINY)]

    def what(lens, d):
        uniform = min(lens) == max(lens)
        sizes = f"{len(lens)} × {lens[0]}" if uniform else f"{len(lens)} requests {min(lens)}..{max(lens)}"
        return f"causal prefill, {sizes} tokens, head_dim {d}"

    return [Spec(name, "prefill", what(lens, d), (Group(lens),), head_dim=d, family="prefill-rule")
            for name, (lens, d) in _prefill_rule_lengths().items()]


SPARSE_SHAPES = ((1, 8192, 128, 2048), (8, 8192, 128, 2048), (16, 8192, 128, 256), (64, 8192, 128, 512),
                 (64, 8192, 64, 2048), (256, 8192, 128, 2048))  # (requests, ctx, heads, top-k)


def sparse_shape_specs(tiny: bool = False) -> list[Spec]:
    """Sparse MLA decode batches beside S1 (S1's block size, dims and top-k sampling; other request counts,
    heads and top-k), for the sparse default-backend rule (docs/performance.md#sparse-mla)."""
    s1 = TINY_WORKLOADS["S1"] if tiny else WORKLOADS["S1"]
    shapes = ((2, 64, 16, 32), (3, 96, 16, 64)) if tiny else SPARSE_SHAPES
    return [dataclasses.replace(s1, id=f"sparse-b{n}-c{ctx}-h{h}-k{k}", family="sparse-shapes",
                                what=f"sparse MLA decode, {n} requests ctx {ctx}, top-k {k}, {h} heads",
                                groups=(Group((ctx,) * n, 1),), num_q_heads=h, topk=k)
            for n, ctx, h, k in shapes]


MLA_SHAPES = ((1, 32768, 16, 1), (1, 32768, 128, 1), (8, 8192, 16, 1), (8, 8192, 128, 1), (256, 2048, 16, 1),
              (128, 4096, 64, 1), (32, 4096, 128, 2), (64, 8192, 16, 2), (4, 65536, 128, 1))
# (requests, ctx, heads, new tokens): 16 heads with 2 new tokens is a TP-8 shard of DeepSeek-V3 with MTP


def mla_shape_specs(tiny: bool = False) -> list[Spec]:
    """Dense MLA batches beside L1 / L2 (their block size and dims; other request counts, contexts, heads and new
    tokens): single long requests, small and large batches, 16 to 128 heads, for mla_attention's default-backend
    rule (docs/performance.md#dense-mla)."""
    l1 = TINY_WORKLOADS["L1"] if tiny else WORKLOADS["L1"]
    shapes = ((2, 64, 16, 1), (3, 96, 16, 2)) if tiny else MLA_SHAPES
    return [dataclasses.replace(l1, id=f"mla-b{n}-c{ctx}-h{h}-q{q}", family="mla-shapes",
                                what=f"dense MLA, {n} requests ctx {ctx}, {q} new tokens each, {h} heads",
                                groups=(Group((ctx,) * n, q),), num_q_heads=h)
            for n, ctx, h, q in shapes]


# Attention shapes of models in wide use: (num_q_heads, num_kv_heads, head_dim) of one layer as a GPU sees it.
MODEL_SHAPES = {
    "llama8b": (32, 8, 128),  # Llama-3.1-8B
    "llama70b-tp8": (8, 1, 128),  # Llama-3.1-70B, one of 8 tensor-parallel shards
    "qwen32b": (64, 8, 128),  # Qwen3-32B-like
    "gptoss": (64, 8, 64),  # gpt-oss (its window and sinks aside: the plain layers)
    "gemma3": (16, 8, 256),  # Gemma-3 12B
}
ENCODER_SHAPES = {"enc-d64": (16, 16, 64), "enc-d128": (16, 16, 128)}  # bidirectional MHA (BERT/ViT-like)
MODEL_DECODE_BATCHES = (1, 8, 64, 256)
MODEL_DECODE_CTX = (1024, 8192, 32768, 131072)
MODEL_KV_BYTES = 24 * 2**30  # decode cells whose K/V would pass this are left out (one input set must fit)
MODEL_PREFILL_BATCHES = {  # name: request lengths
    "many-short": (256,) * 128,
    "mixed": _P1_LENS,
    "few-long": (16384, 16384),
}
MODEL_BLOCK_SIZES = (16, 64)  # 64 on llama8b only: the page size's effect, not a second grid


def model_grid_specs(tiny: bool = False) -> list[Spec]:
    """The attention shapes real models have (:data:`MODEL_SHAPES`, :data:`ENCODER_SHAPES`): decode over batch ×
    context (block 16; llama8b also block 64) and of 64 requests of mixed lengths, prefill of many short, mixed and
    few long requests (causal), and bidirectional encoder prefill. ``python -m benchmarks.run --family models``; each
    cell's ``ratio_to_ceiling`` is what counts (docs/performance.md#model-shaped-grid)."""
    if tiny:
        return [Spec("llama8b-decode-b2-c64-bs16", "decode", "tiny model decode", (Group((64,) * 2, 1),),
                     units=("GB/s",), family="models", **_TINY),
                Spec("llama8b-prefill-mixed", "prefill", "tiny model prefill", (Group((40, 17, 8)),), family="models",
                     **_TINY),
                Spec("enc-d64-prefill-few", "prefill", "tiny encoder prefill", (Group((24, 9)),), causal=False,
                     family="models", num_q_heads=4, num_kv_heads=4, head_dim=32)]
    specs = []
    for model, (hq, hkv, d) in MODEL_SHAPES.items():
        shape = dict(num_q_heads=hq, num_kv_heads=hkv, head_dim=d, family="models")
        for bs in MODEL_BLOCK_SIZES if model == "llama8b" else MODEL_BLOCK_SIZES[:1]:
            for b in MODEL_DECODE_BATCHES:
                for c in MODEL_DECODE_CTX:
                    if 2 * b * c * hkv * d * 2 > MODEL_KV_BYTES:
                        continue
                    specs.append(Spec(f"{model}-decode-b{b}-c{c}-bs{bs}", "decode",
                                      f"{model} decode ({hq}/{hkv}/{d}), {b} requests at context {c}, block {bs}",
                                      (Group((c,) * b, 1),), block_size=bs, units=("GB/s",), **shape))
        # a batch of mixed lengths (D1's draw): uniform cells have no tail for the split heuristic to balance
        specs.append(Spec(f"{model}-decode-b64-mixed-bs16", "decode",
                          f"{model} decode ({hq}/{hkv}/{d}), 64 requests at contexts 1k..8k, block 16",
                          (Group(Draw(1024, 8192, 64), 1),), units=("GB/s",), **shape))
        for name, lens in MODEL_PREFILL_BATCHES.items():
            specs.append(Spec(f"{model}-prefill-{name}", "prefill",
                              f"{model} causal prefill ({hq}/{hkv}/{d}), {len(lens)} requests {min(lens)}..{max(lens)}",
                              (Group(lens),), **shape))
    for model, (hq, hkv, d) in ENCODER_SHAPES.items():
        for name, lens in (("many", (512,) * 64), ("few", (4096,) * 4)):
            specs.append(Spec(f"{model}-prefill-{name}", "prefill",
                              f"bidirectional prefill ({hq}/{hkv}/{d}), {len(lens)} requests of {lens[0]}",
                              (Group(lens),), causal=False, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                              family="models"))
    return specs


def fp8_specs(tiny: bool = False) -> list[Spec]:
    """D1, D2 and V1 over an e4m3 cache with per-tensor scales (``D1-fp8``...) and with per-(token, head) scale
    caches (``D1-fp8-token``...), each beside its bf16 twin: ``median_ms`` over the twin's is the time an FP8 cache
    takes, and GB/s counts the FP8 bytes (and the scales read). ``python -m benchmarks.run --family fp8``."""
    table = TINY_WORKLOADS if tiny else WORKLOADS
    return [dataclasses.replace(table[w], id=f"{w}-fp8{suffix}", what=f"{table[w].what}, e4m3 cache{what}",
                                kv_dtype="float8_e4m3fn", kv_scale_mode=mode, twin=w, family="fp8")
            for suffix, what, mode in (("", "", "tensor"), ("-token", ", per-token scales", "token"))
            for w in ("D1", "D2", "V1")]


FAMILIES = {"split": split_sweep_specs, "prefill-rule": prefill_rule_specs, "sparse-shapes": sparse_shape_specs,
            "mla-shapes": mla_shape_specs, "models": model_grid_specs, "fp8": fp8_specs}


def family_specs(names, tiny: bool = False) -> list[Spec]:
    unknown = [n for n in names if n not in FAMILIES]
    if unknown:
        raise ValueError(f"unknown workload families {unknown}; known: {sorted(FAMILIES)}")
    return [spec for n in names for spec in FAMILIES[n](tiny)]


def find_spec(workload_id: str, tiny: bool = False) -> Spec | None:
    """The spec of a standard or family workload id, or None."""
    table = TINY_WORKLOADS if tiny else WORKLOADS
    if workload_id in table:
        return table[workload_id]
    return next((s for s in family_specs(list(FAMILIES), tiny) if s.id == workload_id), None)


def get_specs(ids, tiny: bool = False) -> list[Spec]:
    table = TINY_WORKLOADS if tiny else WORKLOADS
    unknown = [i for i in ids if i not in table]
    if unknown:
        raise ValueError(f"unknown workload ids {unknown}; known: {sorted(table)}")
    return [table[i] for i in ids]


# ------------------------------------------------------------------------------------------------ host side
@dataclasses.dataclass
class HostBatch:
    """Numpy metadata of a workload (no device arrays).

    q_lens, seq_lens: i64[num_seqs]; cu_query_lens: i32[num_seqs + 1] (packed query rows);
    block_tables: i32[num_seqs, max_blocks] (paged kinds; entries past a request's last page are 0, a real page,
    so anchors that read whole table rows stay in range); num_pages: pool size;
    topk_indices: i32[num_tokens, topk] request-local positions (sparse only).
    """
    spec: Spec
    q_lens: np.ndarray
    seq_lens: np.ndarray
    cu_query_lens: np.ndarray
    block_tables: np.ndarray | None
    num_pages: int
    topk_indices: np.ndarray | None

    @property
    def num_seqs(self) -> int:
        return int(self.q_lens.size)

    @property
    def num_tokens(self) -> int:
        return int(self.cu_query_lens[-1])

    @property
    def max_query_len(self) -> int:
        return int(self.q_lens.max())

    @property
    def context_lens(self) -> np.ndarray:
        return self.seq_lens - self.q_lens

    @property
    def paged(self) -> bool:
        return self.spec.kind not in PACKED_KINDS

    @property
    def one_token_each(self) -> bool:
        """Every request has one new token: the MLA kinds then call without ``cu_query_lens`` (decode)."""
        return bool(np.all(self.q_lens == 1))

    # ---- derived metrics -------------------------------------------------------------------------------------
    def visible_pairs(self) -> int:
        """Σ over queries of the keys each sees: positions ``ctx .. seq_len - 1``, the query at ``p`` seeing
        ``p + 1`` keys, or ``min(p + 1, left + 1)`` with a left window (causal: a right window changes nothing);
        a bidirectional prefill, ``seq_len`` each."""
        seq, ctx = self.seq_lens.astype(np.int64), self.context_lens.astype(np.int64)
        if not self.spec.causal:
            return int(np.sum(self.q_lens.astype(np.int64) * seq))
        return int(np.sum(_keys_before(seq, self.spec.window_left) - _keys_before(ctx, self.spec.window_left)))

    def keys_read(self) -> np.ndarray:
        """i64[num_seqs]: keys inside some query's window, those a kernel must read (``seq_len`` without a left
        window, else ``min(seq_len, q_len + left)``)."""
        seq = self.seq_lens.astype(np.int64)
        left = self.spec.window_left
        return seq if left < 0 else np.minimum(seq, self.q_lens.astype(np.int64) + left)

    def flops(self) -> float:
        s = self.spec
        if s.kind == "sparse":
            valid = int(np.sum(self.topk_indices >= 0))
            return float(valid * (2 * s.num_q_heads * s.head_dim + 2 * s.num_q_heads * s.kv_lora_rank))
        if s.kind == "mla":  # QKᵀ over the 576 dims, P·V over the first kv_lora_rank
            return float(self.visible_pairs() * s.num_q_heads * (2 * s.head_dim + 2 * s.kv_lora_rank))
        forward = 4 * self.visible_pairs() * s.head_dim * s.num_q_heads
        return float(TRAINING_FLOP_FACTOR * forward if s.kind == "prefill-bwd" else forward)

    def bytes_moved(self) -> float:
        s = self.spec
        item = s.jnp_dtype.itemsize
        if s.kind == "sparse":
            return float(int(np.sum(self.topk_indices >= 0)) * s.head_dim * item)
        if s.kind == "mla":  # one latent row per key, read once for keys and values
            return float(int(np.sum(self.keys_read())) * s.head_dim * item)
        kv = int(np.sum(self.keys_read())) * s.num_kv_heads * 2 * s.kv_row_bytes
        q_out = 2 * self.num_tokens * s.num_q_heads * s.head_dim * item
        return float(kv + q_out)

    def metric(self, unit: str, seconds: float) -> float:
        if unit == "TFLOP/s":
            return self.flops() / seconds / 1e12
        if unit == "GB/s":
            return self.bytes_moved() / seconds / 1e9
        raise ValueError(f"unknown {unit=}")

    def input_bytes(self, touched: bool = False) -> int:
        """Bytes of the device inputs; ``touched``: only those a call reads (the K/V pages inside the windows),
        which decide whether timing rotates input sets."""
        s = self.spec
        item = s.jnp_dtype.itemsize
        q = self.num_tokens * s.num_q_heads * s.head_dim * item
        if s.kind in PACKED_KINDS:  # a training step reads its cotangent d_out too, q's size
            return (2 if s.kind == "prefill-bwd" else 1) * q + 2 * self.num_tokens * s.num_kv_heads * s.head_dim * item
        if s.kind in ("sparse", "mla"):
            return q + self.num_pages * s.block_size * s.head_dim * item
        pages = self.num_pages
        if touched and s.window_left >= 0:  # the pages of each request's keys_read, a window straddling one more
            pages = int(np.sum(np.minimum(-(-self.seq_lens // s.block_size), -(-self.keys_read() // s.block_size) + 1)))
        return q + 2 * pages * s.block_size * s.num_kv_heads * s.kv_row_bytes


def _keys_before(n: np.ndarray, left: int) -> np.ndarray:
    """Σ_{p < n} keys seen by the query at position p: ``n(n+1)/2``, or with a left window ``min(p + 1, left + 1)``
    summed: ``L(L+1)/2 + (n - L)·L`` past ``L = left + 1``."""
    full = n * (n + 1) // 2
    if left < 0:
        return full
    w = left + 1
    return np.where(n <= w, full, w * (w + 1) // 2 + (n - w) * w)


def _lengths(group: Group, rng: np.random.Generator) -> np.ndarray:
    if isinstance(group.seq_lens, Draw):
        d = group.seq_lens
        return rng.integers(d.low, d.high + 1, d.n).astype(np.int64)
    return np.asarray(group.seq_lens, np.int64)


def page_tables(seq_lens: np.ndarray, block_size: int, rng: np.random.Generator) -> tuple[np.ndarray, int]:
    """Shuffled page tables over a pool that holds exactly the pages needed (vectorised numpy).

    Returns (block_tables i32[num_seqs, max_blocks] with 0 past each request's last page, num_pages).
    """
    pages = -(-seq_lens // block_size)
    num_pages = int(pages.sum())
    perm = rng.permutation(num_pages).astype(np.int32)
    max_blocks = max(1, int(pages.max()))
    starts = np.concatenate([[0], np.cumsum(pages)[:-1]])
    col = np.arange(max_blocks)[None, :]
    owned = col < pages[:, None]
    flat = np.where(owned, starts[:, None] + col, 0)
    tables = np.where(owned, perm[np.minimum(flat, max(num_pages - 1, 0))], 0).astype(np.int32)
    return tables, num_pages


def build_host(spec: Spec) -> HostBatch:
    rng = np.random.default_rng(spec.seed)
    seq_parts, q_parts = [], []
    for g in spec.groups:
        lens = _lengths(g, rng)
        seq_parts.append(lens)
        q_parts.append(lens.copy() if g.q_len is None else np.full_like(lens, g.q_len))
    seq_lens, q_lens = np.concatenate(seq_parts), np.concatenate(q_parts)
    if np.any(q_lens > seq_lens):
        raise ValueError(f"{spec.id}: a request has more new tokens than keys")
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    tables, num_pages, topk = None, 0, None
    if spec.kind not in PACKED_KINDS:
        tables, num_pages = page_tables(seq_lens, spec.block_size, rng)
    if spec.kind == "sparse":
        topk = _topk_indices(seq_lens, q_lens, spec.topk, rng)
    return HostBatch(spec, q_lens, seq_lens, cu, tables, num_pages, topk)


def _topk_indices(seq_lens, q_lens, topk: int, rng: np.random.Generator) -> np.ndarray:
    """Per token, ``topk`` distinct request-local positions among the keys it may see (unsorted, like a real
    indexer's output); ``-1`` pads when fewer keys are visible. Token ``i`` of a request sits at position
    ``seq_len - q_len + i`` and may see keys ``<= `` its position."""
    rows = []
    for seq, q in zip(seq_lens, q_lens):
        for i in range(int(q)):
            visible = int(seq - q + i + 1)
            take = min(topk, visible)
            chosen = rng.permutation(visible)[:take]
            row = np.full(topk, -1, np.int32)
            row[:take] = chosen
            rows.append(row)
    return np.stack(rows).astype(np.int32)


# ------------------------------------------------------------------------------------------------ device side
@dataclasses.dataclass
class Batch:
    """A workload's host metadata plus one set of device arrays.

    arrays, by kind:
      prefill: q [T, Hq, D], k/v [T, Hkv, D], cu_seqlens i32[B+1]
      prefill-bwd: the same, and d_out [T, Hq, D] (the cotangent of the output, q's dtype)
      decode:  q [B, Hq, D], k_cache/v_cache [num_pages, block_size, Hkv, D], block_tables i32[B, max_blocks],
               context_lens i32[B]
      ragged:  q [T, Hq, D], k_cache/v_cache, block_tables, seq_lens i32[B], cu_query_lens i32[B+1]
      sparse:  q [T, H, 576], kv_cache [num_pages, block_size, 576], block_tables, topk_indices i32[T, topk]
      mla:     q [T, H, 576], kv_cache [num_pages, block_size, 576], block_tables, seq_lens i32[B],
               cu_query_lens i32[B+1] (passed only when some request has more than one new token)
      and, for every kind, sinks f32[Hq] and alibi_slopes f32[Hq] (passed only where the spec, or a ``--variant``,
      turns them on: :meth:`Spec.feature_kwargs`)
    """
    host: HostBatch
    arrays: dict[str, jax.Array]

    @property
    def spec(self) -> Spec:
        return self.host.spec


def with_spec(batch: Batch, spec: Spec) -> Batch:
    """The same arrays under another spec of the same shapes (a ``--variant`` that turns a feature on)."""
    return batch if spec == batch.spec else Batch(dataclasses.replace(batch.host, spec=spec), batch.arrays)


def build_arrays(host: HostBatch, key: jax.Array) -> Batch:
    s = host.spec
    dt = s.jnp_dtype
    kq, kk, kv = jax.random.split(key, 3)

    def normal(k, shape):
        return jax.random.normal(k, shape, jnp.float32).astype(dt)

    T = host.num_tokens
    arrays: dict[str, jax.Array] = {}
    if s.kind in PACKED_KINDS:
        arrays["q"] = normal(kq, (T, s.num_q_heads, s.head_dim))
        arrays["k"] = normal(kk, (T, s.num_kv_heads, s.head_dim))
        arrays["v"] = normal(kv, (T, s.num_kv_heads, s.head_dim))
        arrays["cu_seqlens"] = jnp.asarray(host.cu_query_lens, jnp.int32)
        if s.kind == "prefill-bwd":  # a key of its own: q, k and v stay those of the forward workload
            arrays["d_out"] = normal(jax.random.fold_in(key, 2), (T, s.num_q_heads, s.head_dim))
    elif s.kind in ("decode", "ragged"):
        cache_shape = (host.num_pages, s.block_size, s.num_kv_heads, s.head_dim)
        arrays["q"] = normal(kq, (T, s.num_q_heads, s.head_dim))
        if s.kv_dtype:  # what write_kv_cache stores for the same normal values
            from pallas_attn import reference
            for name, k in (("k", kk), ("v", kv)):
                draw = jax.random.normal(k, cache_shape, jnp.float32)
                scale = (reference.kv_scales_per_token_head(draw, s.kv_jnp_dtype) if s.kv_scale_mode == "token"
                         else jnp.float32(FP8_KV_SCALE))
                arrays[f"{name}_cache"] = reference.quantize_kv(draw, scale, s.kv_jnp_dtype)
                arrays[f"{name}_scale"] = scale
        else:
            arrays["k_cache"] = normal(kk, cache_shape)
            arrays["v_cache"] = normal(kv, cache_shape)
        arrays["block_tables"] = jnp.asarray(host.block_tables)
        if s.kind == "decode":
            arrays["context_lens"] = jnp.asarray(host.seq_lens, jnp.int32)
        else:
            arrays["seq_lens"] = jnp.asarray(host.seq_lens, jnp.int32)
            arrays["cu_query_lens"] = jnp.asarray(host.cu_query_lens, jnp.int32)
    elif s.kind == "sparse":
        arrays["q"] = normal(kq, (T, s.num_q_heads, s.head_dim))
        arrays["kv_cache"] = normal(kk, (host.num_pages, s.block_size, s.head_dim))
        arrays["block_tables"] = jnp.asarray(host.block_tables)
        arrays["topk_indices"] = jnp.asarray(host.topk_indices)
    elif s.kind == "mla":
        arrays["q"] = normal(kq, (T, s.num_q_heads, s.head_dim))
        arrays["kv_cache"] = normal(kk, (host.num_pages, s.block_size, s.head_dim))
        arrays["block_tables"] = jnp.asarray(host.block_tables)
        arrays["seq_lens"] = jnp.asarray(host.seq_lens, jnp.int32)
        arrays["cu_query_lens"] = jnp.asarray(host.cu_query_lens, jnp.int32)
    else:
        raise ValueError(f"unknown kind {s.kind!r}")
    # from a key of their own, so that q, k and v stay those the same key gave before these existed
    ks, ka = jax.random.split(jax.random.fold_in(key, 1))
    arrays["sinks"] = jax.random.normal(ks, (s.num_q_heads,), jnp.float32)
    # ALiBi's slopes lie in 2^-8 .. 2^-0.5 (the geometric sequence's range for 8 to 64 heads), here drawn
    arrays["alibi_slopes"] = 2.0 ** -jax.random.uniform(ka, (s.num_q_heads,), jnp.float32, 0.5, 8.0)
    return Batch(host, arrays)


def num_input_sets(host: HostBatch, l2_bytes: int = L2_BYTES, max_sets: int = 32,
                   max_total_bytes: int = MAX_INPUT_BYTES) -> int:
    """1 when what a call reads overflows L2; otherwise enough sets (≥ 2) that one round over them moves ≥ 2× L2,
    as long as all sets together stay within ``max_total_bytes`` (a windowed decode reads a few pages of a large
    pool: W1 holds 4.3 GB of pages per set and reads 17 MB of them)."""
    size = max(1, host.input_bytes(touched=True))
    if size >= l2_bytes:
        return 1
    sets = int(min(max_sets, max(2, math.ceil(2 * l2_bytes / size))))
    return max(1, min(sets, max_total_bytes // max(1, host.input_bytes())))


def describe(host: HostBatch) -> str:
    s = host.spec
    features = ", ".join(f"{k}={v}" for k, v in s.feature_kwargs({"alibi_slopes": "on", "sinks": "on"}).items())
    return (f"{s.id}: {s.what}; B={host.num_seqs} T={host.num_tokens} Hq={s.num_q_heads} Hkv={s.num_kv_heads} "
            f"D={s.head_dim} {s.dtype}" + (f" pages={host.num_pages}x{s.block_size}" if host.paged else "")
            + (f" ({features})" if features else ""))
