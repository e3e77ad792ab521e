"""paged_attention / paged_decode_attention(backend="mosaic"): the Hopper kernel against the reference.

On CPU the Mosaic GPU interpreter runs it (2-6 s a case; fresh shared memory starts as NaN there, so a stale slot,
an uncopied page or an unwritten row fails). Every slot no request owns holds NaN (or a huge value), q's padding
rows NaN. Each case has a hard time limit: an interpreted deadlock fails the test instead of stalling the suite.
"""

from __future__ import annotations

import functools
from unittest import mock

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from pallas_attn import DecodeConfig, paged_attention, paged_decode_attention, reference
from pallas_attn.kernels.mosaic import paged as mosaic_paged
from pallas_attn.testing import assert_attention_close, make_paged_kv

from .test_isolation import draw_corruption

BF16 = jnp.bfloat16
MOSAIC = dict(backend="mosaic")
pytestmark = pytest.mark.timeout(300, method="thread")

# name: (query_lens, seq_lens, block_size, num_q_heads, num_kv_heads, head_dim, kwargs). Key tiles are 64 keys:
# lengths 63/64/65 and 127/129 sit on their edges; pages of 8/16/32 are several copies a tile, 64/128 one.
SCENARIOS = {
    "decode_gqa4_bs16_edges": ([1, 1, 1, 1, 1], [1, 63, 64, 65, 129], 16, 8, 2, 64, {}),
    "mixed_gqa4_bs8": ([3, 1, 6, 0, 17], [3, 5, 136, 9, 77], 8, 8, 2, 64, {}),
    "chunk_gqa3_bs32_d128": ([2, 70, 1], [66, 73, 200], 32, 6, 2, 128, {}),
    "decode_mha_bs128_splits": ([1, 1, 1], [300, 33, 0], 128, 4, 4, 128, dict(num_splits=3)),
    "verify_mqa_bs64_split_size_sinks": ([5, 1], [300, 100], 64, 4, 1, 64, dict(split_size=128, sinks=True)),
    "window_gqa2_bs16": ([1, 4, 9], [10, 200, 150], 16, 4, 2, 64, dict(window_size=(40, -1))),
    "softcap_alibi_sinks": ([1, 4, 2], [10, 200, 65], 16, 4, 2, 64, dict(softcap=30.0, alibi=True, sinks=True)),
    "d256_mqa_fp16": ([8, 1], [60, 70], 16, 2, 1, 256, dict(dtype=jnp.float16)),
    # fixed 64-key segments counted from each block's window: contexts hold many more than the window needs
    "window_split_size_long": ([1, 3, 1], [300, 260, 40], 16, 4, 2, 64, dict(window_size=(20, -1), split_size=64)),
    "window_right_sinks_split": ([1, 3], [70, 140], 16, 4, 2, 64,
                                 dict(num_splits=2, window_size=(20, 0), sinks=True)),
    "gqa16_verify": ([4, 2], [90, 4], 16, 16, 1, 64, dict(window_size=(30, -1))),
    # pages that are not a power of two: copies of gcd(page, 64) rows (16 for 48 and 80, 32 for 544)
    "decode_bs48_edges": ([1, 1, 1, 1], [47, 48, 97, 200], 48, 4, 2, 64, {}),
    "verify_bs80_window": ([3, 1], [100, 50], 80, 4, 1, 64, dict(window_size=(30, -1))),
    "chunk_bs544_splits": ([1, 30], [600, 1100], 544, 4, 2, 64, dict(num_splits=2)),
    # a chunk beside decodes over long contexts: two launches, the decodes split on their own, the chunk unsplit
    "two_launches_short_split": ([1, 40, 1], [2100, 100, 1500], 64, 4, 2, 64, dict(sinks=True)),
}


def _inputs(rng, q_lens, seq_lens, bs, hq, hkv, d, dtype, poison=float("nan"), pad=3):
    kc, vc, bt = make_paged_kv(rng, seq_lens, bs, hkv, d, dtype, poison=poison)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = np.full((cu[-1] + pad, hq, d), np.nan, np.float32)
    q[: cu[-1]] = rng.standard_normal((cu[-1], hq, d))
    return jnp.asarray(q, dtype), kc, vc, bt, jnp.asarray(seq_lens, jnp.int32), jnp.asarray(cu)


