"""paged_attention (ragged: decode / verification / chunked prefill / prefill in one launch) against the reference,
plus a decode loop through build_metadata and write_kv_cache."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_attn import (
    DecodeConfig,
    allocate_kv_cache,
    build_metadata,
    paged_attention,
    paged_decode_attention,
    reference,
    write_kv_cache,
)
from pallas_attn.core import config
from pallas_attn.kernels.triton import paged
from pallas_attn.testing import assert_attention_close, make_paged_kv

SMALL = DecodeConfig(block_n=16)

# name: (query_lens, seq_lens) per request.
BATCHES = {
    "decode_only": ([1, 1, 1, 1], [1, 17, 64, 100]),
    "verify_only": ([6, 6, 6], [6, 40, 97]),
    "chunked_prefill": ([20, 33], [52, 120]),
    "prefill_only": ([17, 1, 40], [17, 1, 40]),
    "mixed": ([1, 6, 0, 24, 30, 1], [50, 70, 9, 24, 90, 1]),
}
# name: (block_size, num_q_heads, num_kv_heads, head_dim, dtype)
LAYOUTS = {
    "bs16_gqa4": (16, 8, 2, 64, jnp.float32),
    "bs32_mha": (32, 2, 2, 64, jnp.float32),
    "bs64_gqa8_bf16": (64, 8, 1, 128, jnp.bfloat16),
}


def _inputs(rng, q_lens, seq_lens, bs, hq, hkv, d, dtype, pad=5, poison=float("nan")):
    k_cache, v_cache, tables = make_paged_kv(rng, seq_lens, bs, hkv, d, dtype, poison=poison)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = np.full((cu[-1] + pad, hq, d), np.nan, np.float32)
    q[: cu[-1]] = rng.standard_normal((cu[-1], hq, d))
    return jnp.asarray(q, dtype), k_cache, v_cache, tables, jnp.asarray(seq_lens, jnp.int32), jnp.asarray(cu)


def _check(out, lse, args, dtype, q_lens):
    q, kc, vc, bt, sl, cu = args
    ref_out, ref_lse = reference.paged_attention(q, kc, vc, bt, sl, cu, return_lse=True)
    n = int(sum(q_lens))
    assert_attention_close(out, ref_out, dtype=dtype, valid_rows=n)
    np.testing.assert_allclose(np.asarray(lse)[:n], np.asarray(ref_lse)[:n], rtol=1e-5, atol=1e-4)
    assert np.all(np.asarray(out, np.float32)[n:] == 0) and np.all(np.asarray(lse)[n:] == -np.inf)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("batch", BATCHES)
def test_matches_reference(batch, layout, rng):
    q_lens, seq_lens = BATCHES[batch]
    bs, hq, hkv, d, dtype = LAYOUTS[layout]
    args = _inputs(rng, q_lens, seq_lens, bs, hq, hkv, d, dtype)
    splits = dict(num_splits=1) if layout == "bs32_mha" else dict(num_splits=3)
    out, lse = paged_attention(*args, max_query_len=max(q_lens), return_lse=True, config=SMALL, **splits)
    _check(out, lse, args, dtype, q_lens)


# Head dims up to 512 and pages of any multiple of 16. name: (batch, layout, config, chunk_config, split kwargs);
# None: the defaults (heads padded to 512: their own tiles). 32-key tiles straddle pages of 48.
WIDENED = {
    "d80_bs48_mixed": ("mixed", (48, 4, 2, 80, jnp.float32), DecodeConfig(block_n=32), None, dict(num_splits=2)),
    "d96_bs32_verify": ("verify_only", (32, 4, 1, 96, jnp.float32), SMALL, SMALL, dict(split_size=32)),
    "d320_bs16_chunked_default": ("chunked_prefill", (16, 4, 2, 320, jnp.float32), None, None, dict()),
    "d512_bs544_mixed_bf16": ("mixed", (544, 2, 1, 512, jnp.bfloat16), None, None, dict()),
    "d512_bs48_decode_splits": ("decode_only", (48, 8, 2, 512, jnp.float32), None, None, dict(num_splits=3)),
}


@pytest.mark.parametrize("name", WIDENED)
def test_head_dims_and_page_sizes(name, rng):
    batch, (bs, hq, hkv, d, dtype), cfg, chunk_cfg, splits = WIDENED[name]
    q_lens, seq_lens = BATCHES[batch]
    args = _inputs(rng, q_lens, seq_lens, bs, hq, hkv, d, dtype)
    out, lse = paged_attention(*args, max_query_len=max(q_lens), return_lse=True, config=cfg,
                               chunk_config=chunk_cfg, **splits)
    _check(out, lse, args, dtype, q_lens)


def test_splits_on_off_agree(rng):
    q_lens, seq_lens = BATCHES["mixed"]
    args = _inputs(rng, q_lens, seq_lens, 16, 8, 2, 64, jnp.float32)
    outs = [np.asarray(paged_attention(*args, max_query_len=32, config=SMALL, **kw))
            for kw in (dict(num_splits=1), dict(num_splits=4), dict(split_size=32), dict())]
    for o in outs[1:]:
        np.testing.assert_allclose(o, outs[0], rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("split", [dict(num_splits=3), dict(split_size=32)])
@pytest.mark.parametrize("layout", ["bs16_gqa4", "bs64_gqa8_bf16"])
def test_short_launch_splits_on_its_own(split, layout, rng):
    """Two launches, only the short queries split: compact partials merged by the chunk launch's extra programs."""
    q_lens, seq_lens = BATCHES["mixed"]
    bs, hq, hkv, d, dtype = LAYOUTS[layout]
    args = _inputs(rng, q_lens, seq_lens, bs, hq, hkv, d, dtype)
    short_splits = config.resolve_splits(1, args[3].shape[1] * bs, SMALL.block_n, split.get("num_splits"),
                                         split.get("split_size"))
    out, lse = paged.ragged_paged_triton(*args, max_query_len=32, scale=d ** -0.5, num_splits=1, split_size=None,
                                  interpret=True, cfg=SMALL, chunk_cfg=SMALL, short_splits=short_splits)
    _check(out, lse, args, dtype, q_lens)
    whole = paged_attention(*args, max_query_len=32, config=SMALL, num_splits=1)
    assert_attention_close(out, whole, dtype=dtype, valid_rows=sum(q_lens))


