"""Checks the model-family keywords of the reference (`window_size`, `softcap`, `alibi_slopes`, `sinks`) against
a float64 NumPy brute force written here, and the split merge with sinks.

The brute force follows the definition row by row: for each query and head it walks the request's keys, skips
those outside causality and the window, caps and biases each score, and does the softmax by hand with the sink
in the denominator. It shares no code with `reference/`. Inputs come from the same hostile builders as
tests/test_reference.py (shuffled pages, NaN wherever a request owns nothing).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import reference as ref

from .test_reference import RTOL, assert_matches, build_paged_cache, lookup, randn, rel_l2

# ---------------------------------------------------------------------------------------------------------------
# Brute force
# ---------------------------------------------------------------------------------------------------------------


def np_attention(q, key, value, query_pos, key_pos, head_dim_v, *, scale, causal=True, window=(-1, -1), softcap=0.0,
                 slopes=None, sinks=None):
    """float64 attention for one request, one query row and head at a time.

    q: [M, Hq, D]; key(p), value(p): the [Hkv, D] / [Hkv, Dv] rows at key position p, looked up only for keys a
    query sees; query_pos: M positions; key_pos: the request's key positions (a repeat is a separate key).
    Returns out [M, Hq, Dv] and lse [M, Hq] over the keys only; a row with no key: 0 and -inf, sink or not.
    """
    num_rows, num_q_heads = q.shape[:2]
    left, right = window
    out = np.zeros((num_rows, num_q_heads, head_dim_v))
    lse = np.full((num_rows, num_q_heads), -np.inf)
    for i in range(num_rows):
        for h in range(num_q_heads):
            scores, values = [], []
            for p in key_pos:
                d = p - query_pos[i]  # key position - query position
                if (causal and d > 0) or (left >= 0 and d < -left) or (right >= 0 and d > right):
                    continue
                g = h // (num_q_heads // key(p).shape[0])  # the kv head of query head h (GQA)
                s = scale * float(np.dot(q[i, h].astype(np.float64), key(p)[g]))
                if softcap:
                    s = softcap * math.tanh(s / softcap)
                if slopes is not None:
                    s += float(slopes[h]) * d
                scores.append(s)
                values.append(value(p)[g])
            if not scores:
                continue
            m = max(scores)
            weights = np.exp(np.array(scores) - m)
            denom = weights.sum() + (math.exp(float(sinks[h]) - m) if sinks is not None else 0.0)
            out[i, h] = sum(w * val for w, val in zip(weights, values)) / denom
            lse[i, h] = m + math.log(weights.sum())
    return out, lse


def alibi(num_q_heads):
    """The ALiBi paper's slopes: a geometric sequence from 2^(-8 / H)."""
    return np.array([2.0 ** (-8.0 * (h + 1) / num_q_heads) for h in range(num_q_heads)], np.float32)


def sink_logits(rng, num_q_heads):
    return (rng.standard_normal(num_q_heads) + 1.0).astype(np.float32)  # on the scale of the scaled scores


@dataclasses.dataclass(frozen=True)
class Features:
    """One scenario's keywords; alibi and sinks are flags, their values are drawn per test."""
    name: str
    window: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    alibi: bool = False
    sinks: bool = False
    causal: bool = True  # varlen_attention only; the paged oracles are always causal

    def kwargs(self, rng, num_q_heads):
        return dict(window_size=self.window, softcap=self.softcap,
                    alibi_slopes=alibi(num_q_heads) if self.alibi else None,
                    sinks=sink_logits(rng, num_q_heads) if self.sinks else None)


def brute_kwargs(kw, causal):
    return dict(causal=causal, window=kw["window_size"], softcap=kw["softcap"], slopes=kw["alibi_slopes"],
                sinks=kw["sinks"])


# ---------------------------------------------------------------------------------------------------------------
# varlen_attention
# ---------------------------------------------------------------------------------------------------------------

