"""Checks the reference oracles against brute-force float64 NumPy loops.

The brute force is deliberately dumber than the oracle: per request, per query position, per head it builds the
list of visible keys one by one (looking each up through the block table) and does the softmax by hand. Inputs
are never trivial: shuffled page tables, NaN in every page or row a request does not own, -1 and garbage in
unused table entries, empty and length-1 requests.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import reference as ref

RTOL = 1e-5  # relative L2, float32 oracle vs float64 brute force


# ---------------------------------------------------------------------------------------------------------------
# Brute force and comparison
# ---------------------------------------------------------------------------------------------------------------


def brute_attend(q_row, keys, values, scale):
    """q_row: [D]; keys: list of [D]; values: list of [Dv] -> (out [Dv], lse), float64, one head, one query."""
    if not keys:
        return None, -np.inf
    scores = np.array([float(np.dot(q_row, key)) for key in keys]) * scale
    m = scores.max()
    weights = np.exp(scores - m)
    out = sum(w * val for w, val in zip(weights, values)) / weights.sum()
    return out, m + math.log(weights.sum())


def rel_l2(got, want):
    return np.linalg.norm(got - want) / np.linalg.norm(want)


def assert_matches(got, want_out, want_lse):
    """got: (out, lse) from an oracle; want_*: float64 brute force (out rows with no key are 0, lse -inf)."""
    out, lse = (np.asarray(x) for x in got)
    assert out.dtype == np.float32 and lse.dtype == np.float32
    assert out.shape == want_out.shape and lse.shape == want_lse.shape
    assert np.isfinite(out).all(), "oracle read poisoned memory or produced NaN"
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    assert not np.isnan(lse).any() and not np.isposinf(lse).any()
    empty = np.isneginf(want_lse)
    np.testing.assert_array_equal(out[empty], 0.0)
    if (~empty).any():
        assert rel_l2(out[~empty], want_out[~empty]) < RTOL
        assert rel_l2(lse[~empty], want_lse[~empty]) < RTOL


def randn(rng, *shape):
    # Shifted normal: never zero, and a nonzero mean so that a wrong key set changes the answer visibly.
    return (rng.standard_normal(shape) + 0.25).astype(np.float32)


def scale_of(softmax_scale, head_dim):
    return 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale


# ---------------------------------------------------------------------------------------------------------------
# Paged cache builder
# ---------------------------------------------------------------------------------------------------------------


def build_paged_cache(rng, seq_lens, block_size, trailing_shape, junk_pages=3):
    """A shuffled page pool for requests of `seq_lens` keys.

    Returns (caches, tables): caches is a list of two pools [num_blocks, block_size, *trailing_shape] (K and V;
    the sparse test uses only the first), tables is i32[B, max_blocks]. Every slot a request does not own is NaN:
    junk pages, and the tail of each request's last page. Table entries past a request's last page are -1, a
    huge number, or the index of a NaN junk page, so reading any of them is caught.
    """
    pages_per_req = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(pages_per_req) + junk_pages
    perm = rng.permutation(num_blocks)
    owned, junk = perm[: sum(pages_per_req)], perm[sum(pages_per_req):]
    max_blocks = max(pages_per_req, default=0) + 2
    tables = np.empty((len(seq_lens), max_blocks), np.int32)
    caches = [np.full((num_blocks, block_size, *trailing_shape), np.nan, np.float32) for _ in range(2)]
    garbage = np.array([-1, 2**30, junk[0]], np.int32)
    offset = 0
    for b, (n, pages) in enumerate(zip(seq_lens, pages_per_req)):
        tables[b, :pages] = owned[offset:offset + pages]
        tables[b, pages:] = rng.choice(garbage, max_blocks - pages)
        offset += pages
        for p in range(n):  # only the slots holding real keys get data
            for cache in caches:
                cache[tables[b, p // block_size], p % block_size] = randn(rng, *trailing_shape)
    return caches, tables


def lookup(cache, table_row, p):
    block_size = cache.shape[1]
    return cache[table_row[p // block_size], p % block_size].astype(np.float64)


# ---------------------------------------------------------------------------------------------------------------
# varlen_attention
# ---------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class VarlenCase:
    name: str
    lens: tuple[int, ...]  # tokens per request
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    causal: bool = True
    pad_rows: int = 2  # NaN rows past cu[-1]
    softmax_scale: float | None = None


VARLEN_CASES = [
    VarlenCase("single_request", (7,), 2, 2, 64),
    VarlenCase("mixed_gqa4_d96", (5, 0, 1, 9, 3), 8, 2, 96),
    VarlenCase("gqa8_d256", (3, 1, 4), 8, 1, 256),
    VarlenCase("gqa2_d320", (4, 1), 4, 2, 320),
    VarlenCase("noncausal_d512", (3, 2), 2, 1, 512, causal=False),
    VarlenCase("noncausal_d128", (6, 0, 2), 4, 4, 128, causal=False),
    VarlenCase("length_one_requests", (1, 1, 1), 4, 1, 64, softmax_scale=0.3),
    VarlenCase("all_empty", (0, 0), 2, 1, 64, pad_rows=3),
    VarlenCase("no_padding", (4, 5), 2, 1, 64, pad_rows=0),
]


def brute_varlen(q, k, v, lens, causal, scale):
    num_tokens, num_q_heads, _ = q.shape
    group = num_q_heads // k.shape[1]
    out = np.zeros(q.shape, np.float64)
    lse = np.full((num_tokens, num_q_heads), -np.inf)
    start = 0
    for n in lens:
        for i in range(n):
            for h in range(num_q_heads):
                seen = [start + j for j in range(n) if not causal or j <= i]
                o, l = brute_attend(q[start + i, h].astype(np.float64),
                                    [k[r, h // group].astype(np.float64) for r in seen],
                                    [v[r, h // group].astype(np.float64) for r in seen], scale)
                if o is not None:
                    out[start + i, h] = o
                lse[start + i, h] = l
        start += n
    return out, lse


@pytest.mark.parametrize("case", VARLEN_CASES, ids=lambda c: c.name)
def test_varlen_attention(case):
    rng = np.random.default_rng(0)
    num_real = sum(case.lens)
    num_tokens = num_real + case.pad_rows
    q = randn(rng, num_tokens, case.num_q_heads, case.head_dim)
    k = randn(rng, num_tokens, case.num_kv_heads, case.head_dim)
    v = randn(rng, num_tokens, case.num_kv_heads, case.head_dim)
    q[num_real:] = k[num_real:] = v[num_real:] = np.nan  # padding rows must never be read
    cu = np.concatenate([[0], np.cumsum(case.lens)]).astype(np.int32)

    got = ref.varlen_attention(q, k, v, cu, max_seqlen=max(case.lens), causal=case.causal,
                               softmax_scale=case.softmax_scale, return_lse=True)
    want = brute_varlen(q, k, v, case.lens, case.causal, scale_of(case.softmax_scale, case.head_dim))
    assert_matches(got, *want)


# ---------------------------------------------------------------------------------------------------------------
# paged_decode_attention
# ---------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DecodeCase:
    name: str
    context_lens: tuple[int, ...]
    block_size: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int


DECODE_CASES = [
    DecodeCase("mixed_gqa4", (5, 0, 1, 17, 8), 4, 8, 2, 64),
    DecodeCase("block_size_1", (3, 1, 0, 6), 1, 4, 1, 128),
    DecodeCase("gqa8_d256", (9, 2), 8, 8, 1, 256),
    DecodeCase("less_than_a_page_d96", (12, 7), 16, 2, 2, 96),
    DecodeCase("block_size_48_d320", (49, 0, 48), 48, 4, 2, 320),
    DecodeCase("block_size_544_d512", (545, 3), 544, 2, 1, 512),
    DecodeCase("all_empty", (0, 0), 4, 2, 1, 64),
]


@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: c.name)
def test_paged_decode_attention(case):
    rng = np.random.default_rng(1)
    (k_cache, v_cache), tables = build_paged_cache(rng, case.context_lens, case.block_size,
                                                   (case.num_kv_heads, case.head_dim))
    q = randn(rng, len(case.context_lens), case.num_q_heads, case.head_dim)
    got = ref.paged_decode_attention(q, k_cache, v_cache, tables, np.array(case.context_lens, np.int32),
                                     num_splits=3, return_lse=True)

    group = case.num_q_heads // case.num_kv_heads
    scale = scale_of(None, case.head_dim)
    want_out = np.zeros(q.shape, np.float64)
    want_lse = np.full(q.shape[:2], -np.inf)
    for b, n in enumerate(case.context_lens):
        for h in range(case.num_q_heads):
            o, l = brute_attend(q[b, h].astype(np.float64),
                                [lookup(k_cache, tables[b], p)[h // group] for p in range(n)],
                                [lookup(v_cache, tables[b], p)[h // group] for p in range(n)], scale)
            if o is not None:
                want_out[b, h] = o
            want_lse[b, h] = l
    assert_matches(got, want_out, want_lse)


# ---------------------------------------------------------------------------------------------------------------
# paged_attention
# ---------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PagedCase:
    name: str
    requests: tuple[tuple[int, int], ...]  # (q_len, seq_len) per request
    block_size: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    pad_rows: int = 2


PAGED_CASES = [
    PagedCase("decode_only", ((1, 5), (1, 1), (1, 13)), 4, 4, 1, 64),
    PagedCase("verification", ((3, 7), (6, 16), (2, 2)), 4, 8, 2, 64),
    PagedCase("chunked_prefill", ((5, 12), (4, 9)), 4, 2, 2, 96),
    PagedCase("fresh_prefill", ((5, 5), (1, 1), (7, 7)), 4, 8, 1, 128),
    PagedCase("mixed", ((1, 9), (0, 0), (4, 4), (0, 6), (3, 11), (1, 1)), 4, 8, 2, 64),
    PagedCase("block_size_1", ((1, 4), (0, 0), (3, 3), (2, 5)), 1, 4, 1, 64),
    PagedCase("gqa8_d256", ((2, 6), (1, 3)), 8, 8, 1, 256, pad_rows=0),
    PagedCase("block_size_48_d512", ((3, 50), (1, 48)), 48, 4, 2, 512),
    PagedCase("block_size_544_d320", ((2, 546), (4, 4)), 544, 2, 1, 320),
    PagedCase("all_q_len_zero", ((0, 5), (0, 0)), 4, 2, 1, 64),
]


@pytest.mark.parametrize("case", PAGED_CASES, ids=lambda c: c.name)
def test_paged_attention(case):
    rng = np.random.default_rng(2)
    q_lens = [ql for ql, _ in case.requests]
    seq_lens = [sl for _, sl in case.requests]
    (k_cache, v_cache), tables = build_paged_cache(rng, seq_lens, case.block_size,
                                                   (case.num_kv_heads, case.head_dim))
    num_real = sum(q_lens)
    q = randn(rng, num_real + case.pad_rows, case.num_q_heads, case.head_dim)
    q[num_real:] = np.nan
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    got = ref.paged_attention(q, k_cache, v_cache, tables, np.array(seq_lens, np.int32), cu,
                              max_query_len=max(q_lens), return_lse=True)

    group = case.num_q_heads // case.num_kv_heads
    scale = scale_of(None, case.head_dim)
    want_out = np.zeros(q.shape, np.float64)
    want_lse = np.full(q.shape[:2], -np.inf)
    for b, (q_len, seq_len) in enumerate(case.requests):
        context_len = seq_len - q_len
        for i in range(q_len):
            t = cu[b] + i
            seen = [p for p in range(seq_len) if p <= context_len + i]
            for h in range(case.num_q_heads):
                o, l = brute_attend(q[t, h].astype(np.float64),
                                    [lookup(k_cache, tables[b], p)[h // group] for p in seen],
                                    [lookup(v_cache, tables[b], p)[h // group] for p in seen], scale)
                want_out[t, h], want_lse[t, h] = o, l
    assert_matches(got, want_out, want_lse)


def test_paged_attention_decode_matches_paged_decode():
    """q_len 1 per request is decode: both oracles must agree exactly on the same inputs."""
    rng = np.random.default_rng(3)
    context_lens = [6, 1, 11]
    (k_cache, v_cache), tables = build_paged_cache(rng, context_lens, 4, (2, 64))
    q = randn(rng, 3, 8, 64)
    lens = np.array(context_lens, np.int32)
    a = ref.paged_attention(q, k_cache, v_cache, tables, lens, np.arange(4, dtype=np.int32), return_lse=True)
    b = ref.paged_decode_attention(q, k_cache, v_cache, tables, lens, return_lse=True)
    for x, y in zip(a, b):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# sparse_mla_attention
# ---------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SparseCase:
    name: str
    seq_lens: tuple[int, ...]  # cached positions per request
    tokens_per_request: tuple[int, ...] | None  # None: one query per request, cu_query_lens=None
    topk: int
    num_heads: int
    block_size: int
    head_dim: int = 576
    kv_lora_rank: int = 512
    pad_rows: int = 0


SPARSE_CASES = [
    SparseCase("decode_576", (20, 7, 33, 0), None, 8, 4, 8),
    SparseCase("prefill_cu_576", (10, 15, 0, 4), (3, 2, 1, 2), 6, 2, 4, pad_rows=2),
    SparseCase("block_size_1", (5, 9), (2, 1), 7, 2, 1),
    SparseCase("small_dims", (12, 3), (2, 2), 5, 4, 4, head_dim=80, kv_lora_rank=64),
]


def sparse_indices(rng, seq_len, topk, row):
    """Random request-local positions with repeats and -1 holes; some rows are special on purpose."""
    if seq_len == 0 or row % 4 == 3:
        return np.full(topk, -1, np.int32)  # sees no key
    if row % 4 == 2:
        return np.full(topk, rng.integers(seq_len), np.int32)  # one position, topk times
    idx = rng.integers(0, seq_len, topk)  # with replacement: duplicates likely
    idx[rng.random(topk) < 0.3] = -1
    idx[0] = max(idx[0], 0)  # keep at least one real key on this row
    return idx.astype(np.int32)


@pytest.mark.parametrize("case", SPARSE_CASES, ids=lambda c: c.name)
def test_sparse_mla_attention(case):
    rng = np.random.default_rng(4)
    (kv_cache, _), tables = build_paged_cache(rng, case.seq_lens, case.block_size, (case.head_dim,))
    per_req = case.tokens_per_request or (1,) * len(case.seq_lens)
    owner = [b for b, n in enumerate(per_req) for _ in range(n)]
    num_real = len(owner)
    topk = np.full((num_real + case.pad_rows, case.topk), -1, np.int32)
    for t, b in enumerate(owner):
        topk[t] = sparse_indices(rng, case.seq_lens[b], case.topk, t)
    topk[num_real:] = rng.integers(0, 10**6, (case.pad_rows, case.topk))  # padding rows: garbage indices
    q = randn(rng, num_real + case.pad_rows, case.num_heads, case.head_dim)
    q[num_real:] = np.nan
    cu = None
    if case.tokens_per_request is not None:
        cu = np.concatenate([[0], np.cumsum(per_req)]).astype(np.int32)
    got = ref.sparse_mla_attention(q, kv_cache, tables, topk, cu_query_lens=cu, kv_lora_rank=case.kv_lora_rank,
                                   return_lse=True)

    scale = scale_of(None, case.head_dim)
    want_out = np.zeros((q.shape[0], case.num_heads, case.kv_lora_rank))
    want_lse = np.full(q.shape[:2], -np.inf)
    for t, b in enumerate(owner):
        rows = [lookup(kv_cache, tables[b], p) for p in topk[t] if p >= 0]  # duplicates are separate keys
        for h in range(case.num_heads):
            o, l = brute_attend(q[t, h].astype(np.float64), rows, [r[:case.kv_lora_rank] for r in rows], scale)
            if o is not None:
                want_out[t, h] = o
            want_lse[t, h] = l
    assert_matches(got, want_out, want_lse)


# ---------------------------------------------------------------------------------------------------------------
# mla_attention (dense over the latent cache)
# ---------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MlaCase:
    name: str
    seq_lens: tuple[int, ...]  # keys per request, its new tokens included
    q_lens: tuple[int, ...] | None  # None: one query per request, cu_query_lens=None
    num_heads: int
    block_size: int
    head_dim: int = 576
    kv_lora_rank: int = 512
    pad_rows: int = 0
    sinks: bool = False


MLA_CASES = [
    MlaCase("decode_576", (20, 7, 33, 1), None, 4, 8),
    MlaCase("mtp_q2_576", (10, 15, 2, 9), (2, 2, 2, 2), 2, 4, pad_rows=2),
    MlaCase("mixed_q_lens", (12, 5, 0, 9), (3, 1, 0, 4), 2, 16, pad_rows=1, sinks=True),
    MlaCase("small_dims_block_1", (6, 3), (2, 1), 4, 1, head_dim=80, kv_lora_rank=64),
]


@pytest.mark.parametrize("case", MLA_CASES, ids=lambda c: c.name)
def test_mla_attention(case):
    """Every head of a request's new token t (at position seq_len - q_len + t) attends to every key up to it:
    rows of the shared latent cache, keys their Dqk dims, values their first kv_lora_rank; poison elsewhere."""
    rng = np.random.default_rng(5)
    (kv_cache, _), tables = build_paged_cache(rng, case.seq_lens, case.block_size, (case.head_dim,))
    q_lens = case.q_lens or (1,) * len(case.seq_lens)
    num_real = sum(q_lens)
    q = randn(rng, num_real + case.pad_rows, case.num_heads, case.head_dim)
    q[num_real:] = np.nan
    cu = None if case.q_lens is None else np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    sinks = randn(rng, case.num_heads) if case.sinks else None
    got = ref.mla_attention(q, kv_cache, tables, np.asarray(case.seq_lens, np.int32), cu,
                            kv_lora_rank=case.kv_lora_rank, sinks=sinks, return_lse=True)

    scale = scale_of(None, case.head_dim)
    want_out = np.zeros((q.shape[0], case.num_heads, case.kv_lora_rank))
    want_lse = np.full(q.shape[:2], -np.inf)
    t = 0
    for b, (q_len, seq_len) in enumerate(zip(q_lens, case.seq_lens)):
        for i in range(q_len):
            rows = [lookup(kv_cache, tables[b], p) for p in range(seq_len - q_len + i + 1)]
            for h in range(case.num_heads):
                o, lse = brute_attend(q[t, h].astype(np.float64), rows, [r[:case.kv_lora_rank] for r in rows], scale)
                if o is not None and sinks is not None:  # one more logit in the denominator, with no value
                    o = o / (1 + math.exp(float(sinks[h]) - lse))
                if o is not None:
                    want_out[t, h] = o
                want_lse[t, h] = lse
            t += 1
    assert_matches(got, want_out, want_lse)


def test_mla_decode_equals_sparse_over_every_position():
    """Dense decode is top-k sparse attention whose indices are every position of the request."""
    rng = np.random.default_rng(6)
    seq_lens = (9, 17, 1)
    (kv_cache, _), tables = build_paged_cache(rng, seq_lens, 8, (576,))
    q = randn(rng, 3, 4, 576)
    topk = np.full((3, max(seq_lens)), -1, np.int32)
    for b, n in enumerate(seq_lens):
        topk[b, :n] = np.arange(n)
    dense = ref.mla_attention(q, kv_cache, tables, np.asarray(seq_lens, np.int32), return_lse=True)
    sparse = ref.sparse_mla_attention(q, kv_cache, tables, topk, return_lse=True)
    for got, want in zip(dense, sparse):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_sparse_default_scale_is_full_qk_dim():
    """softmax_scale=None means 1/sqrt(576), not 1/sqrt(kv_lora_rank)."""
    rng = np.random.default_rng(5)
    (kv_cache, _), tables = build_paged_cache(rng, (9,), 4, (576,))
    q = randn(rng, 1, 2, 576)
    topk = np.array([[0, 3, 8, -1]], np.int32)
    default = ref.sparse_mla_attention(q, kv_cache, tables, topk, return_lse=True)
    explicit = ref.sparse_mla_attention(q, kv_cache, tables, topk, softmax_scale=1 / 24, return_lse=True)
    for x, y in zip(default, explicit):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# ---------------------------------------------------------------------------------------------------------------
# merge_attention_states
# ---------------------------------------------------------------------------------------------------------------

# Split boundaries over n keys; repeated boundaries make empty splits.
MERGE_SPLITS = [
    pytest.param(11, (0, 11), id="one_split"),
    pytest.param(11, (0, 4, 8, 11), id="even_splits"),
    pytest.param(11, (0, 0, 5, 5, 11, 11), id="empty_first_middle_last"),
    pytest.param(9, (0, 1, 2, 9), id="length_one_splits"),
    pytest.param(1, (0, 0, 1, 1, 1), id="single_key_mostly_empty"),
]


@pytest.mark.parametrize("num_keys, bounds", MERGE_SPLITS)
def test_merge_numpy_chunks_equal_unsplit(num_keys, bounds):
    """Chunk states computed in float64 NumPy, merged by the oracle, equal brute-force attention over all keys."""
    rng = np.random.default_rng(6)
    num_tokens, num_heads, head_dim = 2, 3, 64
    q = randn(rng, num_tokens, num_heads, head_dim).astype(np.float64)
    k = randn(rng, num_keys, head_dim).astype(np.float64)
    v = randn(rng, num_keys, head_dim).astype(np.float64)
    scale = 1 / math.sqrt(head_dim)

    def state(lo, hi):
        out = np.full((num_tokens, num_heads, head_dim), np.nan)  # garbage for empty chunks
        lse = np.full((num_tokens, num_heads), -np.inf)
        for t in range(num_tokens):
            for h in range(num_heads):
                o, l = brute_attend(q[t, h], list(k[lo:hi]), list(v[lo:hi]), scale)
                if o is not None:
                    out[t, h] = o
                lse[t, h] = l
        return out, lse

    chunks = [state(lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:])]
    outs = np.stack([o for o, _ in chunks]).astype(np.float32)  # [S, T, H, D]
    lses = np.stack([l for _, l in chunks]).astype(np.float32)  # [S, T, H]
    assert_matches(ref.merge_attention_states(outs, lses), *state(0, num_keys))


@pytest.mark.parametrize("num_keys, bounds", MERGE_SPLITS)
def test_merge_oracle_chunks_equal_unsplit(num_keys, bounds):
    """Split one sparse query's keys into chunks via its top-k list; merging the chunk states is the unsplit call."""
    rng = np.random.default_rng(7)
    (kv_cache, _), tables = build_paged_cache(rng, (num_keys,), 4, (80,))
    q = randn(rng, 1, 4, 80)
    call = lambda idx: ref.sparse_mla_attention(q, kv_cache, tables, idx[None].astype(np.int32), kv_lora_rank=64,
                                                return_lse=True)
    positions = rng.permutation(num_keys)  # chunks need not be contiguous in position
    topk = np.full(num_keys, -1)
    states = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        idx = topk.copy()
        idx[lo:hi] = positions[lo:hi]
        states.append(call(idx))
    outs = jnp.stack([o for o, _ in states])
    lses = jnp.stack([l for _, l in states])
    want_out, want_lse = call(positions)
    out, lse = ref.merge_attention_states(outs, lses)
    assert rel_l2(np.asarray(out), np.asarray(want_out)) < RTOL
    assert rel_l2(np.asarray(lse), np.asarray(want_lse)) < RTOL