def test_mixed_batch_splits_per_launch():
    """M1's shapes (68 requests, 2,152 tokens, 8,192-key capacity): the decodes split for tail balance, the chunks
    do not, and the traced call merges the short launch inside the chunk launch."""
    cfg, chunk_cfg = config.default_decode_config(128, 16, 2), config.default_chunk_config(128, 16, 2)
    (splits, size), chunk_splits = paged.launch_splits((2152, 32, 128), 2, (9000, 16, 8, 128), (68, 512), 512,
                                                       cfg, chunk_cfg)
    assert splits > 1 and size % cfg.block_n == 0 and chunk_splits == 1
    cache = ((9000, 16, 8, 128), jnp.bfloat16)
    shapes = [jax.ShapeDtypeStruct(s, t) for s, t in [((2152, 32, 128), jnp.bfloat16), cache, cache,
                                                      ((68, 512), jnp.int32), ((68,), jnp.int32), ((69,), jnp.int32)]]
    jaxpr = str(jax.make_jaxpr(lambda *a: paged_attention(*a, max_query_len=512))(*shapes))
    assert "_split" in jaxpr and "_merge" in jaxpr and "merge_attention" not in jaxpr


@pytest.mark.parametrize("poison", [1e30, -1e30])
def test_isolation_under_poison(poison, rng):
    q_lens, seq_lens = BATCHES["mixed"]
    seed = int(rng.integers(1 << 30))
    runs = [np.asarray(paged_attention(*_inputs(np.random.default_rng(seed), q_lens, seq_lens, 16, 4, 2, 64,
                                                jnp.float32, poison=p),
                                       max_query_len=32, num_splits=2, config=SMALL))
            for p in (float("nan"), poison)]
    n = sum(q_lens)
    assert np.all(np.isfinite(runs[1][:n]))
    np.testing.assert_array_equal(runs[0][:n], runs[1][:n])


def test_decode_matches_decode_kernel(rng):
    """A decode-only batch through the ragged kernel equals the decode kernel (same tiles, same splits)."""
    q_lens, seq_lens = BATCHES["decode_only"]
    q, kc, vc, bt, sl, cu = _inputs(rng, q_lens, seq_lens, 16, 8, 2, 64, jnp.float32, pad=0)
    ragged = paged_attention(q, kc, vc, bt, sl, cu, max_query_len=1, num_splits=2, config=SMALL)
    decode = paged_decode_attention(q, kc, vc, bt, sl, num_splits=2, config=SMALL)
    np.testing.assert_allclose(np.asarray(ragged), np.asarray(decode), rtol=1e-6, atol=1e-6)


