"""paged_decode_attention and merge_attention_states against the reference, through shuffled, poisoned pages."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_attn import DecodeConfig, merge_attention_states, paged_decode_attention, reference
from pallas_attn.core import config as config_lib
from pallas_attn.ops import decode as decode_ops
from pallas_attn.testing import assert_attention_close, make_paged_kv

SMALL = DecodeConfig(block_n=16)

# name: (seq_lens, block_size, num_q_heads, num_kv_heads, head_dim, dtype, split kwargs)
SCENARIOS = {
    "edges_bs16_single": ([1, 0, 15, 16, 17, 80], 16, 4, 4, 64, jnp.float32, dict(num_splits=1)),
    "edges_bs16_splits3": ([1, 0, 15, 16, 17, 80], 16, 4, 4, 64, jnp.float32, dict(num_splits=3)),
    "gqa4_heuristic": ([33, 2, 100], 16, 8, 2, 64, jnp.float32, dict()),
    "gqa8_bs1": ([5, 40, 1], 1, 8, 1, 64, jnp.float32, dict(num_splits=2)),
    "bs64_long": ([300, 63, 65], 64, 4, 2, 128, jnp.bfloat16, dict()),
    "bs256": ([257, 3], 256, 2, 1, 64, jnp.float16, dict(num_splits=2)),
    "d80_split_size": ([70, 17, 0], 8, 4, 1, 80, jnp.float32, dict(split_size=32)),
    "d256": ([40, 9], 16, 2, 2, 256, jnp.bfloat16, dict(num_splits=1)),
    "gqa6": ([30, 31], 16, 12, 2, 96, jnp.float32, dict(num_splits=2)),
    # head dims up to 512 and pages of any multiple of 16: 32- and 64-key tiles straddle pages of 48 and 544
    "d80_bs48_splits3": ([50, 47, 1, 97], 48, 4, 2, 80, jnp.float32, dict(num_splits=3, config=DecodeConfig(32))),
    "d96_bs32_split_size": ([33, 64, 7], 32, 4, 1, 96, jnp.float32, dict(split_size=32)),
    "d320_bs48": ([49, 3, 0, 96], 48, 4, 2, 320, jnp.float32, dict(num_splits=2)),
    "d512_bs544_bf16": ([600, 1, 545], 544, 2, 1, 512, jnp.bfloat16, dict(config=DecodeConfig(64))),
    "d512_bs16_default_config": ([40, 17], 16, 2, 2, 512, jnp.float32, dict(config=None, num_splits=2)),
    "d320_bs544_default_config_bf16": ([560, 30], 544, 4, 2, 320, jnp.bfloat16, dict(config=None)),
}


def _inputs(rng, ctx, bs, hq, hkv, d, dtype, poison=float("nan")):
    k_cache, v_cache, tables = make_paged_kv(rng, ctx, bs, hkv, d, dtype, poison=poison)
    q = jnp.asarray(rng.standard_normal((len(ctx), hq, d), np.float32), dtype)
    return q, k_cache, v_cache, tables, jnp.asarray(ctx, jnp.int32)


@pytest.mark.parametrize("name", SCENARIOS)
def test_matches_reference(name, rng):
    ctx, bs, hq, hkv, d, dtype, split = SCENARIOS[name]
    q, kc, vc, bt, cl = _inputs(rng, ctx, bs, hq, hkv, d, dtype)
    out, lse = paged_decode_attention(q, kc, vc, bt, cl, return_lse=True, **{"config": SMALL, **split})
    ref_out, ref_lse = reference.paged_decode_attention(q, kc, vc, bt, cl, return_lse=True)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert_attention_close(out, ref_out, dtype=dtype)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), rtol=1e-5, atol=1e-4)
    empty = np.asarray(ctx) == 0
    assert np.all(np.asarray(out, np.float32)[empty] == 0) and np.all(np.asarray(lse)[empty] == -np.inf)


@pytest.mark.parametrize("poison", [float("nan"), 1e30, -1e30])
def test_isolation_under_poison(poison, rng):
    """Every slot a request does not own holds poison; outputs equal the NaN-poisoned run and are finite."""
    ctx = [17, 1, 40]
    seed = int(rng.integers(1 << 30))
    runs = []
    for p in (float("nan"), poison):
        q, kc, vc, bt, cl = _inputs(np.random.default_rng(seed), ctx, 16, 4, 2, 64, jnp.float32, poison=p)
        runs.append(np.asarray(paged_decode_attention(q, kc, vc, bt, cl, num_splits=2, config=SMALL)))
    assert np.all(np.isfinite(runs[1]))
    np.testing.assert_array_equal(runs[0], runs[1])


def test_splits_agree(rng):
    q, kc, vc, bt, cl = _inputs(rng, [200, 3, 77], 16, 8, 2, 64, jnp.float32)
    outs = [np.asarray(paged_decode_attention(q, kc, vc, bt, cl, config=SMALL, **kw))
            for kw in (dict(num_splits=1), dict(num_splits=5), dict(split_size=32), dict())]
    for o in outs[1:]:
        np.testing.assert_allclose(o, outs[0], rtol=2e-5, atol=2e-6)


def test_batch_invariance_fixed_split_size(rng):
    """With split_size fixed, request 0's output is bit-identical alone, in a larger batch, or moved."""
    ctx = [150, 7, 64, 1, 99]
    q, kc, vc, bt, cl = _inputs(rng, ctx, 16, 8, 2, 64, jnp.bfloat16)
    run = lambda q, bt, cl: np.asarray(paged_decode_attention(q, kc, vc, bt, cl, split_size=32, config=SMALL),
                                       np.float32)
    full = run(q, bt, cl)
    alone = run(q[:1], bt[:1], cl[:1])
    perm = np.array([3, 1, 0, 4, 2])
    moved = run(q[perm], bt[perm], cl[perm])
    np.testing.assert_array_equal(full[0], alone[0])
    np.testing.assert_array_equal(full[0], moved[2])
    wider = jnp.concatenate([bt, jnp.full((5, 4), -1, jnp.int32)], axis=1)  # more (empty) splits
    np.testing.assert_array_equal(full, run(q, wider, cl))


