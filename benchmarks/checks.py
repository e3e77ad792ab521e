"""Correctness check before timing: each implementation's output against :mod:`pallas_attn.reference`.

The oracles loop over requests in Python and build float32 ``[rows, keys]`` score matrices, so at benchmark sizes
they run on a SUBSET of rows, chosen once per workload and input set 0:

* prefill: the shortest, a middle and the longest request; for each, its first ``PREFIX_ROWS`` query rows (a
  causal prefix only sees itself: ``reference.varlen_attention`` on the prefix) and its last ``SUFFIX_ROWS`` rows
  (``reference.paged_attention`` with q_len = SUFFIX_ROWS over the whole request stored as a single page); a
  bidirectional prefill, those rows of the whole request's reference;
* decode: up to 4 requests (first, last, shortest, longest) through ``reference.paged_decode_attention``;
* ragged: the first request of every group plus the longest, through ``reference.paged_attention``;
* sparse: up to 4 tokens through ``reference.sparse_mla_attention``;
* mla: every new token of up to 4 requests (first, last, shortest, longest) through ``reference.mla_attention``,
  called as the kernels are (without ``cu_query_lens`` when every request has one new token);
* prefill-bwd (a training step): the gradients dq, dk, dv, on a cotangent of the check's own. The shortest, a
  middle and the longest request keep the first ``GRAD_ROWS`` rows of the workload's ``d_out`` and every other row
  gets 0 (:func:`check_cotangent`); the implementation runs on that cotangent (its timed calls on the whole
  ``d_out``). A causal query inside such a prefix sees only keys of the prefix, so the exact gradients are those of
  each prefix alone, ``jax.grad`` of ``reference.varlen_attention_dense`` (float32) over the prefix as its own
  request, and zero on every other row: those zeros are checked too (nothing leaks past a prefix or into another
  request, although every kernel still walks the whole batch). A bidirectional workload keeps whole requests of at
  most ``GRAD_ROWS`` rows instead (every row of a request sees all its keys).

The workload's model-family features (window, soft-cap, sinks, ALiBi) go to the reference as they go to the kernels.
``rel_err`` is ``||out - ref|| / ||ref||`` over those rows (float64; :func:`pallas_attn.testing.relative_l2`); a
training step's is the largest of dq's, dk's and dv's over all rows.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.workloads import Batch, HostBatch

PREFIX_ROWS = 128
SUFFIX_ROWS = 64
MAX_REQUESTS = 4
GRAD_ROWS = 512  # a training step's check: rows of each chosen request that keep their cotangent
GRADS = ("dq", "dk", "dv")


@dataclasses.dataclass
class RefSubset:
    rows: np.ndarray  # int[n]: rows of the canonical output that are checked
    ref: np.ndarray  # f32[n, H, Dv]


@dataclasses.dataclass
class GradSubset:
    """A training step's reference gradients: the rows that kept their cotangent and dq, dk, dv there (every
    other row's are zero)."""
    rows: np.ndarray  # int[n]: packed rows
    refs: tuple[np.ndarray, ...]  # f32[n, Hq, D] (dq), f32[n, Hkv, D] (dk), f32[n, Hkv, D] (dv)


def _pick(values: np.ndarray) -> list[int]:
    picks = [0, values.size - 1, int(np.argmin(values)), int(np.argmax(values)), values.size // 2]
    out = []
    for p in picks:
        if p not in out:
            out.append(p)
    return out[:MAX_REQUESTS]


def _cu(lens) -> jnp.ndarray:
    return jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)