VARLEN_FEATURES = [
    Features("window_left_0", window=(0, -1)),  # each query sees itself only
    Features("window_left_1", window=(1, -1)),
    Features("window_wider_than_context", window=(50, 50)),
    Features("window_both_noncausal", window=(2, 1), causal=False),
    Features("window_right_only_noncausal", window=(-1, 2), causal=False),
    Features("window_zero_noncausal", window=(0, 0), causal=False),
    Features("window_right_ignored_causal", window=(2, 3)),
    Features("softcap", softcap=5.0),
    Features("alibi_causal", alibi=True),
    Features("alibi_noncausal", alibi=True, causal=False),  # keys after the query get a positive bias
    Features("sinks", sinks=True),
    Features("sinks_noncausal", sinks=True, causal=False),
    Features("combined_causal", window=(3, -1), softcap=5.0, alibi=True, sinks=True),
    Features("combined_noncausal", window=(2, 1), softcap=5.0, alibi=True, sinks=True, causal=False),
]


@pytest.mark.parametrize("feat", VARLEN_FEATURES, ids=lambda f: f.name)
def test_varlen_features(feat):
    rng = np.random.default_rng(20)
    lens, num_q_heads, num_kv_heads, head_dim = (5, 0, 1, 7), 8, 2, 32  # GQA group 4
    num_real = sum(lens)
    q = randn(rng, num_real + 2, num_q_heads, head_dim)
    k = randn(rng, num_real + 2, num_kv_heads, head_dim)
    v = randn(rng, num_real + 2, num_kv_heads, head_dim)
    q[num_real:] = k[num_real:] = v[num_real:] = np.nan  # padding rows: never read, zeros and -inf even with a sink
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    kw = feat.kwargs(rng, num_q_heads)
    got = ref.varlen_attention(q, k, v, cu, causal=feat.causal, return_lse=True, **kw)

    scale = 1 / math.sqrt(head_dim)
    want_out, want_lse = np.zeros(q.shape), np.full(q.shape[:2], -np.inf)
    for start, n in zip(cu[:-1], lens):
        local = np.arange(n)  # request-local positions
        rows = slice(start, start + n)
        want_out[rows], want_lse[rows] = np_attention(
            q[rows], lambda p: k[start + p].astype(np.float64), lambda p: v[start + p].astype(np.float64),
            local, local, head_dim, scale=scale, **brute_kwargs(kw, feat.causal))
    assert_matches(got, want_out, want_lse)


def test_window_defaults_and_wide_windows_change_nothing():
    """(-1, -1) is the default, and a window wider than every request masks nothing: bit-identical results."""
    rng = np.random.default_rng(21)
    q, k, v = randn(rng, 9, 4, 32), randn(rng, 9, 2, 32), randn(rng, 9, 2, 32)
    cu = np.array([0, 6, 9], np.int32)
    for causal in (True, False):
        plain = ref.varlen_attention(q, k, v, cu, causal=causal, return_lse=True)
        for window in [(-1, -1), (6, 6), (100, -1), [-1, 100]]:
            windowed = ref.varlen_attention(q, k, v, cu, causal=causal, window_size=window, return_lse=True)
            for x, y in zip(plain, windowed):
                np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_window_right_only_noncausal_is_causal():
    """(-1, 0) non-causal is exactly the causal mask: FlashAttention's convention, not a shifted one."""
    rng = np.random.default_rng(22)
    q, k, v = randn(rng, 7, 2, 32), randn(rng, 7, 1, 32), randn(rng, 7, 1, 32)
    cu = np.array([0, 3, 7], np.int32)
    causal = ref.varlen_attention(q, k, v, cu, return_lse=True)
    right0 = ref.varlen_attention(q, k, v, cu, causal=False, window_size=(-1, 0), return_lse=True)
    for x, y in zip(causal, right0):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_softcap_huge_logits_no_nan():
    """q × 1e3 with softcap 30: scores near 1e4 saturate at ±30; no NaN, and float64 agrees.

    Integer-valued inputs and a power-of-two scale make every float32 score exact before the tanh, so the
    comparison measures the soft-cap, not the rounding of 1e4-sized dots.
    """
    rng = np.random.default_rng(23)
    q = (rng.integers(-3, 4, (6, 4, 32)) * 1000).astype(np.float32)
    k = rng.integers(-3, 4, (6, 2, 32)).astype(np.float32)
    v = randn(rng, 6, 2, 32)
    cu = np.array([0, 6], np.int32)
    got = ref.varlen_attention(q, k, v, cu, softmax_scale=0.125, softcap=30.0, return_lse=True)
    assert np.isfinite(np.asarray(got[0])).all() and np.isfinite(np.asarray(got[1])).all()
    local = np.arange(6)
    want = np_attention(q, lambda p: k[p].astype(np.float64), lambda p: v[p].astype(np.float64), local, local, 32,
                        scale=0.125, softcap=30.0)
    assert_matches(got, *want)
    assert (np.asarray(got[1]) <= 30.0 + math.log(6) + 1e-5).all()  # every capped score is at most 30