def test_decode_loop_with_write_kv_cache(rng):
    """Prefill then decode steps: write each step's K/V through slot_mapping, attend, match the reference."""
    hq, hkv, d, bs = 4, 2, 64, 8
    prompt = [5, 12, 0]
    total_steps = 3
    k_cache, v_cache = allocate_kv_cache(32, bs, hkv, d, jnp.float32)
    k_cache, v_cache = k_cache + jnp.nan, v_cache + jnp.nan  # unwritten slots are poison
    cached = [0, 0, 0]
    steps = [prompt] + [[1, 1, 1]] * total_steps
    for q_lens in steps:
        md = build_metadata(q_lens, cached, bs, num_blocks=32, max_blocks=8, seed=7)
        t = md.num_tokens
        q, k, v = (jnp.asarray(rng.standard_normal((t, h, d)), jnp.float32) for h in (hq, hkv, hkv))
        k_cache, v_cache = write_kv_cache(k_cache, v_cache, k, v, md.slot_mapping)
        out = paged_attention(q, k_cache, v_cache, md.block_tables, md.seq_lens, md.cu_query_lens,
                              max_query_len=md.max_query_len, config=SMALL)
        ref_out = reference.paged_attention(q, k_cache, v_cache, md.block_tables, md.seq_lens, md.cu_query_lens)
        assert_attention_close(out, ref_out, dtype=jnp.float32, valid_rows=sum(q_lens))
        cached = [c + n for c, n in zip(cached, q_lens)]


@pytest.mark.parametrize("kw, match", [
    (dict(cu=jnp.array([0, 1], jnp.int32)), "cu_query_lens must be"),
    (dict(seq=jnp.array([1, 1, 1], jnp.int32)), "seq_lens must be"),
    (dict(max_query_len=-1), "max_query_len must be a static"),
    (dict(max_query_len=32, split_size=16, config=SMALL), r"split_size=16 must be a multiple of both passes"),
])
def test_bad_input_raises(kw, match):
    q = jnp.ones((4, 4, 64), jnp.float32)
    kc = jnp.ones((4, 16, 2, 64), jnp.float32)
    bt = jnp.zeros((2, 2), jnp.int32)
    extra = {name: kw[name] for name in ("split_size", "config") if name in kw}
    with pytest.raises((ValueError, TypeError), match=match):
        paged_attention(q, kc, kc, bt, kw.get("seq", jnp.array([2, 2], jnp.int32)),
                        kw.get("cu", jnp.array([0, 2, 4], jnp.int32)), max_query_len=kw.get("max_query_len", 2),
                        **extra)


@pytest.mark.gpu
def test_long_mixed_compiled(rng):
    q_lens = [1] * 6 + [6] * 3 + [300, 0]
    seq_lens = [9000, 3, 17, 4000, 1, 64, 12000, 7, 700, 2300, 5]
    args = _inputs(rng, q_lens, seq_lens, 16, 32, 8, 128, jnp.bfloat16)
    for kw in (dict(), dict(num_splits=1), dict(num_splits=8)):
        out, lse = paged_attention(*args, max_query_len=512, return_lse=True, **kw)
        _check(out, lse, args, jnp.bfloat16, q_lens)


@pytest.mark.parametrize("window", [(-1, -1), (40, -1)])
def test_batch_invariance_fixed_split_size(rng, window):
    """Under split_size, a verification request's output is bit-identical alone or moved within the batch (with a
    window too: its segments count from the window's first tile, the request's own)."""
    q_lens, seq_lens = [6, 1, 30, 6], [200, 40, 90, 7]
    q, kc, vc, bt, sl, cu = _inputs(rng, q_lens, seq_lens, 16, 8, 2, 64, jnp.bfloat16, pad=0)
    run = lambda q, bt, sl, cu: np.asarray(
        paged_attention(q, kc, vc, bt, sl, cu, max_query_len=32, split_size=32, config=SMALL,
                        chunk_config=SMALL, window_size=window), np.float32)
    full = run(q, bt, sl, cu)
    assert_attention_close(full, reference.paged_attention(q, kc, vc, bt, sl, cu, window_size=window),
                           dtype=jnp.bfloat16)
    alone = run(q[:6], bt[:1], sl[:1], jnp.array([0, 6], jnp.int32))
    np.testing.assert_array_equal(full[:6], alone)
    perm = np.array([2, 1, 0, 3])
    rows = np.concatenate([np.arange(cu[i], cu[i + 1]) for i in perm])
    moved_cu = jnp.asarray(np.concatenate([[0], np.cumsum(np.asarray(q_lens)[perm])]), jnp.int32)
    moved = run(q[rows], bt[perm], sl[perm], moved_cu)
    start = int(moved_cu[2])
    np.testing.assert_array_equal(full[:6], moved[start:start + 6])