def test_merge_attention_states_empty_splits(rng):
    outs = jnp.asarray(rng.standard_normal((3, 4, 2, 8)), jnp.float32)
    lses = jnp.asarray(rng.standard_normal((3, 4, 2)), jnp.float32)
    lses = lses.at[1].set(-jnp.inf).at[:, 0].set(-jnp.inf)  # split 1 empty everywhere, row 0 empty in all splits
    outs = outs.at[1].set(jnp.nan)
    out, lse = merge_attention_states(outs, lses)
    ref_out, ref_lse = reference.merge_attention_states(outs, lses)
    assert np.all(np.isfinite(np.asarray(out)))
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(lse)[0], -np.inf)
    np.testing.assert_allclose(np.asarray(lse)[1:], np.asarray(ref_lse)[1:], rtol=1e-6)


@pytest.mark.parametrize("kw, match", [
    (dict(num_splits=2, split_size=32), "not both"),
    (dict(split_size=24), "multiple of the KV tile"),
    (dict(ctx_dtype=jnp.int16), "seq_lens must be int32"),
    (dict(bs=3), "block_size=3"),
])
def test_bad_input_raises(kw, match):
    bs = kw.pop("bs", 16)
    q = jnp.ones((2, 4, 64), jnp.float32)
    kc = jnp.ones((4, bs, 2, 64), jnp.float32)
    bt = jnp.zeros((2, 2), jnp.int32)
    cl = jnp.ones((2,), kw.pop("ctx_dtype", jnp.int32))
    with pytest.raises((ValueError, TypeError), match=match):
        paged_decode_attention(q, kc, kc, bt, cl, config=SMALL, **kw)