# ---------------------------------------------------------------------------------------------------------------
# paged_decode_attention and paged_attention: absolute positions
# ---------------------------------------------------------------------------------------------------------------

PAGED_FEATURES = [
    Features("window_left_0", window=(0, -1)),
    Features("window_left_1", window=(1, -1)),
    Features("window_left_2_right_set", window=(2, 3)),  # right has nothing to cut: causal
    Features("window_wider_than_context", window=(40, -1)),
    Features("softcap", softcap=5.0),
    Features("alibi", alibi=True),
    Features("sinks", sinks=True),
    Features("combined", window=(4, -1), softcap=5.0, alibi=True, sinks=True),
]


@pytest.mark.parametrize("feat", PAGED_FEATURES, ids=lambda f: f.name)
def test_paged_decode_features(feat):
    rng = np.random.default_rng(24)
    seq_lens, num_q_heads, num_kv_heads, head_dim = (5, 0, 1, 13), 8, 2, 32
    (k_cache, v_cache), tables = build_paged_cache(rng, seq_lens, 4, (num_kv_heads, head_dim))
    q = randn(rng, len(seq_lens), num_q_heads, head_dim)
    kw = feat.kwargs(rng, num_q_heads)
    got = ref.paged_decode_attention(q, k_cache, v_cache, tables, np.array(seq_lens, np.int32), return_lse=True,
                                     **kw)

    want_out, want_lse = np.zeros(q.shape), np.full(q.shape[:2], -np.inf)
    for b, n in enumerate(seq_lens):
        want_out[b:b + 1], want_lse[b:b + 1] = np_attention(
            q[b:b + 1], lambda p: lookup(k_cache, tables[b], p), lambda p: lookup(v_cache, tables[b], p),
            [n - 1], range(n), head_dim, scale=1 / math.sqrt(head_dim), **brute_kwargs(kw, True))
    assert_matches(got, want_out, want_lse)


PAGED_REQUESTS = ((3, 10), (4, 4), (0, 5), (6, 3))  # (q_len, seq_len); the last: q_len > seq_len


@pytest.mark.parametrize("feat", PAGED_FEATURES, ids=lambda f: f.name)
def test_paged_features(feat):
    """Queries past a cached prefix: local query i sits at context_len + i for the window and ALiBi alike."""
    rng = np.random.default_rng(25)
    num_q_heads, num_kv_heads, head_dim = 8, 2, 32
    q_lens = [ql for ql, _ in PAGED_REQUESTS]
    seq_lens = [sl for _, sl in PAGED_REQUESTS]
    (k_cache, v_cache), tables = build_paged_cache(rng, seq_lens, 4, (num_kv_heads, head_dim))
    q = randn(rng, sum(q_lens) + 2, num_q_heads, head_dim)
    q[sum(q_lens):] = np.nan
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    kw = feat.kwargs(rng, num_q_heads)
    got = ref.paged_attention(q, k_cache, v_cache, tables, np.array(seq_lens, np.int32), cu, return_lse=True, **kw)

    want_out, want_lse = np.zeros(q.shape), np.full(q.shape[:2], -np.inf)
    for b, (q_len, seq_len) in enumerate(PAGED_REQUESTS):
        rows = slice(cu[b], cu[b] + q_len)
        want_out[rows], want_lse[rows] = np_attention(
            q[rows], lambda p: lookup(k_cache, tables[b], p), lambda p: lookup(v_cache, tables[b], p),
            seq_len - q_len + np.arange(q_len), range(seq_len), head_dim, scale=1 / math.sqrt(head_dim),
            **brute_kwargs(kw, True))
    assert_matches(got, want_out, want_lse)


def test_paged_q_len_one_matches_decode_with_every_feature():
    rng = np.random.default_rng(26)
    seq_lens = np.array([6, 1, 11, 0], np.int32)
    (k_cache, v_cache), tables = build_paged_cache(rng, seq_lens, 4, (2, 32))
    q = randn(rng, 4, 8, 32)
    kw = Features("all", window=(3, -1), softcap=5.0, alibi=True, sinks=True).kwargs(rng, 8)
    a = ref.paged_attention(q, k_cache, v_cache, tables, seq_lens, np.arange(5, dtype=np.int32), return_lse=True,
                            **kw)
    b = ref.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, return_lse=True, **kw)
    for x, y in zip(a, b):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-6)


