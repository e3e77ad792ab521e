"""Isolation whatever the inputs: corrupt lengths, tables and boundaries never reach another request.

Each scenario corrupts one request of a clean batch (docs/design.md#conventions says what the corrupted request
then computes; `pallas_attn.reference` defines it). Every slot no request owns holds NaN. The checks:
  * the other requests' outputs are bit-identical to the clean run's,
  * the corrupted request's output matches the reference on the corrupted inputs,
  * no output is NaN (every row is written: rows no request owns are zeros).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

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
from pallas_attn.testing import assert_attention_close, make_paged_kv, random_packed

BLOCK = 4  # tokens per page
SMALL = DecodeConfig(block_n=16)
F32 = jnp.float32


def _rows_equal(a, b, rows):
    np.testing.assert_array_equal(np.asarray(a)[rows], np.asarray(b)[rows])


def _no_nan(*xs):
    for x in xs:
        assert not np.isnan(np.asarray(x)).any()


def _like_reference(out, ref):
    """float32 agreement; NaN only where the reference has it (a table that names a poisoned page reads it)."""
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=2e-5, atol=2e-5, equal_nan=True)


# ------------------------------------------------------------------------------------------------ paged decode
# (name, corrupt(seq_lens, block_tables, num_blocks) -> (seq_lens, block_tables)); request 1 is the corrupted one.
DECODE_SCENARIOS = [
    ("length_past_capacity", lambda s, t, n: (s.at[1].set(10_000), t)),
    ("length_negative", lambda s, t, n: (s.at[1].set(-7), t)),
    ("length_int32_max", lambda s, t, n: (s.at[1].set(2**31 - 1), t)),
    ("page_negative", lambda s, t, n: (s, t.at[1, 0].set(-5))),
    ("page_past_pool", lambda s, t, n: (s, t.at[1, 1].set(n + 3))),
    ("page_huge", lambda s, t, n: (s, t.at[1, 2].set(2**31 - 1))),
    ("every_page_bad", lambda s, t, n: (s, t.at[1].set(-1))),
]


@pytest.mark.parametrize("name, corrupt", DECODE_SCENARIOS, ids=[s[0] for s in DECODE_SCENARIOS])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_corrupt_request_stays_alone(rng, name, corrupt, num_splits):
    lens = [13, 17, 1, 16]
    # Entries past each request's last page are -1 here, so a length past the table reads masked pages only.
    kc, vc, bt = make_paged_kv(rng, lens, BLOCK, 2, 16, F32, max_blocks=6, table_padding="neg")
    q = jnp.asarray(rng.standard_normal((4, 4, 16)), F32)
    sl = jnp.asarray(lens, jnp.int32)
    clean = paged_decode_attention(q, kc, vc, bt, sl, num_splits=num_splits, config=SMALL)
    sl_bad, bt_bad = corrupt(sl, bt, kc.shape[0])
    out = paged_decode_attention(q, kc, vc, bt_bad, sl_bad, num_splits=num_splits, config=SMALL)
    _no_nan(np.asarray(out)[[0, 2, 3]])
    _rows_equal(out, clean, [0, 2, 3])
    # A length past the request's keys reads its own last page's unwritten (here NaN) slots, as the reference does.
    _like_reference(out, reference.paged_decode_attention(q, kc, vc, bt_bad, sl_bad))


@pytest.mark.parametrize("bad_page", [0, 5, 9, None])
@pytest.mark.parametrize("num_splits", [1, 2])
def test_bad_page_in_any_tile_guards_the_request(rng, bad_page, num_splits):
    """A request with a page outside the pool runs every tile through the guarded step: a bad page in the first, a
    middle or the masked last tile, or none, with and without splits; the other requests run unguarded."""
    lens = [37, 40, 5]
    kc, vc, bt = make_paged_kv(rng, lens, BLOCK, 1, 16, F32, max_blocks=11, table_padding="neg")
    if bad_page is not None:
        bt = bt.at[1, bad_page].set(kc.shape[0] + bad_page)
    q = jnp.asarray(rng.standard_normal((3, 2, 16)), F32)
    sl = jnp.asarray(lens, jnp.int32)
    cfg = DecodeConfig(block_n=16)  # tiles 0 and 1 are full, tile 2 masked
    out = paged_decode_attention(q, kc, vc, bt, sl, num_splits=num_splits, config=cfg)
    _no_nan(out)
    _like_reference(out, reference.paged_decode_attention(q, kc, vc, bt, sl))
    cu = jnp.arange(4, dtype=jnp.int32)
    out = paged_attention(q, kc, vc, bt, sl, cu, max_query_len=1, num_splits=num_splits, config=cfg)
    _no_nan(out)
    _like_reference(out, reference.paged_attention(q, kc, vc, bt, sl, cu))


@pytest.mark.parametrize("key_start, key_end, bad, want", [
    (0, 12, [], True),
    (0, 12, [1], False),
    (0, 5, [2], True),  # keys 0..4 sit on entries 0 and 1: entry 2 is never read
    (4, 8, [0, 2], True),  # a split's keys: its own entry (1) only
    (9, 9, [0, 1, 2], True),  # no key: nothing to check
    (0, 12, [3], True),  # the entry after the request's last key is not read
])
def test_program_pages_in_pool_reads_only_its_own_entries(key_start, key_end, bad, want):
    """The check a paged program runs before its key loop reads the table entries of its keys only; entries past a
    request's pages (here -1) never count."""
    from jax.experimental import pallas as pl

    from pallas_attn.core import tiles

    table = np.full(8, -1, np.int32)  # row 1 of a 2 × 4 table (block size 4): keys 0..11 on entries 4..6
    table[4:7] = 1
    for j in bad:
        table[4 + j] = 7  # past a pool of 4 pages

    def kernel(table_ref, ok_ref):
        ok_ref[0] = tiles.program_pages_in_pool(table_ref, 4, key_start, key_end, 4, 4, 4).astype(jnp.int32)

    got = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((1,), jnp.int32), interpret=True)(
        jnp.asarray(table))
    assert bool(got[0]) == want


