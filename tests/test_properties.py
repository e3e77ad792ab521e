"""Property tests (hypothesis, CPU interpret mode): every kernel against its reference on random batch compositions.

Batches are `st.lists` of per-request lengths, so a failure shrinks to the fewest, shortest requests that still
fail. Shapes are bucketed (num_tokens, num_seqs, table width and page pool padded to fixed sizes) so examples share
compiled interpret-mode programs; padding rows, empty requests, table tails and free pages are all poisoned.

Profiles (env var ``PALLAS_ATTN_HYPOTHESIS_PROFILE``):
  ci        default: 5 examples per test, derandomized (the same examples every run), no deadline.
  thorough  200 examples per test, random.
Runtime on this 2-core CPU with "ci": ~80 s for the file.
"""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, settings, strategies as st

from pallas_attn import (
    DecodeConfig,
    PrefillConfig,
    SparseConfig,
    paged_attention,
    paged_decode_attention,
    reference,
    sparse_mla_attention,
    varlen_attention,
)
from pallas_attn.core.metadata import bucket, cdiv
from pallas_attn.testing import assert_attention_close, make_paged_kv, random_packed

PROFILE_ENV = "PALLAS_ATTN_HYPOTHESIS_PROFILE"
_COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("ci", max_examples=5, derandomize=True, **_COMMON)
settings.register_profile("thorough", max_examples=200, **_COMMON)
PROFILE = settings.get_profile(os.environ.get(PROFILE_ENV, "ci"))  # applied per test: no global load_profile

PREFILL = PrefillConfig(block_m=16, block_n=16)
DECODE = DecodeConfig(block_n=16)
SPARSE = SparseConfig(block_n=16, block_h=16, num_warps=4)
NUM_SEQS = 4  # every batch is padded with empty requests to this many (one compiled shape per layout)
SPLITS = [dict(num_splits=None), dict(num_splits=1), dict(num_splits=3), dict(split_size=32)]

seeds = st.integers(0, 2**32 - 1)
head_dims = st.sampled_from([16, 32, 64])
block_sizes = st.sampled_from([1, 4, 16, 32])
splits = st.sampled_from(range(len(SPLITS)))


@st.composite
def heads(draw):
    """(num_q_heads, num_kv_heads) with GQA ratio in {1, 2, 4} and num_q_heads <= 4."""
    group = draw(st.sampled_from([1, 2, 4]))
    num_kv_heads = draw(st.sampled_from([1, 2][: 4 // group]))
    return group * num_kv_heads, num_kv_heads


def _pad_requests(lens, fill=0):
    return list(lens) + [fill] * (NUM_SEQS - len(lens))


def _paged_cache(rng, seq_lens, block_size, num_kv_heads, head_dim):
    """make_paged_kv with the page pool and table width bucketed (shared compiled shapes)."""
    pages = cdiv(np.asarray(seq_lens), block_size)
    pool = int(pages.sum())
    return make_paged_kv(rng, seq_lens, block_size, num_kv_heads, head_dim, jnp.float32,
                         extra_blocks=bucket(pool + 1, 16) - pool, max_blocks=bucket(int(pages.max()) + 1, 4))


def _check(out, lse, ref_out, ref_lse, n_rows):
    assert_attention_close(out, ref_out, dtype=jnp.float32, valid_rows=n_rows)
    lse, ref_lse = np.asarray(lse), np.asarray(ref_lse)
    np.testing.assert_array_equal(np.isneginf(lse[:n_rows]), np.isneginf(ref_lse[:n_rows]))
    fin = np.isfinite(ref_lse[:n_rows])
    np.testing.assert_allclose(lse[:n_rows][fin], ref_lse[:n_rows][fin], rtol=1e-5, atol=1e-4)
    assert np.all(np.asarray(out)[n_rows:] == 0) and np.all(lse[n_rows:] == -np.inf), "padding rows not 0 / -inf"


# ------------------------------------------------------------------------------------------------- prefill
@PROFILE
@given(lens=st.lists(st.integers(0, 300), min_size=1, max_size=NUM_SEQS), hq_hkv=heads(), head_dim=head_dims,
       causal=st.booleans(), seed=seeds)
def test_varlen_matches_reference(lens, hq_hkv, head_dim, causal, seed):
    hq, hkv = hq_hkv
    rng = np.random.default_rng(seed)
    total = sum(lens)
    t = bucket(total + 1, 64)  # at least one padding row
    lens = _pad_requests(lens)
    q, cu = random_packed(rng, lens, hq, head_dim, jnp.float32, pad_to=t)
    k, _ = random_packed(rng, lens, hkv, head_dim, jnp.float32, pad_to=t)
    v, _ = random_packed(rng, lens, hkv, head_dim, jnp.float32, pad_to=t)
    out, lse = varlen_attention(q, k, v, cu, max_seqlen=bucket(max(lens), 16), causal=causal, return_lse=True,
                                config=PREFILL)
    ref_out, ref_lse = reference.varlen_attention(q, k, v, cu, causal=causal, return_lse=True)
    _check(out, lse, ref_out, ref_lse, total)


# -------------------------------------------------------------------------------------------------- decode
@PROFILE
@given(contexts=st.lists(st.integers(0, 500), min_size=1, max_size=NUM_SEQS), hq_hkv=heads(), head_dim=head_dims,
       block_size=block_sizes, split=splits, seed=seeds)
def test_decode_matches_reference(contexts, hq_hkv, head_dim, block_size, split, seed):
    hq, hkv = hq_hkv
    rng = np.random.default_rng(seed)
    contexts = _pad_requests(contexts)
    kc, vc, bt = _paged_cache(rng, contexts, block_size, hkv, head_dim)
    q = jnp.asarray(rng.standard_normal((NUM_SEQS, hq, head_dim)), jnp.float32)
    ctx = jnp.asarray(contexts, jnp.int32)
    out, lse = paged_decode_attention(q, kc, vc, bt, ctx, return_lse=True, config=DECODE, **SPLITS[split])
    ref_out, ref_lse = reference.paged_decode_attention(q, kc, vc, bt, ctx, return_lse=True)
    _check(out, lse, ref_out, ref_lse, NUM_SEQS)


# --------------------------------------------------------------------------------------------- ragged paged
def _check_paged(requests, hq_hkv, head_dim, block_size, split, seed, *, max_query_len):
    """One ragged batch of ``(q_len, context_len)`` requests (padded to NUM_SEQS) against the reference."""
    hq, hkv = hq_hkv
    rng = np.random.default_rng(seed)
    requests = _pad_requests(requests, (0, 0))
    q_lens = [n for n, _ in requests]
    seq_lens = [n + c for n, c in requests]
    kc, vc, bt = _paged_cache(rng, seq_lens, block_size, hkv, head_dim)
    total = sum(q_lens)
    q, cu = random_packed(rng, q_lens, hq, head_dim, jnp.float32, pad_to=bucket(total + 1, max_query_len))
    sl = jnp.asarray(seq_lens, jnp.int32)
    out, lse = paged_attention(q, kc, vc, bt, sl, cu, max_query_len=max_query_len, return_lse=True, config=DECODE,
                               **SPLITS[split])
    ref_out, ref_lse = reference.paged_attention(q, kc, vc, bt, sl, cu, return_lse=True)
    _check(out, lse, ref_out, ref_lse, total)


@PROFILE
@given(requests=st.lists(st.tuples(st.integers(0, 16), st.integers(0, 500)), min_size=1, max_size=NUM_SEQS),
       hq_hkv=heads(), head_dim=head_dims, block_size=block_sizes, split=splits, seed=seeds)
def test_paged_matches_reference(requests, hq_hkv, head_dim, block_size, split, seed):
    """requests: (q_len, context_len) each; seq_len = context_len + q_len."""
    _check_paged(requests, hq_hkv, head_dim, block_size, split, seed, max_query_len=16)


@PROFILE
@given(requests=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 200)), min_size=0, max_size=NUM_SEQS - 1),
       chunk=st.tuples(st.integers(17, 40), st.integers(0, 200)), at=st.integers(0, NUM_SEQS - 1),
       hq_hkv=heads(), block_size=block_sizes, split=splits, seed=seeds)