def _features(rng, hq, kw):
    kw = dict(kw)
    if kw.pop("alibi", False):
        kw["alibi_slopes"] = jnp.asarray(rng.uniform(0.02, 0.5, hq), jnp.float32)
    if kw.pop("sinks", False):
        kw["sinks"] = jnp.asarray(rng.standard_normal(hq), jnp.float32)
    return kw


def _fp8_cache(rng, kc, vc, fmt, mode: str):
    """``(k8, v8, scales)`` from float32 caches: per tensor (0.03, 0.015), or per (token, head) after spreading the
    rows' magnitudes over 10^U(-3, 2) (a slot no request owns: NaN values, NaN scale)."""
    if mode == "tensor":
        scales = dict(k_scale=jnp.float32(0.03), v_scale=jnp.float32(0.015))
    else:
        spread = lambda x: x * jnp.asarray(10.0 ** rng.uniform(-3, 2, x.shape[:3] + (1,)), jnp.float32)  # noqa: E731
        kc, vc = spread(kc), spread(vc)
        scales = dict(k_scale=reference.kv_scales_per_token_head(kc, fmt),
                      v_scale=reference.kv_scales_per_token_head(vc, fmt))
    return (reference.quantize_kv(kc, scales["k_scale"], fmt), reference.quantize_kv(vc, scales["v_scale"], fmt),
            scales)


@pytest.mark.parametrize("name", SCENARIOS)
def test_matches_reference(name, rng):
    _check_scenario(SCENARIOS[name], rng)


def _check_scenario(scenario, rng):
    """One of :data:`SCENARIOS` through the Mosaic kernel against the reference: outputs, LSE, padding rows."""
    q_lens, seq_lens, bs, hq, hkv, d, kw = scenario
    kw = dict(kw)
    dtype = kw.pop("dtype", BF16)
    args = _inputs(rng, q_lens, seq_lens, bs, hq, hkv, d, dtype)
    kw = _features(rng, hq, kw)
    out, lse = paged_attention(*args, max_query_len=max(q_lens), return_lse=True, **kw, **MOSAIC)
    for split in ("num_splits", "split_size"):
        kw.pop(split, None)
    ref_out, ref_lse = reference.paged_attention(*args, return_lse=True, **kw)
    n = int(sum(q_lens))
    assert_attention_close(out, ref_out, dtype=dtype, valid_rows=n)
    np.testing.assert_allclose(np.asarray(lse)[:n], np.asarray(ref_lse)[:n], rtol=1e-5, atol=1e-4)
    assert np.all(np.asarray(out, np.float32)[n:] == 0) and np.all(np.asarray(lse)[n:] == -np.inf)


@pytest.mark.parametrize("kw", [{}, dict(num_splits=2, window_size=(50, -1), sinks=True)])
def test_decode_matches_reference(kw, rng):
    lens = [0, 1, 63, 64, 65, 200]
    kc, vc, bt = make_paged_kv(rng, lens, 16, 2, 128, BF16)
    q = jnp.asarray(rng.standard_normal((len(lens), 8, 128)), BF16)
    sl = jnp.asarray(lens, jnp.int32)
    kw = _features(rng, 8, kw)
    out, lse = paged_decode_attention(q, kc, vc, bt, sl, return_lse=True, **kw, **MOSAIC)
    kw.pop("num_splits", None)
    ref_out, ref_lse = reference.paged_decode_attention(q, kc, vc, bt, sl, return_lse=True, **kw)
    assert_attention_close(out, ref_out, dtype=BF16)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), rtol=1e-5, atol=1e-4)
    assert np.all(np.asarray(out, np.float32)[0] == 0)  # no key: 0, LSE -inf


@pytest.mark.parametrize("poison", [1e30, -1e30])
def test_isolation_under_poison(poison, rng):
    """Huge finite values in every slot no request owns: a score or value of one would swamp the softmax."""
    q_lens, seq_lens = [1, 6, 20], [40, 70, 100]
    args = _inputs(rng, q_lens, seq_lens, 16, 4, 2, 64, BF16, poison=poison)
    out = paged_attention(*args, max_query_len=20, **MOSAIC)
    assert_attention_close(out, reference.paged_attention(*args), dtype=BF16, valid_rows=27)