def test_context_lens_alias(rng, monkeypatch):
    """``context_lens=``, the former name of ``seq_lens``, works for one release: it warns (naming ``seq_lens``), gives
    the identical output and reuses the program compiled for positional calls; giving both raises."""
    traced = []
    validate = decode_ops._validate  # runs once per trace, never per call
    monkeypatch.setattr(decode_ops, "_validate", lambda *args: traced.append(1) or validate(*args))
    q, kc, vc, bt, lens = _inputs(rng, [33, 0, 7], 16, 4, 2, 64, jnp.float32)
    want = np.asarray(paged_decode_attention(q, kc, vc, bt, lens, num_splits=2, config=SMALL))
    traces = len(traced)
    with pytest.warns(DeprecationWarning, match="context_lens= is deprecated, pass seq_lens="):
        got = np.asarray(paged_decode_attention(q, kc, vc, bt, context_lens=lens, num_splits=2, config=SMALL))
    np.testing.assert_array_equal(got, want)
    assert len(traced) == traces  # no new trace, no recompile
    for both in (dict(seq_lens=lens, context_lens=lens), dict(context_lens=lens)):
        args = (q, kc, vc, bt) if "seq_lens" in both else (q, kc, vc, bt, lens)
        with pytest.raises(TypeError, match="got both seq_lens and its deprecated alias context_lens="):
            paged_decode_attention(*args, **both)
    with pytest.warns(DeprecationWarning, match="pass seq_lens="):
        ref = reference.paged_decode_attention(q, kc, vc, bt, context_lens=lens)
    np.testing.assert_array_equal(ref, reference.paged_decode_attention(q, kc, vc, bt, lens))
    with pytest.raises(TypeError, match="got both seq_lens and its deprecated alias context_lens="):
        reference.paged_decode_attention(q, kc, vc, bt, lens, context_lens=lens)


@pytest.mark.gpu
def test_long_context_compiled(rng):
    ctx = [20000, 3, 9000, 1]
    q, kc, vc, bt, cl = _inputs(rng, ctx, 16, 32, 8, 128, jnp.bfloat16)
    for kw in (dict(), dict(num_splits=1), dict(split_size=512)):
        out = paged_decode_attention(q, kc, vc, bt, cl, **kw)
        assert_attention_close(out, reference.paged_decode_attention(q, kc, vc, bt, cl), dtype=jnp.bfloat16)


@pytest.mark.parametrize("programs, capacity, want", [
    (512, 8192, (4, 2048)),  # D1: 64 requests x 8 KV heads, 1k..8k keys: long tail, 2048-key segments
    (512, 1024, (1, None)),  # 64 short contexts: segments would be below 2048 keys
    (2048, 1024, (1, None)),  # many short programs: one segment already covers the capacity
    (32, 131072, None),  # D2: too few programs, the fill-the-GPU rule decides (several splits)
])
def test_split_heuristic(programs, capacity, want):
    splits, size = config_lib.resolve_splits(programs, capacity, 64, None, None)
    if want is not None:
        assert (splits, size) == want
    else:
        assert splits > 1 and size % 64 == 0 and splits * size >= capacity


@pytest.mark.parametrize("programs, capacity, plain, pow2", [
    (32, 131072, (17, 7744), (16, 8192)),  # D2: 272 programs with keys (three waves of 132) become 256 (two)
    (256, 16384, (3, 5504), (4, 4096)),  # V1: the nearest power of two, below
    (64, 32768, (9, 3648), (8, 4096)),  # a TP-8 shard of 64 requests
    (512, 8192, (4, 2048), (4, 2048)),  # D1: the tail balance's segments, powers of two already
    (1, 200_000, (64, 3136), (49, 4096)),  # 2**round(log2(3136)) = 4096; never more than 64 segments
    (1, 100_000, (63, 1600), (49, 2048)),  # 1600 -> 2048 (log2 10.64)
])
def test_split_heuristic_pow2_segments(programs, capacity, plain, pow2, monkeypatch):
    """The Mosaic paged kernel's plan (one program an SM): the heuristic's segments rounded to the nearest power of
    two, still covering the capacity, a multiple of the tile, at most 64 segments."""
    monkeypatch.setattr(config_lib.backend, "num_sms", lambda: 132)
    assert config_lib.resolve_splits(programs, capacity, 64, None, None) == plain
    splits, size = config_lib.resolve_splits(programs, capacity, 64, None, None, pow2_segments=True)
    assert (splits, size) == pow2
    assert size % 64 == 0 and size & (size - 1) == 0 and splits * size >= capacity and splits <= 64