def test_paged_window_never_reads_expired_pages():
    """Pages wholly before every query's window may have been freed: poisoned pages and garbage entries there
    change nothing."""
    rng = np.random.default_rng(27)
    requests, left, block_size = ((2, 14), (1, 13)), 3, 4  # windows start at 12 - 3 = 9 and 12 - 3 = 9
    seq_lens = np.array([sl for _, sl in requests], np.int32)
    cu = np.array([0, 2, 3], np.int32)
    (k_cache, v_cache), tables = build_paged_cache(rng, seq_lens, block_size, (1, 32))
    q = randn(rng, 3, 2, 32)
    call = lambda kc, vc, t: ref.paged_attention(q, kc, vc, t, seq_lens, cu, window_size=(left, -1),
                                                 return_lse=True)
    want = call(k_cache, v_cache, tables)
    k_bad, v_bad, t_bad = k_cache.copy(), v_cache.copy(), tables.copy()
    for b in range(2):  # pages 0 and 1 (positions 0..7) are before position 9
        k_bad[tables[b, :2]] = v_bad[tables[b, :2]] = np.nan
    t_bad[0, 0], t_bad[1, 1] = -1, 2**30
    got = call(k_bad, v_bad, t_bad)
    for x, y in zip(got, want):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    decode = ref.paged_decode_attention(q[2:], k_bad, v_bad, t_bad[1:], seq_lens[1:], window_size=(left, -1))
    np.testing.assert_array_equal(np.asarray(decode), np.asarray(want[0][2:]))


# ---------------------------------------------------------------------------------------------------------------
# Sinks at the extremes
# ---------------------------------------------------------------------------------------------------------------


def _decode_inputs(rng, seq_lens=(0, 4, 9)):
    (k_cache, v_cache), tables = build_paged_cache(rng, seq_lens, 4, (1, 32))
    return randn(rng, len(seq_lens), 4, 32), k_cache, v_cache, tables, np.array(seq_lens, np.int32)


def test_very_negative_sink_is_no_sink():
    rng = np.random.default_rng(28)
    args = _decode_inputs(rng)
    plain = ref.paged_decode_attention(*args, return_lse=True)
    sunk = ref.paged_decode_attention(*args, sinks=np.full(4, -1e4, np.float32), return_lse=True)
    for x, y in zip(plain, sunk):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_very_positive_sink_takes_all_weight_and_leaves_the_lse():
    """The sink absorbs the whole row (out -> 0), but the LSE is over keys only; an empty row stays 0 / -inf."""
    rng = np.random.default_rng(29)
    args = _decode_inputs(rng)
    plain_out, plain_lse = ref.paged_decode_attention(*args, return_lse=True)
    for sink in (50.0, 1e4):  # 50: tiny but nonzero weights; 1e4: exp overflows, the limit 0 exactly
        out, lse = ref.paged_decode_attention(*args, sinks=np.full(4, sink, np.float32), return_lse=True)
        assert np.isfinite(np.asarray(out)).all()
        assert np.abs(np.asarray(out)).max() < 1e-15
        np.testing.assert_array_equal(np.asarray(lse), np.asarray(plain_lse))
    np.testing.assert_array_equal(np.asarray(out[0]), 0.0)
    assert np.isneginf(np.asarray(lse[0])).all()


def test_rows_without_keys_ignore_the_sink():
    """An empty request, a query placed before every key, padding rows: 0 and -inf whatever the sink."""
    rng = np.random.default_rng(30)
    (k_cache, v_cache), tables = build_paged_cache(rng, (0, 2), 4, (1, 32))
    q = randn(rng, 5, 2, 32)
    # Request 0: seq_len 0, one query. Request 1: q_len 3 > seq_len 2, its first query sits at -1.
    out, lse = ref.paged_attention(q, k_cache, v_cache, tables, np.array([0, 2], np.int32),
                                   np.array([0, 1, 4], np.int32), sinks=np.array([3.0, -3.0], np.float32),
                                   return_lse=True)
    out, lse = np.asarray(out), np.asarray(lse)
    for row in (0, 1, 4):  # 4: padding past cu[-1]
        np.testing.assert_array_equal(out[row], 0.0)
        assert np.isneginf(lse[row]).all()
    assert np.isfinite(lse[2:4]).all()