def test_merge_all_empty_is_zero_and_neg_inf():
    outs = np.full((3, 2, 4, 16), np.nan, np.float32)  # every split's output is garbage
    outs[1] = np.inf
    lses = np.full((3, 2, 4), -np.inf, np.float32)
    out, lse = jax.jit(ref.merge_attention_states)(outs, lses)
    np.testing.assert_array_equal(np.asarray(out), 0.0)
    assert np.isneginf(np.asarray(lse)).all()


def test_merge_ignores_garbage_in_empty_splits_per_row():
    """Emptiness is per row: a NaN row of one split must not leak into a row where another split has keys."""
    rng = np.random.default_rng(8)
    outs = randn(rng, 2, 3, 8)  # [S=2, rows=3, D]
    lses = np.array([[0.5, -np.inf, -np.inf], [-np.inf, 1.5, -np.inf]], np.float32)
    outs[0, 1:] = np.nan
    outs[1, ::2] = np.nan
    out, lse = ref.merge_attention_states(outs, lses)
    np.testing.assert_allclose(np.asarray(out[:2]), np.stack([outs[0, 0], outs[1, 1]]), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(out[2]), 0.0)
    np.testing.assert_allclose(np.asarray(lse), [0.5, 1.5, -np.inf])


# ---------------------------------------------------------------------------------------------------------------
# Conventions and errors
# ---------------------------------------------------------------------------------------------------------------


