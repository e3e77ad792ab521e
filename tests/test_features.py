"""Model-family features in the kernels (window, soft-cap, ALiBi, sinks) against the reference
(docs/design.md#model-family-features). Keys outside every window hold NaN: a tile that is loaded when it should
not be, or a mask that leaks, turns the output NaN."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_attn import (
    DecodeConfig,
    PrefillConfig,
    merge_attention_states,
    paged_attention,
    paged_decode_attention,
    reference,
    varlen_attention,
)
from pallas_attn.core import masks
from pallas_attn.testing import assert_attention_close, make_paged_kv, random_packed

CFG = PrefillConfig(block_m=16, block_n=16)
LENS = [40, 1, 17, 16, 33]  # a request of one token, one of exactly a tile, tile ± 1, several tiles


def _inputs(rng, lens=LENS, hq=4, hkv=2, d=32, pad=5, dtype=jnp.float32):
    total = sum(lens) + pad
    q, cu = random_packed(rng, lens, hq, d, dtype, pad_to=total)
    k, _ = random_packed(rng, lens, hkv, d, dtype, pad_to=total)
    v, _ = random_packed(rng, lens, hkv, d, dtype, pad_to=total)
    return q, k, v, cu


def _heads(rng, low, high, n=4):
    return jnp.asarray(rng.uniform(low, high, n), jnp.float32)


def _check(q, k, v, cu, dtype=jnp.float32, **kw):
    out, lse = varlen_attention(q, k, v, cu, max_seqlen=64, config=CFG, return_lse=True, **kw)
    ref, ref_lse = reference.varlen_attention(q, k, v, cu, return_lse=True, **kw)
    n = int(cu[-1])
    assert_attention_close(out, ref, dtype=dtype, valid_rows=n)
    np.testing.assert_array_equal(np.isneginf(np.asarray(lse)), np.isneginf(np.asarray(ref_lse)))
    finite = np.isfinite(np.asarray(ref_lse))
    np.testing.assert_allclose(np.asarray(lse)[finite], np.asarray(ref_lse)[finite], rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(out)[n:] == 0)
    return out


@pytest.mark.parametrize("window", [(0, -1), (1, -1), (15, -1), (16, -1), (17, -1), (100, -1)])
def test_causal_window(rng, window):
    _check(*_inputs(rng), window_size=window)


@pytest.mark.parametrize("window", [(0, 0), (3, 7), (-1, 5), (20, -1)])
def test_bidirectional_window(rng, window):
    _check(*_inputs(rng), causal=False, window_size=window)


def test_keys_outside_the_window_are_never_read(rng):
    """NaN in every key and value a window leaves behind: the output stays finite and right."""
    lens = [70]
    q, k, v, cu = _inputs(rng, lens, pad=0)
    left = 5
    out = varlen_attention(q, k, v, cu, max_seqlen=70, config=CFG, window_size=(left, -1))
    # Query rows 48..69 (the last tiles) see keys from 43 on; poison keys 0..31 (tiles wholly outside their windows)
    k2, v2 = k.at[:32].set(jnp.nan), v.at[:32].set(jnp.nan)
    out2 = varlen_attention(q, k2, v2, cu, max_seqlen=70, config=CFG, window_size=(left, -1))
    np.testing.assert_array_equal(np.asarray(out2)[48:], np.asarray(out)[48:])


@pytest.mark.parametrize("causal, window", [(True, (5, -1)), (False, (5, 3))])
def test_keys_outside_every_window_hold_nan(rng, causal, window):
    """NaN in the keys no row of a query tile sees, partial tiles included: the output does not change."""
    q, k, v, cu = _inputs(rng, [70], pad=0)
    kw = dict(max_seqlen=70, config=CFG, causal=causal, window_size=window)
    out = varlen_attention(q, k, v, cu, **kw)
    # rows 48..63 (one query tile) see keys 43..63 (+3 past the tile without causality); keys 0..42 and 67.. are
    # outside every one of their windows, including keys 32..42 of a tile they load
    outside = np.r_[0:43, 67:70] if not causal else np.r_[0:43]
    out2 = varlen_attention(q, k.at[outside].set(jnp.nan), v.at[outside].set(jnp.nan), cu, **kw)
    np.testing.assert_array_equal(np.asarray(out2)[48:64], np.asarray(out)[48:64])


@pytest.mark.parametrize("softcap", [1.0, 30.0])
def test_softcap(rng, softcap):
    _check(*_inputs(rng), softcap=softcap)


def test_softcap_huge_logits(rng):
    q, k, v, cu = _inputs(rng)
    out = _check(q * 1e3, k, v, cu, softcap=5.0)
    assert not np.isnan(np.asarray(out)).any()


@pytest.mark.parametrize("causal", [True, False])
def test_alibi_gqa(rng, causal):
    q, k, v, cu = _inputs(rng, hq=8, hkv=2)
    _check(q, k, v, cu, causal=causal, alibi_slopes=_heads(rng, 0.01, 0.5, 8))


@pytest.mark.parametrize("low, high", [(-1e4, -1e4 + 1), (-2, 2), (50, 60)])
def test_sinks(rng, low, high):
    _check(*_inputs(rng), sinks=_heads(rng, low, high))


def test_everything_at_once_bf16(rng):
    q, k, v, cu = _inputs(rng, hq=8, hkv=2, d=64, dtype=jnp.bfloat16)
    _check(q, k, v, cu, dtype=jnp.bfloat16, window_size=(9, -1), softcap=20.0,
           alibi_slopes=_heads(rng, 0.01, 0.2, 8), sinks=_heads(rng, -1, 1, 8))


def test_everything_at_once_wide_heads(rng):
    q, k, v, cu = _inputs(rng, hq=4, hkv=2, d=320)
    _check(q, k, v, cu, window_size=(9, -1), softcap=20.0, alibi_slopes=_heads(rng, 0.01, 0.2, 4),
           sinks=_heads(rng, -1, 1, 4))


@pytest.mark.parametrize("kw, error, match", [
    (dict(window_size=(-2, 0)), TypeError, "window_size"),
    (dict(window_size=5), TypeError, "window_size"),
    (dict(softcap=-1.0), ValueError, "softcap"),
    (dict(softcap=float("inf")), ValueError, "softcap"),
    (dict(sinks=jnp.zeros(3)), ValueError, "sinks"),
    (dict(alibi_slopes=jnp.zeros((4, 1))), ValueError, "alibi_slopes"),
    (dict(window_size=(4, -1), backend="mosaic"), ValueError, "float32"),  # features or not: bf16 / fp16 only
])
def test_bad_feature_arguments_raise(rng, kw, error, match):
    q, k, v, cu = _inputs(rng)
    with pytest.raises(error, match=match):
        varlen_attention(q, k, v, cu, max_seqlen=64, **kw)


# ------------------------------------------------------------------------------------------------ paged decode
DECODE_LENS = [70, 1, 33, 16, 0, 17]


def _decode_inputs(rng, hq=8, hkv=2, d=32, block_size=8):
    kc, vc, bt = make_paged_kv(rng, DECODE_LENS, block_size, hkv, d, jnp.float32, max_blocks=10, table_padding="neg")
    q = jnp.asarray(rng.standard_normal((len(DECODE_LENS), hq, d)), jnp.float32)
    return q, kc, vc, bt, jnp.asarray(DECODE_LENS, jnp.int32)


def _check_decode(args, split, **kw):
    out, lse = paged_decode_attention(*args, config=DecodeConfig(block_n=16), return_lse=True, **split, **kw)
    ref, ref_lse = reference.paged_decode_attention(*args, return_lse=True, **kw)
    assert_attention_close(out, ref)
    np.testing.assert_array_equal(np.isneginf(np.asarray(lse)), np.isneginf(np.asarray(ref_lse)))
    finite = np.isfinite(np.asarray(ref_lse))
    np.testing.assert_allclose(np.asarray(lse)[finite], np.asarray(ref_lse)[finite], rtol=1e-5, atol=1e-5)


def _paged_features(rng, kw):
    """A case's keywords for 8 query heads: a dict as given, or "alibi" / "sinks" / "all" with fresh per-head
    arrays."""
    if kw == "alibi":
        return dict(alibi_slopes=_heads(rng, 0.01, 0.3, 8))
    if kw == "sinks":
        return dict(sinks=_heads(rng, -2, 2, 8))
    if kw == "all":
        return dict(window_size=(20, -1), softcap=3.0, alibi_slopes=_heads(rng, 0.01, 0.3, 8),
                    sinks=_heads(rng, -1, 1, 8))
    return kw


# split-KV: none, 3 segments of each request's (windowed) tiles, fixed 16-key segments counted from the window's
# first tile (a 70-key context holds more of them than its window needs)
SPLITS = {"no-split": dict(num_splits=1), "split3": dict(num_splits=3), "split-size16": dict(split_size=16)}


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("kw", [
    dict(window_size=(0, -1)), dict(window_size=(15, -1)), dict(window_size=(16, -1)), dict(window_size=(17, -1)),
    dict(window_size=(500, -1)), dict(softcap=2.0), "alibi", "sinks", "all",
], ids=["w0", "w15", "w16", "w17", "w500", "softcap", "alibi", "sinks", "all"])
def test_decode_features(rng, kw, split):
    args = _decode_inputs(rng)
    kw = _paged_features(rng, kw)
    _check_decode(args, SPLITS[split], **kw)


@pytest.mark.parametrize("split", ["no-split", "split3"])
@pytest.mark.parametrize("head_dim, block_size", [(320, 48), (512, 16)])
def test_decode_features_wide_heads_and_pages(rng, head_dim, block_size, split):
    """Every feature at once with heads padded to 512 and pages of 48 (16-key tiles inside a page, a window edge
    inside a page)."""
    args = _decode_inputs(rng, d=head_dim, block_size=block_size)
    _check_decode(args, SPLITS[split], window_size=(20, -1), softcap=3.0, alibi_slopes=_heads(rng, 0.01, 0.3, 8),
                  sinks=_heads(rng, -1, 1, 8))


@pytest.mark.parametrize("block_n, split_size", [(16, 16), (16, 32), (64, 64)])
@pytest.mark.parametrize("block_tokens", [1, 6, 16])
@pytest.mark.parametrize("left", [0, 1, 15, 16, 17, 100])
def test_fixed_split_segments_cover_the_window(block_n, split_size, block_tokens, left):
    """Fixed split segments start at a query block's first window tile, and the static segment count
    (``keys_read``) covers every tile the unsplit plan reads, each once, wherever the block sits."""
    from pallas_attn.core import tiles
    from pallas_attn.ops.paged import keys_read

    mods = masks.ScoreMods(left, 0, 0.0, False, False)
    table, cache = np.zeros((1, 512)), np.zeros((1, 16, 1, 1))  # a capacity of 8,192 keys
    num_splits = -(-keys_read(table, cache, mods, block_tokens, block_n) // split_size)
    q_first = jnp.arange(0, 700, dtype=jnp.int32)
    q_last = q_first + block_tokens - 1
    kv_len = q_last + 1

    def tiles_read(split, splits, size):
        start, _, _, end, _ = tiles.paged_tile_plan(q_first, q_last, kv_len, block_n, split, splits, size, mods,
                                                    guarded=False)
        return np.asarray(start), np.asarray(end)

    start, end = tiles_read(0, 1, None)
    covered = np.zeros_like(start)
    for split in range(num_splits):
        s, e = tiles_read(split, num_splits, split_size)
        seen = np.maximum(e - s, 0)
        assert np.all((seen == 0) | ((s >= start) & (e <= end)))
        covered += seen
    np.testing.assert_array_equal(covered, end - start)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_decode_window_reads_no_expired_page(rng, num_splits):
    """Pages wholly before the query's window may be freed already: their table entries (-1 or a NaN page) are
    never read, and the request still runs unguarded."""
    q, kc, vc, bt, sl = _decode_inputs(rng)
    kw = dict(window_size=(9, -1))
    clean = paged_decode_attention(q, kc, vc, bt, sl, num_splits=num_splits, **kw)
    # request 0 (70 keys, query at 69) sees keys 60..69: pages 0..6 (keys 0..55) are outside its window
    bt2 = bt.at[0, :3].set(-1).at[0, 3:7].set(kc.shape[0] + 5)
    out = paged_decode_attention(q, kc, vc, bt2, sl, num_splits=num_splits, **kw)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(clean))
    # and NaN in keys 56..59, the slots of page 7 before the window
    kc2, vc2 = (x.at[int(bt[0, 7]), :4].set(jnp.nan) for x in (kc, vc))
    out = paged_decode_attention(q, kc2, vc2, bt2, sl, num_splits=num_splits, **kw)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(clean))


def test_merge_applies_the_sink_once(rng):
    outs = jnp.asarray(rng.standard_normal((3, 5, 4, 16)), jnp.float32)
    lses = jnp.asarray(rng.standard_normal((3, 5, 4)), jnp.float32).at[1, 2].set(-jnp.inf)
    sinks = _heads(rng, -1, 1)
    got = merge_attention_states(outs, lses, sinks=sinks)
    want = reference.merge_attention_states(outs, lses, sinks=sinks)
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), rtol=1e-6)
    with pytest.raises(ValueError, match="sinks"):
        merge_attention_states(outs, lses, sinks=jnp.zeros(5))


# ------------------------------------------------------------------------------------------ ragged paged attention
# (q_len, context): decode, decode on an empty context, verification, a chunk over a prefix, a fresh prefill, an
# idle request; tile (16) ± 1 both ways
RAGGED = [(1, 69), (1, 0), (6, 40), (17, 31), (33, 0), (0, 12), (16, 16)]


def _ragged_inputs(rng, hq=8, hkv=2, d=32, block_size=8, requests=RAGGED):
    q_lens = [n for n, _ in requests]
    seq_lens = [n + c for n, c in requests]
    kc, vc, bt = make_paged_kv(rng, seq_lens, block_size, hkv, d, jnp.float32, table_padding="neg")
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    q = jnp.asarray(rng.standard_normal((int(cu[-1]) + 3, hq, d)), jnp.float32)  # 3 padding rows
    return q, kc, vc, bt, jnp.asarray(seq_lens, jnp.int32), cu


def _check_ragged(args, **kw):
    q, *_, cu = args
    out, lse = paged_attention(*args, max_query_len=33, return_lse=True, **kw)
    ref, ref_lse = reference.paged_attention(*args, return_lse=True,
                                             **{k: v for k, v in kw.items() if k not in ("config", "chunk_config")})
    n = int(cu[-1])
    assert_attention_close(out, ref, valid_rows=n)
    np.testing.assert_array_equal(np.isneginf(np.asarray(lse)[:n]), np.isneginf(np.asarray(ref_lse)[:n]))
    finite = np.isfinite(np.asarray(ref_lse)[:n])
    np.testing.assert_allclose(np.asarray(lse)[:n][finite], np.asarray(ref_lse)[:n][finite], rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(out)[n:] == 0) and np.all(np.isneginf(np.asarray(lse)[n:]))


# one launch with 16-key tiles; two launches (chunks apart) with or without splits, the short launch's split
# partials merged in the chunk launch (compact) or everything split and merged after
RAGGED_PLANS = {
    "one-launch": dict(config=DecodeConfig(block_n=16, block_q=4)),
    "two-launches": dict(config=DecodeConfig(block_n=16), chunk_config=DecodeConfig(block_n=16, block_q=16)),
    "split3": dict(config=DecodeConfig(block_n=16, block_q=4), num_splits=3),
    "two-launches-split2": dict(config=DecodeConfig(block_n=16), chunk_config=DecodeConfig(block_n=16, block_q=16),
                                num_splits=2),
    "split-size16": dict(config=DecodeConfig(block_n=16, block_q=4), split_size=16),
    "two-launches-split-size32": dict(config=DecodeConfig(block_n=16),
                                      chunk_config=DecodeConfig(block_n=16, block_q=16), split_size=32),
}


def _cases(kws, plans):
    return [pytest.param(kw, plan, id=f"{name}-{plan}") for name, kw in kws.items() for plan in plans]


WINDOWS = {f"w{l}" + (f"-{r}" if r >= 0 else ""): dict(window_size=(l, r))
           for l, r in [(0, -1), (15, -1), (16, -1), (17, -1), (500, -1), (4, 2)]}


@pytest.mark.parametrize("kw, plan", _cases(WINDOWS, ["one-launch", "two-launches-split2", "split-size16",
                                                     "two-launches-split-size32"])
                         + _cases(dict(softcap=dict(softcap=2.0), alibi="alibi"), ["two-launches"])
                         + _cases(dict(sinks="sinks"), list(RAGGED_PLANS))
                         + _cases(dict(all="all"), ["two-launches", "split3"]))
def test_ragged_features(rng, kw, plan):
    args = _ragged_inputs(rng)
    kw = _paged_features(rng, kw)
    _check_ragged(args, **kw, **RAGGED_PLANS[plan])


def test_ragged_compact_split_merge_applies_the_sink_once(rng):
    """Decodes split on their own (compact partials, merged by the chunk launch's programs) next to a chunk."""
    args = _ragged_inputs(rng, requests=[(1, 150), (1, 90), (40, 8)])
    from pallas_attn.kernels.triton import paged as triton_paged
    q, kc, vc, bt, sl, cu = args
    cfg, chunk_cfg = DecodeConfig(block_n=16), DecodeConfig(block_n=16, block_q=16)
    sinks = _heads(rng, -1, 1, 8)
    out, _ = triton_paged.ragged_paged_triton(q, kc, vc, bt, sl, cu, None, sinks, max_query_len=40,
                                              scale=32 ** -0.5, num_splits=1, split_size=None, interpret=True,
                                              cfg=cfg, chunk_cfg=chunk_cfg, short_splits=(3, None),
                                              mods=masks.ScoreMods(sinks=True))
    ref = reference.paged_attention(*args, sinks=sinks)
    assert_attention_close(out, ref, valid_rows=int(cu[-1]))


@pytest.mark.parametrize("plan", ["one-launch", "split3"])
def test_ragged_window_reads_no_expired_page(rng, plan):
    """Pages wholly before a request's first query's window may be freed: never read, the request unguarded."""
    args = _ragged_inputs(rng, requests=[(6, 64), (1, 20)])
    q, kc, vc, bt, sl, cu = args
    kw = dict(window_size=(9, -1), **RAGGED_PLANS[plan])
    clean = paged_attention(*args, max_query_len=8, **kw)
    # request 0: 70 keys, first query at 64 sees keys from 55 on: pages 0..5 (keys 0..47) are outside every window
    bt2 = bt.at[0, :3].set(-1).at[0, 3:6].set(kc.shape[0] + 5)
    out = paged_attention(q, kc, vc, bt2, sl, cu, max_query_len=8, **kw)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(clean))


def test_ragged_keys_outside_the_window_hold_nan(rng):
    """NaN in the pages a window leaves behind (still named by the table): the outputs do not change."""
    args = _ragged_inputs(rng, requests=[(17, 64), (1, 40)])
    q, kc, vc, bt, sl, cu = args
    kw = dict(window_size=(7, -1), config=DecodeConfig(block_n=16, block_q=4))
    clean = paged_attention(*args, max_query_len=17, **kw)
    # request 0's first query sits at 64 and sees keys from 57 on: its pages 0..6 (keys 0..55) lie before it
    pages, edge = np.asarray(bt)[0, :7], int(bt[0, 7])  # and key 56, the first slot of page 7
    kc2, vc2 = (x.at[pages].set(jnp.nan).at[edge, 0].set(jnp.nan) for x in (kc, vc))
    out = paged_attention(q, kc2, vc2, bt, sl, cu, max_query_len=17, **kw)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(clean))