# ------------------------------------------------------------------------------------------------ ragged paged
# Request 1 of [decode, verification, chunk, decode] is corrupted.
PAGED_SCENARIOS = DECODE_SCENARIOS + [
    ("q_len_past_seq_len", lambda s, t, n: (s.at[1].set(3), t)),  # 6 new tokens, 3 keys: 3 rows see nothing
]


@pytest.mark.parametrize("name, corrupt", PAGED_SCENARIOS, ids=[s[0] for s in PAGED_SCENARIOS])
def test_paged_corrupt_request_stays_alone(rng, name, corrupt):
    q_lens, seq_lens = [1, 6, 9, 1], [13, 17, 9, 21]
    kc, vc, bt = make_paged_kv(rng, seq_lens, BLOCK, 2, 16, F32, max_blocks=7, table_padding="neg")
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    q = jnp.asarray(rng.standard_normal((20, 4, 16)), F32)  # 17 rows + 3 padding
    sl = jnp.asarray(seq_lens, jnp.int32)
    clean = paged_attention(q, kc, vc, bt, sl, cu, max_query_len=16, config=SMALL)
    sl_bad, bt_bad = corrupt(sl, bt, kc.shape[0])
    out = paged_attention(q, kc, vc, bt_bad, sl_bad, cu, max_query_len=16, config=SMALL)
    others = np.r_[0:1, 7:20]
    _no_nan(np.asarray(out)[others])
    _rows_equal(out, clean, others)
    _like_reference(out, reference.paged_attention(q, kc, vc, bt_bad, sl_bad, cu))


CU_SCENARIOS = [  # clean cu = [0, 1, 7, 16, 17]; rows 17..19 are padding
    ("decreasing", [0, 1, 7, 4, 17], [0, 1]),  # request 2 is empty, request 3 starts at 7
    ("past_num_tokens", [0, 1, 7, 16, 40], [0, 1, 2]),
    ("negative_start", [-5, 1, 7, 16, 17], [0, 1, 2, 3]),  # read as 0
    ("start_past_zero", [2, 2, 7, 16, 17], [2, 3]),  # rows 0..1 belong to no request: zeros
]


@pytest.mark.parametrize("name, cu_bad, intact", CU_SCENARIOS, ids=[s[0] for s in CU_SCENARIOS])
def test_paged_corrupt_boundaries(rng, name, cu_bad, intact):
    q_lens, seq_lens = [1, 6, 9, 1], [13, 17, 9, 21]
    kc, vc, bt = make_paged_kv(rng, seq_lens, BLOCK, 2, 16, F32, max_blocks=7)
    cu = np.concatenate([[0], np.cumsum(q_lens)])
    q = jnp.asarray(rng.standard_normal((20, 4, 16)), F32)
    sl = jnp.asarray(seq_lens, jnp.int32)
    clean = paged_attention(q, kc, vc, bt, sl, jnp.asarray(cu, jnp.int32), max_query_len=16, config=SMALL)
    out, lse = paged_attention(q, kc, vc, bt, sl, jnp.asarray(cu_bad, jnp.int32), max_query_len=16, config=SMALL,
                               return_lse=True)
    _no_nan(out)
    for b in intact:
        _rows_equal(out, clean, np.r_[cu[b]:cu[b + 1]])
    ref, ref_lse = reference.paged_attention(q, kc, vc, bt, sl, jnp.asarray(cu_bad, jnp.int32), return_lse=True)
    assert_attention_close(out, ref)
    np.testing.assert_array_equal(np.isneginf(np.asarray(lse)), np.isneginf(np.asarray(ref_lse)))