# (name, corrupt(seq_lens, block_tables, num_blocks)); request 1 is the corrupted one
CORRUPT = [
    ("length_past_capacity", lambda s, t, n: (s.at[1].set(10_000), t)),
    ("length_negative", lambda s, t, n: (s.at[1].set(-7), t)),
    ("page_past_pool", lambda s, t, n: (s, t.at[1, 1].set(n + 3))),
    ("every_page_bad", lambda s, t, n: (s, t.at[1].set(-1))),
]


# the same over an FP8 cache (NaN in every slot no request owns, and in its scale per token): per tensor for the two
# ways out of a request's pages, per token for every case (its scales are gathered by the same table and lengths)
CORRUPT_CASES = [(*c, None) for c in CORRUPT] + [
    (f"e4m3_{mode}_{name}", fn, mode) for name, fn in CORRUPT for mode in ("tensor", "token")
    if mode == "token" or name in ("length_past_capacity", "page_past_pool")]


@pytest.mark.parametrize("name, corrupt, fp8", CORRUPT_CASES, ids=[c[0] for c in CORRUPT_CASES])
def test_corrupt_request_stays_alone(name, corrupt, fp8, rng):
    """A request's broken length or table changes its own rows only (bit-identical others, no NaN anywhere it owns
    nothing), and what it computes is the reference's rule (docs/design.md#isolation-whatever-the-inputs)."""
    q_lens, seq_lens = [1, 6, 9, 1], [13, 70, 9, 21]
    kc, vc, bt = make_paged_kv(rng, seq_lens, 8, 2, 64, BF16, max_blocks=10, table_padding="neg")
    scales = {}
    if fp8 is not None:
        kc, vc, scales = _fp8_cache(rng, kc.astype(jnp.float32), vc.astype(jnp.float32), jnp.float8_e4m3fn, fp8)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    q = jnp.asarray(rng.standard_normal((20, 4, 64)), BF16)
    sl = jnp.asarray(seq_lens, jnp.int32)
    clean = paged_attention(q, kc, vc, bt, sl, cu, max_query_len=9, **scales, **MOSAIC)
    sl_bad, bt_bad = corrupt(sl, bt, kc.shape[0])
    out = paged_attention(q, kc, vc, bt_bad, sl_bad, cu, max_query_len=9, **scales, **MOSAIC)
    others = np.r_[0:1, 7:20]
    out_np, clean_np = np.asarray(out, np.float32), np.asarray(clean, np.float32)
    assert not np.isnan(out_np[others]).any()
    np.testing.assert_array_equal(out_np[others], clean_np[others])
    ref = np.asarray(reference.paged_attention(q, kc, vc, bt_bad, sl_bad, cu, **scales), np.float32)
    np.testing.assert_allclose(out_np[1:7], ref[1:7], rtol=2e-2, atol=2e-2, equal_nan=True)


@settings(max_examples=6, deadline=None)
@given(data=st.data())
def test_any_tables_and_lengths(data):
    """Whatever the lengths and table entries, a request whose own inputs are clean is bit-identical to a clean run
    and finite, and every output follows the reference's rule; also when one or two programs run every request's
    items one after another through the same K/V slots."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    programs = data.draw(st.sampled_from([None, 1, 2]))
    if programs is not None:
        with mock.patch.object(mosaic_paged, "persistent_programs", lambda num_items, head_dim, persistent: programs):
            return _any_tables_and_lengths(data, rng)
    return _any_tables_and_lengths(data, rng)


def _any_tables_and_lengths(data, rng):
    lens = data.draw(st.lists(st.integers(0, 40), min_size=1, max_size=3))
    kc, vc, bt = make_paged_kv(rng, lens, 8, 1, 64, BF16, max_blocks=6)
    q = jnp.asarray(rng.standard_normal((len(lens), 2, 64)), BF16)
    sl = jnp.asarray(lens, jnp.int32)
    clean = np.asarray(paged_decode_attention(q, kc, vc, bt, sl, **MOSAIC), np.float32)
    sl_bad, bt_bad, good = draw_corruption(data, sl, bt)
    args = (q, kc, vc, bt_bad, sl_bad)
    out = np.asarray(paged_decode_attention(*args, **MOSAIC), np.float32)
    assert not np.isnan(out[good]).any()
    np.testing.assert_array_equal(out[good], clean[good])
    ref = np.asarray(reference.paged_decode_attention(*args), np.float32)
    np.testing.assert_allclose(out, ref, rtol=2e-2, atol=2e-2, equal_nan=True)


def test_batch_invariance_fixed_split_size(rng):
    """With ``split_size`` a request's output is bit-identical alone and in a batch that splits differently."""
    lens = [300, 5, 129]
    kc, vc, bt = make_paged_kv(rng, lens, 16, 2, 64, BF16)
    q = jnp.asarray(rng.standard_normal((3, 4, 64)), BF16)
    sl = jnp.asarray(lens, jnp.int32)
    batch = paged_decode_attention(q, kc, vc, bt, sl, split_size=128, **MOSAIC)
    alone = paged_decode_attention(q[:1], kc, vc, bt[:1], sl[:1], split_size=128, **MOSAIC)
    np.testing.assert_array_equal(np.asarray(batch[:1], np.float32), np.asarray(alone, np.float32))