# ---------------------------------------------------------------------------------------------------------------
# sparse_mla_attention
# ---------------------------------------------------------------------------------------------------------------


def test_sparse_with_sinks():
    rng = np.random.default_rng(31)
    seq_lens, num_heads, head_dim, rank = (12, 5), 4, 80, 64
    (kv_cache, _), tables = build_paged_cache(rng, seq_lens, 4, (head_dim,))
    q = randn(rng, 3, num_heads, head_dim)
    cu = np.array([0, 2, 3], np.int32)
    topk = np.array([[0, 11, 11, -1, 4], [-1, -1, -1, -1, -1], [4, 0, 2, -1, 1]], np.int32)  # a repeat, an empty row
    sinks = sink_logits(rng, num_heads)
    got = ref.sparse_mla_attention(q, kv_cache, tables, topk, cu_query_lens=cu, kv_lora_rank=rank, sinks=sinks,
                                   return_lse=True)

    want_out, want_lse = np.zeros((3, num_heads, rank)), np.full((3, num_heads), -np.inf)
    for t, b in enumerate([0, 0, 1]):
        key = lambda p: lookup(kv_cache, tables[b], p)[None]  # one kv head
        want_out[t:t + 1], want_lse[t:t + 1] = np_attention(
            q[t:t + 1], key, lambda p: key(p)[:, :rank], [0], [p for p in topk[t] if p >= 0], rank,
            scale=1 / math.sqrt(head_dim), causal=False, sinks=sinks)
    assert_matches(got, want_out, want_lse)


# ---------------------------------------------------------------------------------------------------------------
# merge_attention_states with sinks
# ---------------------------------------------------------------------------------------------------------------


def _split_states(rng, bounds, sinks=None):
    """float64 brute-force states of one request's keys split at `bounds` (sink-free), and the unsplit answer with
    `sinks`. Returns (outs f32[S, M, H, D], lses f32[S, M, H]), (out, lse) float64."""
    num_keys, num_rows, num_heads, head_dim = bounds[-1], 3, 4, 16
    q = randn(rng, num_rows, num_heads, head_dim)
    k, v = randn(rng, num_keys, 2, head_dim).astype(np.float64), randn(rng, num_keys, 2, head_dim).astype(np.float64)
    call = lambda positions, sinks: np_attention(q, lambda p: k[p], lambda p: v[p], [num_keys] * num_rows,
                                                 positions, head_dim, scale=0.25, causal=False, sinks=sinks)
    states = [call(range(lo, hi), None) for lo, hi in zip(bounds[:-1], bounds[1:])]
    for out, lse in states:
        out[np.isneginf(lse)] = np.nan  # an empty split's output is garbage
    outs = np.stack([o for o, _ in states]).astype(np.float32)
    lses = np.stack([l for _, l in states]).astype(np.float32)
    return (outs, lses), call(range(num_keys), sinks)


@pytest.mark.parametrize("bounds", [(0, 5, 11), (0, 1, 11), (0, 0, 7, 7, 9)], ids=["halves", "one_key", "empties"])
def test_merge_with_sinks_equals_unsplit(bounds):
    rng = np.random.default_rng(32)
    sinks = sink_logits(rng, 4)
    (outs, lses), want = _split_states(rng, bounds, sinks)
    assert_matches(ref.merge_attention_states(outs, lses, sinks), *want)
    assert_matches(jax.jit(ref.merge_attention_states)(outs, lses, sinks=jnp.asarray(sinks)), *want)


def test_merge_with_sinks_empty_split_changes_nothing():
    rng = np.random.default_rng(33)
    sinks = sink_logits(rng, 4)
    (outs, lses), _ = _split_states(rng, (0, 4, 9), sinks)
    empty_out = np.full_like(outs[:1], np.nan)
    empty_lse = np.full_like(lses[:1], -np.inf)
    base = ref.merge_attention_states(outs, lses, sinks)
    padded = ref.merge_attention_states(np.concatenate([empty_out, outs, empty_out]),
                                        np.concatenate([empty_lse, lses, empty_lse]), sinks)
    for x, y in zip(base, padded):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_merge_with_sinks_all_empty_is_zero_and_neg_inf():
    out, lse = ref.merge_attention_states(np.full((2, 3, 4, 8), np.nan, np.float32),
                                          np.full((2, 3, 4), -np.inf, np.float32), np.full(4, 5.0, np.float32))
    np.testing.assert_array_equal(np.asarray(out), 0.0)
    assert np.isneginf(np.asarray(lse)).all()