def _grad_spans(host: HostBatch) -> list[tuple[int, int]]:
    """``(first packed row, rows)`` of each request part whose cotangent a training step's check keeps: the first
    ``GRAD_ROWS`` rows of the shortest, a middle and the longest request (bidirectional: those requests no longer
    than ``GRAD_ROWS``, whole)."""
    order = np.argsort(host.seq_lens, kind="stable")
    spans = []
    for b in sorted({int(order[0]), int(order[len(order) // 2]), int(order[-1])}):
        start, length = int(host.cu_query_lens[b]), int(host.seq_lens[b])
        if host.spec.causal or length <= GRAD_ROWS:
            spans.append((start, min(length, GRAD_ROWS)))
    if not spans:
        raise NotImplementedError(f"a bidirectional training step is checked on requests of at most {GRAD_ROWS} "
                                  f"rows; the shortest has {int(host.seq_lens.min())}")
    return spans


def check_cotangent(batch: Batch) -> jax.Array:
    """``[T, Hq, D]``: the workload's ``d_out`` on the rows of :func:`_grad_spans`, zero elsewhere: the cotangent
    a training step is checked on."""
    keep = np.zeros(batch.host.num_tokens, bool)
    for start, m in _grad_spans(batch.host):
        keep[start:start + m] = True
    d_out = batch.arrays["d_out"]
    return jnp.where(jnp.asarray(keep)[:, None, None], d_out, jnp.zeros((), d_out.dtype))


def _grad_subset(batch: Batch) -> GradSubset:
    """The exact gradients for :func:`check_cotangent`: each kept part as its own request (a causal prefix sees
    only itself), through autodiff of the dense reference in float32."""
    from pallas_attn import reference
    host, a = batch.host, batch.arrays
    feats = host.spec.feature_kwargs(a)
    rows, refs = [], []
    for start, m in _grad_spans(host):
        part = slice(start, start + m)

        def loss(q, k, v, d_out, m=m):
            out = reference.varlen_attention_dense(q, k, v, _cu([m]), causal=host.spec.causal, **feats)
            return jnp.sum(out * d_out)

        grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*(a[x][part].astype(jnp.float32)
                                                             for x in ("q", "k", "v", "d_out")))
        refs.append([np.asarray(g, np.float32) for g in grads])
        rows.append(np.arange(start, start + m))
    return GradSubset(np.concatenate(rows), tuple(np.concatenate(parts) for parts in zip(*refs)))


def reference_subset(batch: Batch) -> RefSubset | GradSubset:
    from pallas_attn import reference
    host, a = batch.host, batch.arrays
    kind = host.spec.kind
    feats = host.spec.feature_kwargs(a)
    rows, refs = [], []
    if kind == "prefill-bwd":
        return _grad_subset(batch)
    if kind == "prefill":
        order = np.argsort(host.seq_lens, kind="stable")
        chosen = sorted({int(order[0]), int(order[len(order) // 2]), int(order[-1])})
        for b in chosen:
            start, length = int(host.cu_query_lens[b]), int(host.seq_lens[b])
            if not host.spec.causal:  # every row sees the whole request: its reference is the whole request's
                whole = slice(start, start + length)
                out = reference.varlen_attention(a["q"][whole], a["k"][whole], a["v"][whole], _cu([length]),
                                                 causal=False, **feats)
                keep = np.unique(np.r_[np.arange(min(length, PREFIX_ROWS)), np.arange(max(length - SUFFIX_ROWS, 0),
                                                                                       length)])
                refs.append(np.asarray(out)[keep])
                rows.append(start + keep)
                continue
            m = min(length, PREFIX_ROWS)
            sl = slice(start, start + m)
            out = reference.varlen_attention(a["q"][sl], a["k"][sl], a["v"][sl], _cu([m]), **feats)
            refs.append(np.asarray(out))
            rows.append(np.arange(start, start + m))
            r = min(SUFFIX_ROWS, length - m)
            if r > 0:
                whole = slice(start, start + length)
                q_rows = slice(start + length - r, start + length)
                out = reference.paged_attention(a["q"][q_rows], a["k"][whole][None], a["v"][whole][None],
                                                jnp.zeros((1, 1), jnp.int32), jnp.asarray([length], jnp.int32),
                                                _cu([r]), **feats)
                refs.append(np.asarray(out))
                rows.append(np.arange(start + length - r, start + length))
    elif kind == "decode":
        idx = np.asarray(sorted(_pick(host.seq_lens)))
        out = reference.paged_decode_attention(a["q"][idx], a["k_cache"], a["v_cache"],
                                               jnp.asarray(host.block_tables[idx]),
                                               jnp.asarray(host.seq_lens[idx], jnp.int32), **feats)
        refs.append(np.asarray(out))
        rows.append(idx)
    elif kind == "ragged":
        from benchmarks.impls import request_groups
        idx = {int(g[0]) for g in request_groups(host)} | {int(np.argmax(host.seq_lens))}
        idx = np.asarray(sorted(idx))
        q_rows = np.concatenate([np.arange(host.cu_query_lens[b], host.cu_query_lens[b + 1]) for b in idx])
        out = reference.paged_attention(a["q"][q_rows], a["k_cache"], a["v_cache"],
                                        jnp.asarray(host.block_tables[idx]),
                                        jnp.asarray(host.seq_lens[idx], jnp.int32), _cu(host.q_lens[idx]), **feats)
        refs.append(np.asarray(out))
        rows.append(q_rows)
    elif kind == "sparse":
        if not np.all(host.q_lens == 1):
            raise NotImplementedError("sparse check assumes one token per request")
        idx = np.asarray(sorted(_pick(np.arange(host.num_seqs))))
        out = reference.sparse_mla_attention(a["q"][idx], a["kv_cache"], jnp.asarray(host.block_tables[idx]),
                                             jnp.asarray(host.topk_indices[idx]),
                                             kv_lora_rank=host.spec.kv_lora_rank, **feats)
        refs.append(np.asarray(out))
        rows.append(idx)
    elif kind == "mla":
        idx = np.asarray(sorted(_pick(host.seq_lens)))
        q_rows = np.concatenate([np.arange(host.cu_query_lens[b], host.cu_query_lens[b + 1]) for b in idx])
        out = reference.mla_attention(a["q"][q_rows], a["kv_cache"], jnp.asarray(host.block_tables[idx]),
                                      jnp.asarray(host.seq_lens[idx], jnp.int32),
                                      None if host.one_token_each else _cu(host.q_lens[idx]),
                                      max_query_len=host.max_query_len, kv_lora_rank=host.spec.kv_lora_rank, **feats)
        refs.append(np.asarray(out))
        rows.append(q_rows)
    else:
        raise ValueError(f"unknown kind {kind!r}")
    return RefSubset(np.concatenate(rows), np.concatenate(refs).astype(np.float32))


def rel_err(canonical_out, subset: RefSubset | GradSubset) -> float:
    if isinstance(subset, GradSubset):
        return _grad_rel_err(canonical_out, subset)
    from pallas_attn.testing import relative_l2
    out = np.asarray(canonical_out[jnp.asarray(subset.rows)]).astype(np.float32)
    if out.shape != subset.ref.shape:
        raise ValueError(f"output rows {out.shape} do not match the reference {subset.ref.shape}")
    if not np.all(np.isfinite(out)):
        return float("nan")
    return float(relative_l2(out, subset.ref))


def _grad_rel_err(grads, subset: GradSubset) -> float:
    """The largest over dq, dk, dv of ``||g - ref|| / ||ref||`` (float64) over every row: the kept rows against the
    reference, the others against zero (their sum of squares taken on the device)."""
    worst = 0.0
    for name, g, ref in zip(GRADS, grads, subset.refs):
        keep = np.zeros(g.shape[0], bool)
        keep[subset.rows] = True
        inside = np.asarray(g[jnp.asarray(subset.rows)]).astype(np.float64)
        if inside.shape != ref.shape:
            raise ValueError(f"{name} rows {inside.shape} do not match the reference {ref.shape}")
        outside = float(jnp.sum(jnp.square(jnp.where(jnp.asarray(keep)[:, None, None], 0.0, g.astype(jnp.float32)))))
        if not (np.all(np.isfinite(inside)) and math.isfinite(outside)):
            return float("nan")
        diff = math.sqrt(float(np.sum((inside - ref) ** 2)) + outside)
        norm = float(np.linalg.norm(ref.ravel()))
        worst = max(worst, diff / norm if norm > 0 else diff)
    return worst


def tolerance(dtype) -> float:
    """Flag threshold: twice the test-suite tolerance for the input dtype (the benchmark never fails on it)."""
    from pallas_attn.testing import TOLERANCES
    return 2 * TOLERANCES.get(np.dtype(dtype), 1e-2)