def test_two_launch_split_plan():
    """With a chunk in the batch each launch decides its splits: decodes over long contexts split, a chunk of
    thousands of rows fills the GPU alone."""
    from pallas_attn.core import config
    from pallas_attn.ops import paged as paged_op

    seen = {}

    def fake(*args, **kw):
        seen.update(kw)
        return jnp.zeros(args[0].shape, args[0].dtype), jnp.zeros(args[0].shape[:2], jnp.float32)

    q = jnp.zeros((8192 + 3, 32, 128), BF16)
    cache = jnp.zeros((3 * 1024, 16, 8, 128), BF16)
    tables, lens = jnp.zeros((4, 1024), jnp.int32), jnp.full((4,), 16384, jnp.int32)
    cu = jnp.asarray([0, 1, 2, 3, 8195], jnp.int32)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mosaic_paged, "paged_attention_mosaic", fake)
        paged_op._mosaic(q, cache, cache, tables, lens, cu, None, None, max_query_len=8192, scale=1.0,
                         mods=paged_op.masks.NO_MODS, num_splits=None, split_size=None, return_lse=False,
                         interpret=True)
    short = config.resolve_splits(4 * 8, 16384, 64, None, None, pow2_segments=True)
    assert seen["short_plan"][:2] == short and short[0] > 1
    assert seen["plan"].num_splits == 1


@pytest.mark.parametrize("head_dim, balanced", [(64, False), (128, False), (256, True)])
def test_looping_programs_skip_the_tail_balance(head_dim, balanced, monkeypatch):
    """A decode batch that fills the GPU (64 requests × 8 KV heads, 8k keys of capacity): the tail balance cuts it
    into 2,048-key segments for a program an item (head dim 256); programs looping over items dealt longest first
    (head dims 64 and 128) balance the tail themselves and take it whole."""
    from pallas_attn.core import config
    from pallas_attn.ops import paged as paged_op

    seen = {}

    def fake(*args, **kw):
        seen.update(kw)
        return jnp.zeros(args[0].shape, args[0].dtype), jnp.zeros(args[0].shape[:2], jnp.float32)

    monkeypatch.setattr(config.backend, "num_sms", lambda: 132)
    monkeypatch.setattr(mosaic_paged, "paged_attention_mosaic", fake)
    q = jnp.zeros((64, 32, head_dim), BF16)
    cache = jnp.zeros((64 * 512, 16, 8, head_dim), BF16)
    tables, lens = jnp.zeros((64, 512), jnp.int32), jnp.full((64,), 8192, jnp.int32)
    paged_op._mosaic(q, cache, cache, tables, lens, jnp.arange(65, dtype=jnp.int32), None, None, max_query_len=1,
                     scale=1.0, mods=paged_op.masks.NO_MODS, num_splits=None, split_size=None, return_lse=False,
                     interpret=True)
    assert seen["plan"] == ((4, 2048, False) if balanced else (1, None, True))