def test_merge_of_oracle_splits_applies_the_sink_once():
    """Sink-free sparse calls on two halves of a top-k list, merged with the sink, equal the call with the sink."""
    rng = np.random.default_rng(34)
    (kv_cache, _), tables = build_paged_cache(rng, (10,), 4, (80,))
    q = randn(rng, 2, 4, 80)
    sinks = sink_logits(rng, 4)
    topk = np.tile(rng.permutation(10)[None], (2, 1)).astype(np.int32)
    call = lambda idx, s: ref.sparse_mla_attention(q, kv_cache, tables, idx, kv_lora_rank=64, sinks=s,
                                                   cu_query_lens=np.array([0, 2], np.int32), return_lse=True)
    halves = [np.where(np.arange(10) < 4, topk, -1), np.where(np.arange(10) >= 4, topk, -1)]
    states = [call(idx, None) for idx in halves]
    out, lse = ref.merge_attention_states(jnp.stack([o for o, _ in states]), jnp.stack([l for _, l in states]),
                                          sinks)
    want_out, want_lse = call(topk, sinks)
    assert rel_l2(np.asarray(out), np.asarray(want_out)) < RTOL
    assert rel_l2(np.asarray(lse), np.asarray(want_lse)) < RTOL


# ---------------------------------------------------------------------------------------------------------------
# Bad values
# ---------------------------------------------------------------------------------------------------------------

_Q, _KV = np.ones((3, 4, 16), np.float32), np.ones((3, 2, 16), np.float32)
_CU = np.array([0, 3], np.int32)
_CACHE = np.ones((4, 4, 2, 16), np.float32)
_TABLE = np.array([[0, 1]], np.int32)


def _varlen(**kw):
    return ref.varlen_attention(_Q, _KV, _KV, _CU, **kw)


def _decode(**kw):
    return ref.paged_decode_attention(_Q[:1], _CACHE, _CACHE, _TABLE, np.array([3], np.int32), **kw)


def _paged(**kw):
    return ref.paged_attention(_Q, _CACHE, _CACHE, _TABLE, np.array([5], np.int32), _CU, **kw)


def _sparse(**kw):
    return ref.sparse_mla_attention(_Q[:1], _CACHE[:, :, 0], _TABLE, [[0, 1]], kv_lora_rank=8, **kw)


BAD_VALUES = [
    *[pytest.param(call, dict(window_size=w), "window_size", id=f"{call.__name__[1:]}_window_{w!r}")
      for call in (_varlen, _decode, _paged)
      for w in [(-2, 0), (1,), (1, 2, 3), (1.0, 2), (True, 1), None, 5, "-1,-1"]],
    *[pytest.param(call, dict(softcap=c), "softcap", id=f"{call.__name__[1:]}_softcap_{c!r}")
      for call in (_varlen, _decode, _paged) for c in [-1.0, math.nan, math.inf, "x"]],
    *[pytest.param(call, dict(alibi_slopes=s), "alibi_slopes", id=f"{call.__name__[1:]}_alibi_{len(s)}")
      for call in (_varlen, _decode, _paged) for s in [np.ones(2), np.ones(5)]],
    *[pytest.param(call, dict(sinks=s), "sinks", id=f"{call.__name__[1:]}_sinks_{np.shape(s)}")
      for call in (_varlen, _decode, _paged, _sparse) for s in [np.ones(2), np.ones((4, 1))]],
]


@pytest.mark.parametrize("call, kwargs, name", BAD_VALUES)
def test_bad_values_raise_naming_the_argument(call, kwargs, name):
    with pytest.raises(ValueError, match=name):
        call(**kwargs)


@pytest.mark.parametrize("sinks", [np.ones(3), np.ones((4, 1))], ids=["wrong_heads", "not_1d"])
def test_merge_bad_sinks_raise(sinks):
    with pytest.raises(ValueError, match="sinks"):
        ref.merge_attention_states(np.zeros((2, 5, 4, 8)), np.zeros((2, 5, 4)), sinks)