def test_paged_mixed_with_chunks_matches_reference(requests, chunk, at, hq_hkv, block_size, split, seed):
    """Queries up to 40 tokens under max_query_len=64, at least one a chunk (q_len > 16): the two-launch path (short
    queries under ``config``, chunks under the default ``chunk_config``) into one output."""
    requests = list(requests)
    requests.insert(min(at, len(requests)), chunk)
    _check_paged(requests, hq_hkv, 32, block_size, split, seed, max_query_len=64)


# -------------------------------------------------------------------------------------------------- sparse
@PROFILE
@given(requests=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 200)), min_size=1, max_size=NUM_SEQS),
       num_heads=st.integers(1, 4), block_size=block_sizes, topk=st.sampled_from([8, 20, 32]),
       unused=st.sampled_from([0.0, 0.5, 1.0]), seed=seeds)
def test_sparse_matches_reference(requests, num_heads, block_size, topk, unused, seed):
    """requests: (tokens, seq_len) each; every token picks `topk` positions of its request (a fraction -1)."""
    rng = np.random.default_rng(seed)
    requests = _pad_requests(requests, (0, 0))
    tokens = [n for n, _ in requests]
    seq_lens = [s for _, s in requests]
    kv, _, bt = _paged_cache(rng, seq_lens, block_size, None, 80)
    total = sum(tokens)
    t = bucket(total + 1, 8)
    idx = rng.integers(-1, 1 << 20, (t, topk)).astype(np.int32)  # padding tokens: garbage
    row = 0
    for n, length in zip(tokens, seq_lens):
        for _ in range(n):
            pick = rng.integers(0, max(length, 1), topk)
            pick[(rng.random(topk) < unused) | (length == 0)] = -1
            idx[row] = pick
            row += 1
    q = np.full((t, num_heads, 80), np.nan, np.float32)
    q[:total] = rng.standard_normal((total, num_heads, 80))
    q, idx = jnp.asarray(q), jnp.asarray(idx)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(tokens)]), jnp.int32)
    out, lse = sparse_mla_attention(q, kv, bt, idx, cu_query_lens=cu, kv_lora_rank=64, return_lse=True,
                                    config=SPARSE)
    ref_out, ref_lse = reference.sparse_mla_attention(q, kv, bt, idx, cu_query_lens=cu, kv_lora_rank=64,
                                                      return_lse=True)
    _check(out, lse, ref_out, ref_lse, total)