def test_decode_is_paged_attention_with_one_token(rng):
    """``paged_decode_attention`` and ``paged_attention`` with one token a request run the same kernel."""
    lens = [17, 90]
    kc, vc, bt = make_paged_kv(rng, lens, 32, 1, 64, BF16)
    q = jnp.asarray(rng.standard_normal((2, 4, 64)), BF16)
    sl = jnp.asarray(lens, jnp.int32)
    a = paged_decode_attention(q, kc, vc, bt, sl, **MOSAIC)
    b = paged_attention(q, kc, vc, bt, sl, jnp.arange(3, dtype=jnp.int32), max_query_len=1, **MOSAIC)
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("change, match", [
    (dict(dtype=jnp.float32), r"backend='mosaic' does not support dtype float32"),
    (dict(head_dim=96), r"head_dim=96 \(supported: 64, 128, 256\)"),
    (dict(block_size=4), r"block_size=4 \(supported: multiples of 8"),
    (dict(split_size=32), r"split_size=32"),
    (dict(config=DecodeConfig(block_n=16)), r"config= tunes the Triton kernel"),
])
def test_unsupported_raises(change, match, rng):
    dtype, d, bs = change.get("dtype", BF16), change.get("head_dim", 64), change.get("block_size", 16)
    kc, vc, bt = make_paged_kv(rng, [20, 5], bs, 2, d, dtype)
    q = jnp.asarray(rng.standard_normal((2, 4, d)), dtype)
    kw = {k: v for k, v in change.items() if k in ("split_size", "config")}
    if change.get("fp8"):
        kc, vc = kc.astype(jnp.float8_e4m3fn), vc.astype(jnp.float8_e4m3fn)
        kw.update(k_scale=1.0, v_scale=1.0)
    with pytest.raises(ValueError, match=match):
        paged_decode_attention(q, kc, vc, bt, jnp.array([20, 5], jnp.int32), **kw, **MOSAIC)


# name: (format, scale mode, query_lens, seq_lens, block_size, head_dim, kwargs). Pages are quantised from float32
# values by reference.quantize_kv (stored = value / scale, saturated); slots no request owns hold NaN.
FP8 = {
    "e4m3_decode_bs16_splits": (jnp.float8_e4m3fn, "tensor", [1, 1, 1], [1, 70, 130], 16, 64, dict(num_splits=2)),
    "e5m2_mixed_bs64_d128": (jnp.float8_e5m2, "tensor", [1, 6, 20], [90, 64, 150], 64, 128, {}),
    "e4m3_window_sinks_fp16": (jnp.float8_e4m3fn, "tensor", [1, 4], [200, 77], 8, 64,
                               dict(window_size=(50, -1), sinks=True, dtype=jnp.float16)),
    # per-(token, head) scales: the key scales on the score columns, each value row widened with its own
    "e4m3_token_decode_bs16_splits": (jnp.float8_e4m3fn, "token", [1, 1, 1], [1, 70, 130], 16, 64,
                                      dict(num_splits=2)),
    "e5m2_token_mixed_bs64_d128": (jnp.float8_e5m2, "token", [1, 6, 20], [90, 64, 150], 64, 128, {}),
    "e4m3_token_window_softcap_sinks_fp16": (jnp.float8_e4m3fn, "token", [1, 4, 1], [200, 77, 150], 8, 64,
                                             dict(window_size=(50, -1), softcap=20.0, sinks=True,
                                                  dtype=jnp.float16)),
    "e4m3_token_d256_bs48_alibi": (jnp.float8_e4m3fn, "token", [3, 1], [100, 49], 48, 256, dict(alibi=True)),
    "e4m3_token_two_launches": (jnp.float8_e4m3fn, "token", [1, 40, 1], [700, 100, 300], 64, 64,
                                dict(window_size=(100, 0))),

}