# ------------------------------------------------------------------------------------------------ varlen prefill
VARLEN_SCENARIOS = [  # clean lens [5, 11, 1, 7] -> cu [0, 5, 16, 17, 24], T = 27 (3 padding rows)
    ("decreasing", [0, 5, 3, 17, 24], [0, 3]),
    ("past_num_tokens", [0, 5, 16, 17, 99], [0, 1, 2]),
    ("negative_start", [-9, 5, 16, 17, 24], [0, 1, 2, 3]),
    ("start_past_zero", [3, 5, 16, 17, 24], [1, 2, 3]),
    ("longer_than_max_seqlen", [0, 5, 16, 17, 24], [0, 2, 3]),  # request 1: 11 rows > max_seqlen 8
]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("name, cu_bad, intact", VARLEN_SCENARIOS, ids=[s[0] for s in VARLEN_SCENARIOS])
def test_varlen_corrupt_boundaries(rng, name, cu_bad, intact, causal):
    lens = [5, 11, 1, 7]
    # Padding rows are large but finite: a request whose broken boundary reaches them computes on them (the
    # reference does the same); NaN there would only make that request's own rows NaN.
    q, cu = random_packed(rng, lens, 4, 16, F32, pad_to=27, poison=1e3)
    k, _ = random_packed(rng, lens, 2, 16, F32, pad_to=27, poison=1e3)
    v, _ = random_packed(rng, lens, 2, 16, F32, pad_to=27, poison=-1e3)
    cfg = PrefillConfig(block_m=16, block_n=16)
    kw = dict(max_seqlen=16 if name != "longer_than_max_seqlen" else 8, causal=causal, config=cfg)
    clean = varlen_attention(q, k, v, cu, **{**kw, "max_seqlen": 16})
    out, lse = varlen_attention(q, k, v, jnp.asarray(cu_bad, jnp.int32), return_lse=True, **kw)
    _no_nan(out, np.where(np.isneginf(np.asarray(lse)), 0, np.asarray(lse)))
    cu_np = np.asarray(cu)
    for b in intact:
        _rows_equal(out, clean, np.r_[cu_np[b]:cu_np[b + 1]])
    ref, ref_lse = reference.varlen_attention(q, k, v, jnp.asarray(cu_bad, jnp.int32), max_seqlen=kw["max_seqlen"],
                                              causal=causal, return_lse=True)
    assert_attention_close(out, ref)
    np.testing.assert_array_equal(np.isneginf(np.asarray(lse)), np.isneginf(np.asarray(ref_lse)))


# ------------------------------------------------------------------------------------------------ sparse MLA
def test_sparse_page_outside_pool_is_ignored(rng):
    """A top-k index on a page id outside the pool is ignored like -1 (the Mosaic kernel: tests/test_sparse.py on
    the GPU)."""
    lens = [40, 24]
    kv, _, bt = make_paged_kv(rng, lens, 8, None, 64 + 32, F32, max_blocks=6)
    q = jnp.asarray(rng.standard_normal((2, 16, 96)), F32)
    topk = jnp.asarray(np.stack([rng.permutation(40)[:16], np.r_[rng.permutation(24)[:12], [-1] * 4]]), jnp.int32)
    cfg = SparseConfig(block_n=16, block_h=16)
    kw = dict(kv_lora_rank=64, config=cfg, backend="triton")
    clean = sparse_mla_attention(q, kv, bt, topk, **kw)
    bt_bad = bt.at[0, 2].set(-3).at[0, 3].set(kv.shape[0] + 10)
    out = sparse_mla_attention(q, kv, bt_bad, topk, **kw)
    _no_nan(out)
    _rows_equal(out, clean, [1])
    assert_attention_close(out[:1], reference.sparse_mla_attention(q, kv, bt_bad, topk, kv_lora_rank=64)[:1])