def test_low_precision_inputs_give_float32_and_plain_out_without_lse():
    rng = np.random.default_rng(9)
    q = jnp.asarray(randn(rng, 5, 4, 64), jnp.bfloat16)
    kv = jnp.asarray(randn(rng, 5, 2, 64), jnp.bfloat16)
    out = ref.varlen_attention(q, kv, kv, np.array([0, 2, 5], np.int32))
    assert isinstance(out, jax.Array) and out.dtype == jnp.float32 and out.shape == (5, 4, 64)


def _cache(num_blocks=4, block_size=4, heads=1, dim=16):
    return np.ones((num_blocks, block_size, heads, dim), np.float32)


_Q = np.ones((2, 2, 16), np.float32)
_KV = np.ones((2, 1, 16), np.float32)
_TABLE = np.array([[0, -1], [1, 2]], np.int32)

ERROR_CASES = [
    pytest.param(lambda: ref.varlen_attention(np.ones((2, 3, 16)), np.ones((2, 2, 16)), np.ones((2, 2, 16)), [0, 2]),
                 "multiple of",
                 id="gqa_not_divisible"),
    pytest.param(lambda: ref.paged_attention(_Q, _cache(), _cache(), _TABLE, [1], [0, 1, 2]), "seq_lens",
                 id="seq_lens_wrong_length"),
    pytest.param(lambda: ref.sparse_mla_attention(_Q, np.ones((4, 4, 16)), _TABLE, [[0, 1]], kv_lora_rank=8),
                 r"\[T, topk\]", id="topk_wrong_rows"),
    pytest.param(lambda: ref.sparse_mla_attention(_Q, np.ones((4, 4, 16)), _TABLE[:1], [[0], [1]],
                                                  kv_lora_rank=8), "one token per request",
                 id="no_cu_needs_one_token_per_request"),
    pytest.param(lambda: ref.mla_attention(_Q, np.ones((4, 4, 16)), _TABLE[:1], [1], kv_lora_rank=8),
                 "one token per request",
                 id="mla_no_cu_needs_one_token_per_request"),
    pytest.param(lambda: ref.mla_attention(_Q, np.ones((4, 4, 16)), _TABLE, [1, 1], kv_lora_rank=17),
                 r"kv_lora_rank must be in \[1, Dqk = 16\]", id="mla_rank_past_dqk"),
    pytest.param(lambda: ref.mla_attention(_Q, np.ones((4, 4, 8)), _TABLE, [1, 1], kv_lora_rank=8),
                 "one Dqk", id="mla_dims_differ"),
]