@pytest.mark.parametrize("name", FP8)
def test_fp8_cache_matches_reference(name, rng):
    """FP8 pages widened to 16 bits in shared memory, the K scale on the raw scores, the V scale on the output (or
    per token: each key's on its score column, each value's on its row): the reference on the dequantised cache,
    within bf16 tolerance."""
    fmt, mode, q_lens, seq_lens, bs, d, kw = FP8[name]
    kw = dict(kw)
    dtype = kw.pop("dtype", BF16)
    q, kc, vc, bt, sl, cu = _inputs(rng, q_lens, seq_lens, bs, 4, 2, d, dtype)
    kc8, vc8, scales = _fp8_cache(rng, kc.astype(jnp.float32), vc.astype(jnp.float32), fmt, mode)
    kw = _features(rng, 4, kw)
    args = (q, kc8, vc8, bt, sl, cu)
    out, lse = paged_attention(*args, max_query_len=max(q_lens), return_lse=True, **scales, **kw, **MOSAIC)
    kw.pop("num_splits", None)
    ref_out, ref_lse = reference.paged_attention(*args, return_lse=True, **scales, **kw)
    n = int(sum(q_lens))
    assert_attention_close(out, ref_out, dtype=dtype, valid_rows=n)
    np.testing.assert_allclose(np.asarray(lse)[:n], np.asarray(ref_lse)[:n], rtol=1e-5, atol=1e-4)


def test_fp8_query_shift_is_per_token(rng):
    """Over an FP8 cache the kernel runs in fp16, each token's query shifted by its own power of two: a token past
    fp16's range (x 1e6) and one below its normal range (x 1e-6) still match the reference, and the other tokens'
    rows are bit-identical to a run without them."""
    q_lens, seq_lens = [1, 3, 1], [70, 130, 20]
    q, kc, vc, bt, sl, cu = _inputs(rng, q_lens, seq_lens, 16, 4, 2, 64, BF16)
    k_scale, v_scale = jnp.float32(0.03), jnp.float32(0.015)
    kc8 = reference.quantize_kv(kc, k_scale, jnp.float8_e4m3fn)
    vc8 = reference.quantize_kv(vc, v_scale, jnp.float8_e4m3fn)
    extreme = q.at[0].multiply(1e6).at[4].multiply(1e-6)
    run = functools.partial(paged_attention, k_scale=k_scale, v_scale=v_scale, max_query_len=3, **MOSAIC)
    out = run(extreme, kc8, vc8, bt, sl, cu)
    ref = reference.paged_attention(extreme, kc8, vc8, bt, sl, cu, k_scale=k_scale, v_scale=v_scale)
    for rows in ([0], [1, 2, 3], [4]):
        assert_attention_close(out[np.asarray(rows)], ref[np.asarray(rows)], dtype=BF16)
    plain = run(q, kc8, vc8, bt, sl, cu)
    np.testing.assert_array_equal(np.asarray(out[1:4], np.float32), np.asarray(plain[1:4], np.float32))