def test_sparse_index_past_seq_len_is_ignored(rng):
    """With ``seq_lens``, a top-k index past the request's keys but inside an owned page (an unwritten, here NaN,
    slot) is ignored like -1; without it only the table's capacity bounds indices (the slot is read)."""
    lens = [37, 20]
    kv, _, bt = make_paged_kv(rng, lens, 8, None, 64 + 32, F32, max_blocks=6)  # slots past each length: NaN
    q = jnp.asarray(rng.standard_normal((3, 16, 96)), F32)
    topk = np.stack([rng.permutation(37)[:16], rng.permutation(20)[:16], rng.permutation(20)[:16]]).astype(np.int32)
    cu = jnp.asarray([0, 1, 3], jnp.int32)
    sl = jnp.asarray(lens, jnp.int32)
    kw = dict(cu_query_lens=cu, kv_lora_rank=64, config=SparseConfig(block_n=16, block_h=16), backend="triton")
    clean = sparse_mla_attention(q, kv, bt, jnp.asarray(topk), seq_lens=sl, **kw)
    bad = topk.copy()
    bad[1, :3] = [20, 23, 47]  # request 1's last page holds slots 16..23; 47 is past the table row
    bad[0, 0] = 39  # request 0's last page: slots 32..39
    out = sparse_mla_attention(q, kv, bt, jnp.asarray(bad), seq_lens=sl, **kw)
    _no_nan(out)
    _rows_equal(out, clean, [2])
    assert_attention_close(out, reference.sparse_mla_attention(q, kv, bt, jnp.asarray(bad), cu_query_lens=cu,
                                                               seq_lens=sl, kv_lora_rank=64))
    unbounded = sparse_mla_attention(q, kv, bt, jnp.asarray(bad), **kw)  # slot 20 of request 1 read: NaN
    assert np.isnan(np.asarray(unbounded)[1]).all() and not np.isnan(np.asarray(unbounded)[2]).any()


# ------------------------------------------------------------------------------------------------ property
def draw_corruption(data, seq_lens, block_tables):
    """Hypothesis: some requests get any int32 length and table row. ``(seq_lens, block_tables, clean requests)``."""
    num_seqs, max_blocks = block_tables.shape
    bad = data.draw(st.lists(st.booleans(), min_size=num_seqs, max_size=num_seqs))
    sl_bad, bt_bad = np.asarray(seq_lens).copy(), np.asarray(block_tables).copy()
    for b, is_bad in enumerate(bad):
        if is_bad:
            sl_bad[b] = data.draw(st.integers(-(2**31), 2**31 - 1))
            bt_bad[b] = data.draw(st.lists(st.integers(-(2**31), 2**31 - 1), min_size=max_blocks,
                                           max_size=max_blocks))
    return jnp.asarray(sl_bad), jnp.asarray(bt_bad), [b for b, is_bad in enumerate(bad) if not is_bad]


@settings(max_examples=12, deadline=None)
@given(data=st.data())
def test_decode_any_tables_and_lengths(data):
    """Whatever the lengths and table entries, every output is finite and equals the reference; a request whose
    own inputs are clean is bit-identical to a clean run."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    lens = data.draw(st.lists(st.integers(0, 20), min_size=1, max_size=4))
    kc, vc, bt = make_paged_kv(rng, lens, BLOCK, 1, 16, F32, max_blocks=6)
    q = jnp.asarray(rng.standard_normal((len(lens), 2, 16)), F32)
    sl = jnp.asarray(lens, jnp.int32)
    clean = paged_decode_attention(q, kc, vc, bt, sl, num_splits=1, config=SMALL)
    sl_bad, bt_bad, good = draw_corruption(data, sl, bt)
    out = paged_decode_attention(q, kc, vc, bt_bad, sl_bad, num_splits=1, config=SMALL)
    _no_nan(np.asarray(out)[good])
    _rows_equal(out, clean, good)
    _like_reference(out, reference.paged_decode_attention(q, kc, vc, bt_bad, sl_bad))


def test_no_nan_from_unwritten_rows_under_jit(rng):
    """The guarantees hold inside a jitted step with traced lengths (nothing is decided on the host)."""
    lens = [8, 3]  # whole pages: a length past them reads only -1 entries (masked)
    kc, vc, bt = make_paged_kv(rng, lens, BLOCK, 1, 16, F32, max_blocks=4, table_padding="neg")
    q = jnp.asarray(rng.standard_normal((2, 2, 16)), F32)
    step = jax.jit(lambda q, bt, sl: paged_decode_attention(q, kc, vc, bt, sl, config=SMALL))
    out = step(q, bt.at[0, 0].set(-1), jnp.asarray([99, 3], jnp.int32))
    _no_nan(out)