@pytest.mark.parametrize("call, message", ERROR_CASES)
def test_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# Broken inputs have a defined answer (docs/design.md#conventions): each pair gives the same result.
_RNG = np.random.default_rng(11)
_QR, _KR = _RNG.standard_normal((3, 2, 16)).astype(np.float32), _RNG.standard_normal((3, 1, 16)).astype(np.float32)
_CACHE = _RNG.standard_normal((4, 4, 1, 16)).astype(np.float32)
DEFINED_CASES = [
    pytest.param(lambda: ref.varlen_attention(_QR, _KR, _KR, [0, 2, 9]),
                 lambda: ref.varlen_attention(_QR, _KR, _KR, [0, 2, 3]), id="cu_past_num_tokens_clamped"),
    pytest.param(lambda: ref.varlen_attention(_QR, _KR, _KR, [0, 2, 1, 3]),
                 lambda: ref.varlen_attention(_QR, _KR, _KR, [0, 2, 2, 3]), id="cu_decreasing_running_max"),
    pytest.param(lambda: ref.varlen_attention(_QR, _KR, _KR, [-4, 3]),
                 lambda: ref.varlen_attention(_QR, _KR, _KR, [0, 3]), id="cu_negative_clamped"),
    pytest.param(lambda: ref.varlen_attention(_QR, _KR, _KR, [1, 3])[0],
                 lambda: np.zeros((2, 16), np.float32), id="rows_before_cu0_are_zero"),
    pytest.param(lambda: ref.varlen_attention(_QR, _KR, _KR, [0, 3], max_seqlen=2),
                 lambda: np.concatenate([ref.varlen_attention(_QR[:2], _KR[:2], _KR[:2], [0, 2]),
                                         np.zeros((1, 2, 16), np.float32)]), id="truncated_at_max_seqlen"),
    pytest.param(lambda: ref.paged_decode_attention(_QR[:2], _CACHE, _CACHE, _TABLE, [1, 99]),
                 lambda: ref.paged_decode_attention(_QR[:2], _CACHE, _CACHE, _TABLE, [1, 8]),
                 id="length_clamped_to_capacity"),
    pytest.param(lambda: ref.paged_decode_attention(_QR[:2], _CACHE, _CACHE, _TABLE, [8, 1]),
                 lambda: ref.paged_decode_attention(_QR[:2], _CACHE, _CACHE, _TABLE, [4, 1]),
                 id="page_minus_one_masked"),
    pytest.param(lambda: ref.paged_attention(_QR[:2], _CACHE, _CACHE, _TABLE, [1, 1], [0, 0, 2])[1],
                 lambda: ref.paged_decode_attention(_QR[1:2], _CACHE, _CACHE, _TABLE[1:], [1])[0],
                 id="q_len_past_seq_len_first_rows_see_nothing"),
    pytest.param(lambda: ref.sparse_mla_attention(_QR[:2], _CACHE[:, :, 0], _TABLE, [[0, -2], [0, 9]],
                                                  kv_lora_rank=8),
                 lambda: ref.sparse_mla_attention(_QR[:2], _CACHE[:, :, 0], _TABLE, [[0, -1], [0, -1]],
                                                  kv_lora_rank=8), id="topk_out_of_range_ignored"),
]


@pytest.mark.parametrize("broken, defined", DEFINED_CASES)
def test_broken_inputs_have_a_defined_answer(broken, defined):
    np.testing.assert_allclose(np.asarray(broken()), np.asarray(defined()), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("head_dim", [16, 128])
def test_huge_logits_match_float64(head_dim):
    """q × 1e20: scores near 1e21 stay finite in float32 and the softmax is one-hot-like; no NaN, float64 agrees."""
    rng = np.random.default_rng(5)
    q = (rng.standard_normal((6, 2, head_dim)) * 1e20).astype(np.float32)
    k = rng.standard_normal((6, 1, head_dim)).astype(np.float32)
    v = rng.standard_normal((6, 1, head_dim)).astype(np.float32)
    out = np.asarray(ref.varlen_attention(q, k, v, [0, 6]))
    s = np.einsum("mhd,nd->hmn", q.astype(np.float64), k[:, 0].astype(np.float64)) / np.sqrt(head_dim)
    s = np.where(np.tril(np.ones((6, 6), bool))[None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    want = np.einsum("hmn,nd->mhd", p / p.sum(-1, keepdims=True), v[:, 0].astype(np.float64))
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