def test_per_token_scales_span_past_fp16(rng):
    """Per-token scales let one request's values sit near 1e-6 and another's near 1e6, below and past fp16's range,
    in which the kernel's query and keys meet: the value rows are widened with their own scales into bf16 (float32's
    range), so both requests match the reference, each to bf16 precision."""
    q_lens, seq_lens = [1, 4, 1], [70, 130, 20]
    q, kc, vc, bt, sl, cu = _inputs(rng, q_lens, seq_lens, 16, 4, 2, 64, BF16)
    size = np.ones((kc.shape[0], 1, 1, 1), np.float32)
    for b, s in ((0, 1e-6), (1, 1e6)):  # the request's pages
        size[np.asarray(bt[b])[: -(-seq_lens[b] // 16)]] = s
    kc8, vc8, scales = _fp8_cache(rng, kc.astype(jnp.float32), vc.astype(jnp.float32) * size, jnp.float8_e4m3fn,
                                  "token")
    out = paged_attention(q, kc8, vc8, bt, sl, cu, max_query_len=4, **scales, **MOSAIC)
    ref = reference.paged_attention(q, kc8, vc8, bt, sl, cu, **scales)
    for rows in ([0], [1, 2, 3, 4], [5]):
        assert_attention_close(out[np.asarray(rows)], ref[np.asarray(rows)], dtype=BF16)


def test_query_blocks_bound_every_batch():
    """The static block count covers the worst batch: every request one token past a block boundary."""
    for group, max_q in ((1, 1), (4, 8), (8, 5), (3, 30)):
        bq = mosaic_paged.query_block_tokens(max_q, group)
        assert bq * group <= mosaic_paged.BLOCK_M
        for num_seqs in (1, 5, 17):
            q_len = min(max_q, bq + 1)
            tokens = num_seqs * q_len
            need = num_seqs * -(-q_len // bq)
            assert mosaic_paged.num_query_blocks(tokens, num_seqs, bq) >= need


# programs loop over items: (scenario, programs). Two compute warpgroups (head dim 128) turn on across items with an
# odd tile count; splits, a window and a chunk beside decodes; FP8 pages in both scale modes
FEW_PROGRAMS = {
    "d128_two_wgs_odd_tiles": (SCENARIOS["chunk_gqa3_bs32_d128"], 2),
    "d128_splits_empty": (SCENARIOS["decode_mha_bs128_splits"], 3),
    "window_split_size_long": (SCENARIOS["window_split_size_long"], 2),
    "two_launches_short_split": (SCENARIOS["two_launches_short_split"], 3),
    "d256_mqa_fp16": (SCENARIOS["d256_mqa_fp16"], 1),
}


@pytest.mark.parametrize("name", FEW_PROGRAMS)
def test_few_programs_loop_over_items(name, rng, monkeypatch):
    """With fewer programs than items each program runs several, its K/V slots turning on from one item to the
    next (the memory warpgroup loads the next item's tiles while the last ones are computed): the reference still,
    every output row written."""
    scenario, programs = FEW_PROGRAMS[name]
    monkeypatch.setattr(mosaic_paged, "persistent_programs",
                        lambda num_items, head_dim, persistent: min(programs, num_items))
    _check_scenario(scenario, rng)


@pytest.mark.parametrize("mode, d", [("tensor", 128), ("token", 64)])
def test_few_programs_fp8(mode, d, rng, monkeypatch):
    """FP8 pages (each widened by the warpgroup that computes its tile) with two programs looping over items."""
    monkeypatch.setattr(mosaic_paged, "persistent_programs", lambda num_items, head_dim, persistent: min(2, num_items))
    q_lens, seq_lens = [1, 5, 1], [130, 70, 1]
    q, kc, vc, bt, sl, cu = _inputs(rng, q_lens, seq_lens, 16, 4, 2, d, BF16)
    kc8, vc8, scales = _fp8_cache(rng, kc.astype(jnp.float32), vc.astype(jnp.float32), jnp.float8_e4m3fn, mode)
    args = (q, kc8, vc8, bt, sl, cu)
    out = paged_attention(*args, max_query_len=5, num_splits=2, **scales, **MOSAIC)
    ref = reference.paged_attention(*args, **scales)
    assert_attention_close(out, ref, dtype=BF16, valid_rows=int(sum(q_lens)))


def test_item_order_deals_longest_first():
    """Every live item once, none twice; each program's items longest first; round 0 gives the longest items to
    programs 0, 1, ... and round 1 the next ones back from the last program (snake order); padding is -1."""
    from pallas_attn.core import masks

    seq_lens = jnp.asarray([64 * 9, 64 * 2 + 1, 64 * 5, 1, 64 * 7], jnp.int32)
    cu = jnp.arange(6, dtype=jnp.int32)  # one token each
    block_req = jnp.asarray([0, 1, 2, 3, 4, -1, -1], jnp.int32)
    block_first = jnp.zeros(7, jnp.int32)
    hkv, programs = 2, 4
    order = np.asarray(mosaic_paged.item_order(
        block_req, block_first, cu, seq_lens, num_kv_heads=hkv, num_programs=programs, block_q=1, capacity=1024,
        num_splits=1, split_size=None, mods=masks.NO_MODS))
    live = [p * hkv + h for p in range(5) for h in range(hkv)]
    assert sorted(order[order >= 0].tolist()) == live
    assert len(order) % programs == 0 and np.all(order[len(live):] == -1)
    tiles_of = {0: 9, 1: 3, 2: 5, 3: 1, 4: 7}
    cost = lambda it: tiles_of[it // hkv] if it >= 0 else -1  # noqa: E731
    rounds = order.reshape(-1, programs)
    assert [cost(it) for it in rounds[0]] == [9, 9, 7, 7]
    assert [cost(it) for it in rounds[1]] == [3, 3, 5, 5]  # back from the last program
    for g in range(programs):
        mine = [cost(it) for it in rounds[:, g]]
        assert mine == sorted(mine, reverse=True)
    # a program an item: the grid's order, query blocks fastest
    grid = np.asarray(mosaic_paged.item_order(
        block_req, block_first, cu, seq_lens, num_kv_heads=hkv, num_programs=14, block_q=1, capacity=1024,
        num_splits=1, split_size=None, mods=masks.NO_MODS))
    assert grid.tolist() == [p * hkv + h for h in range(hkv) for p in range(7)]


def test_persistent_at_head_dim_64_and_busy_128(monkeypatch):
    """Head dim 64 loops over items on at most two programs an SM; 128 on one an SM once its query blocks × KV
    heads give every SM an item; smaller 128 launches and 256 run a program an item."""
    monkeypatch.setattr(mosaic_paged.backend, "num_sms", lambda: 132)
    assert mosaic_paged.persistent(64, 8) and mosaic_paged.persistent(64, 7)
    assert mosaic_paged.persistent(128, 512)  # D1: 64 requests × 8 KV heads
    assert not mosaic_paged.persistent(128, 32)  # D2: 4 long requests, split to fill
    assert not mosaic_paged.persistent(256, 512)
    assert mosaic_paged.persistent_programs(10_000, 64, True) == 2 * 132
    assert mosaic_paged.persistent_programs(7, 64, True) == 7
    assert mosaic_paged.persistent_programs(10_000, 128, True) == 132
    assert mosaic_paged.persistent_programs(10_000, 128, False) == 10_000


def test_the_plan_decides_persistence_for_the_kernel(rng, monkeypatch):
    """Whether a launch's programs loop is decided once, by the plan that also decides its splits (looping programs
    take no tail-balance segments), and the kernel runs what the plan says: here the plan counts 2 requests × 2
    KV heads = 4 items, under the 6 SMs, where the kernel's static bound on the query blocks of 4 tokens would count
    (8 + 2·3) / 4 = 3 blocks × 2 KV heads = 6."""
    from pallas_attn.core import masks
    from pallas_attn.ops import paged as paged_op

    monkeypatch.setattr(mosaic_paged.backend, "num_sms", lambda: 6)
    seen = []
    programs = mosaic_paged.persistent_programs
    monkeypatch.setattr(mosaic_paged, "persistent_programs",
                        lambda num_items, head_dim, persistent: seen.append(persistent) or
                        programs(num_items, head_dim, persistent))
    q_lens, seq_lens = [4, 4], [70, 197]
    q, kc, vc, bt, sl, cu = _inputs(rng, q_lens, seq_lens, 16, 4, 2, 128, BF16, pad=0)
    plan, short_plan = paged_op.mosaic_plan(q, kc, bt, masks.NO_MODS, max_query_len=4, num_splits=None,
                                            split_size=None)
    assert short_plan is None and not plan.persistent
    out = paged_attention(q, kc, vc, bt, sl, cu, max_query_len=4, **MOSAIC)
    assert seen == [False]
    ref = reference.paged_attention(q, kc, vc, bt, sl, cu)
    assert_attention_close(out, ref, dtype=BF16, valid_rows=sum(q_lens))


@pytest.mark.gpu
@pytest.mark.parametrize("bs, hq, hkv, d", [(16, 32, 8, 128), (64, 8, 1, 128), (16, 16, 8, 256), (32, 64, 8, 64)])
def test_long_mixed_compiled(bs, hq, hkv, d, rng):
    """Model shapes at serving lengths, compiled: Llama-3.1-8B, a TP-8 shard of Llama-3.1-70B, Gemma-3, gpt-oss;
    decodes, verifications and a chunk over contexts of thousands of keys, split and unsplit."""
    q_lens, seq_lens = [1, 6, 1, 300, 1], [4097, 2000, 63, 5000, 1]
    args = _inputs(rng, q_lens, seq_lens, bs, hq, hkv, d, BF16)
    ref = reference.paged_attention(*args)
    for kw in ({}, dict(num_splits=4), dict(split_size=1024)):
        out = paged_attention(*args, max_query_len=300, **kw, **MOSAIC)
        assert_attention_close(out, ref, dtype=BF16, valid_rows=sum(q_lens))
