"""mla_attention (dense MLA over a paged latent cache) against the reference: decode and multi-token steps, lengths
0 / 1 / tile ± 1 / long, block sizes 1 to 544, split-KV, attention sinks, NaN in every slot no request owns,
corrupt lengths and tables, bad input."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_attn import MLAConfig, checked, mla_attention, quantize_latent, reference, sparse_mla_attention
from pallas_attn.checks import CheckError
from pallas_attn.testing import assert_attention_close, make_paged_kv

I32 = jnp.int32
SMALL = MLAConfig(block_n=16, block_h=16, num_warps=4)  # tiles of 16 keys: CPU lengths cross several


def _cu(q_lens):
    return jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), I32)


def _check(rng, seq_lens, q_lens, heads, dqk, dv, bs, dtype, *, sinks=None, pad=2, fp8=False, **kwargs):
    """Random queries over a cache with NaN in every slot no request owns and garbage past each table row; with
    ``q_lens`` (new tokens per request, else decode) ``pad`` padding rows with NaN queries. Output and LSE against
    the reference; padding rows must be zeros and -inf. ``fp8``: the cache quantised to FP8 latent rows (NaN rows
    stay NaN bytes)."""
    kv, _, bt = make_paged_kv(rng, seq_lens, bs, None, dqk, dtype)
    if fp8:
        kv = quantize_latent(kv, dv)
    sl = jnp.asarray(seq_lens, I32)
    if q_lens is None:
        pad, cu, n = 0, None, len(seq_lens)
    else:
        cu, n = _cu(q_lens), int(sum(q_lens))
    q = np.full((n + pad, heads, dqk), np.nan, np.float32)
    q[:n] = rng.standard_normal((n, heads, dqk))
    q = jnp.asarray(q, dtype)
    max_query_len = 1 if q_lens is None else max(1, max(q_lens))
    out, lse = mla_attention(q, kv, bt, sl, cu, max_query_len=max_query_len, kv_lora_rank=dv, sinks=sinks,
                             return_lse=True, **kwargs)
    ref_out, ref_lse = reference.mla_attention(q, kv, bt, sl, cu, kv_lora_rank=dv, sinks=sinks, return_lse=True)
    assert out.shape == (n + pad, heads, dv) and out.dtype == q.dtype and lse.dtype == jnp.float32
    assert_attention_close(out, ref_out, dtype=dtype, valid_rows=n)
    lse, ref_lse = np.asarray(lse), np.asarray(ref_lse)
    np.testing.assert_array_equal(np.isneginf(lse[:n]), np.isneginf(ref_lse[:n]))
    fin = np.isfinite(ref_lse[:n])
    np.testing.assert_allclose(lse[:n][fin], ref_lse[:n][fin], rtol=1e-5, atol=1e-4)
    assert np.all(np.asarray(out, np.float32)[n:] == 0) and np.all(lse[n:] == -np.inf)
    return out


# name: (seq_lens, new tokens per request or None for decode, heads, dim_qk, kv_lora_rank, block_size, dtype).
# Lengths 0, 1 and tile ± 1 (16-key tiles), heads that fill, pad or split a head block.
SCENARIOS = {
    "decode_small_dims": ([30, 1, 0, 64, 17, 15, 16], None, 4, 80, 64, 4, jnp.float32),
    "decode_576_bf16": ([40, 100, 16], None, 16, 576, 512, 16, jnp.bfloat16),
    "decode_20_heads": ([25, 33], None, 20, 80, 64, 8, jnp.float32),  # head blocks of 16: one partial
    "decode_32_heads": ([47], None, 32, 80, 64, 16, jnp.float32),  # two head blocks
    "mtp_576_bf16": ([70, 129, 5], [2, 2, 2], 16, 576, 512, 64, jnp.bfloat16),
    "verify_mixed": ([50, 9, 33, 3, 0], [3, 1, 8, 0, 0], 4, 80, 64, 16, jnp.float32),  # q_len 0, 1, 8
    "block_size_1": ([20, 5], [2, 1], 4, 80, 64, 1, jnp.float32),
    "block_size_48": ([100, 47], [2, 1], 4, 80, 64, 48, jnp.float32),  # pages of any multiple of 16
    "block_size_544": ([600, 9], None, 4, 80, 64, 544, jnp.float32),
    "fp16": ([31, 64], [1, 4], 8, 80, 64, 16, jnp.float16),
}


@pytest.mark.parametrize("name", SCENARIOS)
def test_matches_reference(name, rng):
    _check(rng, *SCENARIOS[name], config=SMALL)


@pytest.mark.parametrize("split", [dict(num_splits=1), dict(num_splits=3), dict(split_size=32),
                                   dict(num_splits=8)])  # 8 splits: some segments of a short request are empty
def test_split_kv_matches_reference(split, rng):
    _check(rng, [90, 1, 0, 33], [2, 1, 0, 3], 8, 80, 64, 16, jnp.float32, config=SMALL, **split)


def test_default_config_and_tiles(rng):
    """The default tiles (64 keys, up to 64 rows a program) at DeepSeek's dims, decode and MTP."""
    _check(rng, [130, 64, 65, 1], None, 16, 576, 512, 64, jnp.bfloat16)
    _check(rng, [130, 64, 65, 2], [2, 2, 1, 2], 16, 576, 512, 64, jnp.bfloat16)


def test_tokens_per_block(rng):
    """Programs of 1, 2 and 8 tokens: a request's tokens split over query blocks or sharing one."""
    for block_q in (1, 2, 8):
        _check(rng, [40, 21], [5, 3], 4, 80, 64, 16, jnp.float32,
               config=MLAConfig(block_n=16, block_h=4, block_q=block_q, num_warps=4))


SINK_REGIMES = {
    "very_negative": lambda rng, h: np.full(h, -30.0),
    "moderate": lambda rng, h: rng.standard_normal(h),
    "very_positive": lambda rng, h: np.full(h, 30.0),
}


@pytest.mark.parametrize("regime", SINK_REGIMES)
@pytest.mark.parametrize("splits", [1, 3])
def test_sinks_match_reference(regime, splits, rng):
    """Sinks once per row, in the kernel or after the split merge; a request with no key stays 0 and -inf."""
    sinks = jnp.asarray(SINK_REGIMES[regime](rng, 20), jnp.float32)
    _check(rng, [70, 0, 19], [2, 0, 1], 20, 80, 64, 16, jnp.float32, sinks=sinks, num_splits=splits, config=SMALL)


def test_batch_invariant_with_split_size(rng):
    """With a fixed split_size a request's output is bit-identical whatever else is in the batch."""
    kv, _, bt = make_paged_kv(rng, [90, 40, 7], 16, None, 80, jnp.float32)
    q = jnp.asarray(rng.standard_normal((3, 4, 80)), jnp.float32)
    kw = dict(kv_lora_rank=64, split_size=32, config=SMALL)
    alone = mla_attention(q[:1], kv, bt[:1], jnp.array([90], I32), **kw)
    batch = mla_attention(q, kv, bt, jnp.array([90, 40, 7], I32), **kw)
    np.testing.assert_array_equal(np.asarray(alone[0]), np.asarray(batch[0]))


def test_corrupt_lengths_and_tables_stay_inside_the_request(rng):
    """Lengths past the table or negative, boundaries that overlap or run past the rows, and page ids outside the
    pool inside a request's length: the kernel reads and masks exactly what the reference does, and safe mode names
    the first broken rule. (A length past the request's keys reads its table's entries there, as the reference
    does: the free slots hold a finite poison here, so that the comparison is of values.)"""
    seq_lens = [40, 20, 33]
    kv, _, bt = make_paged_kv(rng, seq_lens, 16, None, 80, jnp.float32, max_blocks=3, poison=7.0)
    bt = np.asarray(bt).copy()
    bt[2, 1] = 10**6  # a page id past the pool, inside request 2's keys
    q = jnp.asarray(rng.standard_normal((6, 4, 80)), jnp.float32)
    for sl, cu in (([40, -3, 33], None), ([100, 20, 33], None), ([40, 20, 33], [0, 3, 2, 9]),
                   ([40, 20, 33], [1, 2, 4, 5])):
        sl = jnp.asarray(sl, I32)
        cu = None if cu is None else jnp.asarray(cu, I32)
        qq = q[:3] if cu is None else q
        out, lse = mla_attention(qq, kv, jnp.asarray(bt), sl, cu, max_query_len=4, kv_lora_rank=64,
                                 return_lse=True, config=SMALL)
        ref_out, ref_lse = reference.mla_attention(qq, kv, jnp.asarray(bt), sl, cu, kv_lora_rank=64,
                                                   return_lse=True)
        assert_attention_close(out, ref_out, dtype=jnp.float32)
        np.testing.assert_array_equal(np.isneginf(np.asarray(lse)), np.isneginf(np.asarray(ref_lse)))
        with pytest.raises(CheckError, match="mla_attention: "):
            checked(mla_attention)(qq, kv, jnp.asarray(bt), sl, cu, max_query_len=4, kv_lora_rank=64, config=SMALL)


def test_checked_passes_a_valid_batch_unchanged(rng):
    kv, _, bt = make_paged_kv(rng, [40, 20], 16, None, 80, jnp.float32)
    q = jnp.asarray(rng.standard_normal((3, 4, 80)), jnp.float32)
    args = (q, kv, bt, jnp.array([40, 20], I32), jnp.array([0, 2, 3], I32))
    kw = dict(max_query_len=2, kv_lora_rank=64, config=SMALL)
    np.testing.assert_array_equal(np.asarray(checked(mla_attention)(*args, **kw)),
                                  np.asarray(mla_attention(*args, **kw)))


def test_new_lengths_do_not_recompile(rng):
    """Lengths, tables and sinks are data: a new batch of the same shapes reuses the compiled program."""
    kv, _, bt = make_paged_kv(rng, [40, 20], 16, None, 80, jnp.float32, max_blocks=4)
    q = jnp.asarray(rng.standard_normal((2, 4, 80)), jnp.float32)
    run = lambda sl: mla_attention(q, kv, bt, jnp.asarray(sl, I32), kv_lora_rank=64, config=SMALL)  # noqa: E731
    run([40, 20])
    jitted = mla_attention
    while not hasattr(jitted, "_cache_size"):  # the jitted function behind the argument checks
        jitted = jitted.__wrapped__
    before = jitted._cache_size()
    for sl in ([3, 20], [1, 0]):
        assert_attention_close(run(sl), reference.mla_attention(q, kv, bt, jnp.asarray(sl, I32), kv_lora_rank=64))
    assert jitted._cache_size() == before


def test_empty_batches_need_no_kernel(rng):
    kv, _, bt = make_paged_kv(rng, [5], 16, None, 80, jnp.float32)
    out, lse = mla_attention(jnp.zeros((0, 4, 80)), kv, bt[:0], jnp.zeros((0,), I32), kv_lora_rank=64,
                             return_lse=True)
    assert out.shape == (0, 4, 64) and lse.shape == (0, 4)
    q = jnp.ones((1, 4, 80))
    out, lse = mla_attention(q, kv, bt[:, :0], jnp.array([5], I32), kv_lora_rank=64, return_lse=True)
    assert not np.any(np.asarray(out)) and np.all(np.asarray(lse) == -np.inf)


def test_differentiation_raises():
    kv = jnp.ones((2, 16, 80))
    with pytest.raises(NotImplementedError, match="^mla_attention has no backward pass yet"):
        jax.grad(lambda q: mla_attention(q, kv, jnp.zeros((1, 1), I32), jnp.array([3], I32),
                                         kv_lora_rank=64).sum())(jnp.ones((1, 4, 80)))


@pytest.mark.parametrize("change, error, match", [
    (dict(q=jnp.ones((2, 4, 80, 1))), ValueError, "q must be"),
    (dict(kv=jnp.ones((4, 16, 96))), ValueError, r"kv_cache must be \[num_blocks, block_size, 80\]"),
    (dict(kv=jnp.ones((4, 16, 80), jnp.bfloat16)), TypeError, "q / kv_cache must share one dtype"),
    (dict(kv=jnp.ones((4, 16, 80), jnp.float8_e4m3fn)), TypeError, "FP8 latent cache"),
    (dict(kv=jnp.ones((4, 24, 80))), ValueError, "block_size=24"),
    (dict(rank=100), ValueError, "kv_lora_rank=100"),
    (dict(seq_lens=jnp.ones((3,), I32)), ValueError, "seq_lens must be"),
    (dict(seq_lens=jnp.ones((2,), jnp.float32)), TypeError, "seq_lens"),
    (dict(bt=jnp.zeros((3, 2), I32), seq_lens=jnp.ones((3,), I32)), ValueError,
     "without cu_query_lens every token is its own request"),
    (dict(cu=jnp.array([0, 2], I32)), ValueError, "cu_query_lens must be"),
    (dict(max_query_len=0), ValueError, "max_query_len=0"),
    (dict(sinks=jnp.zeros(3)), ValueError, "sinks"),
    (dict(split_size=24), ValueError, "split_size=24"),
])
def test_bad_input_raises(change, error, match):
    args = dict(q=jnp.ones((2, 4, 80)), kv=jnp.ones((4, 16, 80)), bt=jnp.zeros((2, 2), I32),
                seq_lens=jnp.array([3, 5], I32), cu=None, rank=64, max_query_len=1, sinks=None, split_size=None)
    args.update(change)
    with pytest.raises(error, match=match):
        mla_attention(args["q"], args["kv"], args["bt"], args["seq_lens"], args["cu"],
                      max_query_len=args["max_query_len"], kv_lora_rank=args["rank"], sinks=args["sinks"],
                      split_size=args["split_size"], config=SMALL)


# ------------------------------------------------------------------- the FP8 latent cache (FlashMLA's layout)
FP8_CASES = {  # (seq_lens, new tokens per request or None, heads, block_size)
    "decode": ([40, 100, 16, 0, 1], None, 16, 16),
    "mtp_pages_48": ([70, 129, 5], [2, 2, 2], 16, 48),
    "verify_pages_64": ([300, 33, 0], [3, 1, 0], 8, 64),
}


@pytest.mark.parametrize("name", FP8_CASES)
@pytest.mark.parametrize("split", [dict(num_splits=1), dict(num_splits=3)])
def test_fp8_latent_matches_reference(name, split, rng):
    """The kernel over an FP8 latent cache against the reference over its dequantised rows."""
    seq_lens, q_lens, heads, block_size = FP8_CASES[name]
    _check(rng, seq_lens, q_lens, heads, 576, 512, block_size, jnp.bfloat16, fp8=True, **split)


def test_fp8_latent_sinks_and_float16_queries(rng):
    sinks = jnp.asarray(rng.standard_normal(8), jnp.float32)
    _check(rng, [65, 3], [1, 2], 8, 576, 512, 16, jnp.float16, fp8=True, sinks=sinks)


def test_quantize_latent_is_the_reference_and_saturates(rng):
    """Byte for byte the reference's rows; finite input never stores inf or NaN, a NaN stays NaN, zeros stay zeros,
    and the dequantised rows are within e4m3's rounding of the input."""
    x = rng.standard_normal((3, 7, 576)).astype(np.float32) * 10
    x[0, 0] = 0.0
    x[1, 2, 5] = 3e38  # its group's scale takes it; the group's small values round to 0
    x[2, 3, 7] = np.nan
    got = np.asarray(quantize_latent(jnp.asarray(x)))
    np.testing.assert_array_equal(got, np.asarray(reference.quantize_latent(x)))
    assert got.shape == (3, 7, 656) and got.dtype == np.uint8
    back = np.asarray(reference.dequantize_latent(got))
    assert np.all(back[0, 0] == 0)
    assert np.isnan(back[2, 3, :128]).any() and np.isfinite(np.delete(back.reshape(21, 576), 17, axis=0)).all()
    normal = np.ones((3, 7), bool)
    normal[0, 0] = normal[1, 2] = normal[2, 3] = False
    err = np.linalg.norm(back[normal] - x[normal]) / np.linalg.norm(x[normal])
    assert err < 0.04, err  # e4m3: 3 mantissa bits, a scale per 128 values
    np.testing.assert_array_equal(back[normal][:, 512:], x[normal][:, 512:].astype(jnp.bfloat16).astype(np.float32))


def test_fp8_latent_corrupt_lengths_and_tables(rng):
    """The corrupt-input cases of the bf16 cache over an FP8 one: lengths past the table or negative, overlapping
    boundaries, a page id past the pool; safe mode names the first broken rule and passes a valid batch unchanged."""
    seq_lens = [40, 20, 33]
    kv, _, bt = make_paged_kv(rng, seq_lens, 16, None, 576, jnp.bfloat16, max_blocks=3, poison=7.0)
    kv = quantize_latent(kv)
    good = (jnp.asarray(bt), jnp.asarray(seq_lens, I32))
    bt = np.asarray(bt).copy()
    bt[2, 1] = 10**6
    q = jnp.asarray(rng.standard_normal((6, 8, 576)), jnp.bfloat16)
    for sl, cu in (([40, -3, 33], None), ([100, 20, 33], None), ([40, 20, 33], [0, 3, 2, 9])):
        sl = jnp.asarray(sl, I32)
        cu = None if cu is None else jnp.asarray(cu, I32)
        qq = q[:3] if cu is None else q
        out = mla_attention(qq, kv, jnp.asarray(bt), sl, cu, max_query_len=4)
        assert_attention_close(out, reference.mla_attention(qq, kv, jnp.asarray(bt), sl, cu), dtype=jnp.bfloat16)
        with pytest.raises(CheckError, match="mla_attention: "):
            checked(mla_attention)(qq, kv, jnp.asarray(bt), sl, cu, max_query_len=4)
    good = (q[:3], kv, *good)
    np.testing.assert_array_equal(np.asarray(checked(mla_attention)(*good), np.float32),
                                  np.asarray(mla_attention(*good), np.float32))


def test_fp8_latent_accuracy_against_bf16(rng):
    """What FP8 costs against the bf16 cache: random rows, and a needle key whose score dominates one request of
    2,048 keys: its attention weight (from the LSE) within 5% of the bf16 cache's."""
    kv, _, bt = make_paged_kv(rng, [300, 2048], 64, None, 576, jnp.bfloat16)
    q = jnp.asarray(rng.standard_normal((2, 16, 576)), jnp.bfloat16)
    sl = jnp.asarray([300, 2048], I32)
    run = lambda cache, q: mla_attention(q, cache, bt, sl, return_lse=True)  # noqa: E731
    out16, _ = run(kv, q)
    out8, _ = run(quantize_latent(kv), q)
    rel = float(jnp.linalg.norm((out8 - out16).astype(jnp.float32)) / jnp.linalg.norm(out16.astype(jnp.float32)))
    assert rel < 0.06, rel
    # the needle: key 1234 of request 1; every head's query points along it
    needle = np.asarray(bt)[1, 1234 // 64] * 64 + 1234 % 64
    rows = kv.reshape(-1, 576)
    q = jnp.broadcast_to(0.5 * rows[needle].astype(jnp.float32), (2, 16, 576)).astype(jnp.bfloat16)
    weights = []
    for cache, read in ((kv, rows), (quantize_latent(kv), reference.dequantize_latent(quantize_latent(rows)))):
        _, lse = run(cache, q)
        score = jnp.dot(q[1].astype(jnp.float32), read[needle].astype(jnp.float32)) / 24.0  # 1 / sqrt(576)
        weights.append(np.asarray(jnp.exp(score - lse[1])))
    assert np.all(weights[0] > 0.5)  # the needle dominates
    np.testing.assert_allclose(weights[1], weights[0], rtol=0.05)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [([4096, 8000, 1, 65, 0], None, 16, 64), ([3000, 2, 129], [2, 2, 1], 128, 64),
                                  ([700, 40], [1, 3], 16, 16)])
def test_fp8_latent_compiled(case, rng):
    seq_lens, q_lens, heads, block_size = case
    _check(rng, seq_lens, q_lens, heads, 576, 512, block_size, jnp.bfloat16, fp8=True)


@pytest.mark.parametrize("kv, rank, error, match", [
    (jnp.ones((4, 16, 600), jnp.uint8), 512, ValueError, r"must be uint8\[num_blocks, block_size, 656\]"),
    (jnp.ones((4, 16, 600), jnp.uint8), 64, ValueError, "kv_lora_rank a multiple of 128"),
    (jnp.ones((4, 16, 576), jnp.float8_e4m3fn), 512, TypeError, "FlashMLA's layout"),
    (jnp.ones((4, 16, 656), jnp.uint8), 512, TypeError, "an FP8 latent cache takes bf16 / fp16 queries"),
])
def test_fp8_latent_bad_input_raises(kv, rank, error, match):
    q = jnp.ones((2, 4, 576), jnp.float32 if "queries" in match else jnp.bfloat16)
    with pytest.raises(error, match=match):
        mla_attention(q, kv, jnp.zeros((2, 2), I32), jnp.array([3, 5], I32), kv_lora_rank=rank)


def test_fp8_latent_is_for_dense_mla_on_triton():
    """The sparse function and the Mosaic kernel do not read FP8 latent caches: named errors; the default backend
    picks the Triton kernel for them."""
    from pallas_attn.core import backend
    from pallas_attn.ops import mla

    q, kv = jnp.ones((2, 64, 576), jnp.bfloat16), jnp.ones((4, 16, 656), jnp.uint8)
    bt, sl = jnp.zeros((2, 2), I32), jnp.array([3, 5], I32)
    with pytest.raises(TypeError, match="mla_attention reads FP8 ones"):
        sparse_mla_attention(q, kv, bt, jnp.zeros((2, 64), I32), seq_lens=sl)
    with pytest.raises(ValueError, match="backend='mosaic' does not support an FP8 latent cache"):
        mla_attention(q, kv, bt, sl, backend="mosaic", interpret=False)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(backend, "is_hopper", lambda: True)
        assert mla.default_backend(q, 512, False, kv) == "triton"
        assert mla.default_backend(q, 512, False, jnp.ones((4, 16, 576), jnp.bfloat16)) == "mosaic"


@pytest.mark.gpu
@pytest.mark.parametrize("shape", ["L1", "L2"])
def test_harness_shapes_compiled(shape, rng):
    """The harness workloads' shapes, scaled down in batch: DeepSeek's dims, pages of 64, default tiles."""
    if shape == "L1":  # memory bound: 16 heads (a TP-8 shard), decode
        _check(rng, [4096, 8000, 5000, 1], None, 16, 576, 512, 64, jnp.bfloat16)
    else:  # compute bound: 128 heads, two tokens a step
        _check(rng, [8192, 3000, 2], [2, 2, 2], 128, 576, 512, 64, jnp.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 4])
def test_long_context_with_sinks_compiled(splits, rng):
    sinks = jnp.asarray(rng.standard_normal(16), jnp.float32)
    _check(rng, [32768, 100], None, 16, 576, 512, 64, jnp.bfloat16, sinks=sinks, num_splits=splits)


# ----------------------------------------------------------------------------- the Mosaic GPU kernel (sm_90)
@pytest.mark.parametrize("heads, q_len, block_size, split, sinks", [
    (16, 1, 64, dict(num_splits=1), False), (16, 1, 64, dict(num_splits=4), True), (128, 2, 64, {}, True),
    (32, 1, 16, dict(split_size=1024), False), (64, 3, 1, dict(num_splits=1), True), (8, 2, 48, {}, False),
    (16, 3, 64, dict(num_splits=1), True), (16, 2, 64, dict(num_splits=3), True), (24, 2, 16, {}, False)])
def test_mosaic_lowers_for_cuda(heads, q_len, block_size, split, sinks):
    """The compiled Mosaic path's lowering (the shared row of positions, per-block tile counts, heads below 64
    stored from the tile's first rows, several tokens of a request in one tile, sinks in the kernel or after the
    merge), checked without a GPU."""
    S = jax.ShapeDtypeStruct
    seqs = 3
    cu = [S((seqs + 1,), I32)] if q_len > 1 else []

    def f(q, kv, bt, sl, *rest):
        return mla_attention(q, kv, bt, sl, rest[0] if cu else None, max_query_len=q_len,
                             sinks=rest[-1] if sinks else None, return_lse=True, interpret=False, backend="mosaic",
                             **split)

    args = (S((seqs * q_len, heads, 576), jnp.bfloat16), S((40, block_size, 576), jnp.bfloat16), S((seqs, 40), I32),
            S((seqs,), I32), *cu, *([S((heads,), jnp.float32)] if sinks else []))
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


def test_mosaic_backend_refuses_what_it_cannot_run():
    q, kv = jnp.ones((2, 20, 576), jnp.bfloat16), jnp.ones((4, 16, 576), jnp.bfloat16)
    args = (kv, jnp.zeros((2, 2), I32), jnp.array([3, 5], I32))
    with pytest.raises(ValueError, match="backend='mosaic' does not support interpret mode"):
        mla_attention(q[:, :16], *args, backend="mosaic", interpret=True)
    with pytest.raises(ValueError, match="backend='mosaic' does not support 20 heads"):
        mla_attention(q, *args, backend="mosaic", interpret=False)
    with pytest.raises(ValueError, match="backend='mosaic' does not support dtype float32"):
        mla_attention(q[:, :16].astype(jnp.float32), kv.astype(jnp.float32), *args[1:], backend="mosaic",
                      interpret=False)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["decode_576_bf16", "mtp_576_bf16"])
@pytest.mark.parametrize("split", [dict(num_splits=1), dict(num_splits=3), dict(split_size=64), {}])
def test_mosaic_matches_reference(name, split, rng):
    """The compiled Mosaic kernel under the same hostile inputs as the Triton one."""
    _check(rng, *SCENARIOS[name], backend="mosaic", **split)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [
    ([4096, 8000, 5000, 1, 0, 65], None, 16, 64),  # L1's heads, lengths 0 / 1 / tile + 1
    ([8192, 3000, 2, 64], [2, 2, 2, 1], 128, 64),  # L2's heads, two tokens a step
    ([300, 129, 17], [3, 1, 4], 64, 16),  # several tokens, pages of 16
    ([700, 40], [1, 2], 32, 1),  # pages of one token
    ([333, 90], None, 8, 48),  # 8 heads, pages of 48
    ([300, 129, 17, 5, 64], [3, 1, 4, 0, 2], 16, 64),  # 16 heads: 4 tokens a tile, a request of 1 and one of 0
    ([70, 40, 9, 130], [8, 5, 2, 7], 8, 16),  # 8 heads: 8 tokens a tile, part-filled tiles
    ([200, 65, 3], [2, 2, 3], 24, 64),  # 24 heads: 2 tokens a tile (48 rows), a request with fewer keys than tokens
])
@pytest.mark.parametrize("sinks", [False, True])
def test_mosaic_shapes_compiled(case, sinks, rng):
    seq_lens, q_lens, heads, block_size = case
    s = jnp.asarray(rng.standard_normal(heads), jnp.float32) if sinks else None
    _check(rng, seq_lens, q_lens, heads, 576, 512, block_size, jnp.bfloat16, sinks=s, backend="mosaic")


@pytest.mark.parametrize("heads, max_query_len, per_block", [(16, 1, 1), (16, 2, 2), (16, 3, 4), (16, 8, 4),
                                                             (8, 8, 8), (24, 3, 2), (40, 4, 1), (128, 2, 1)])
def test_mosaic_query_blocks(heads, max_query_len, per_block, rng):
    """The dense Mosaic kernel's query blocks: every token of a request lands in exactly one block of its request,
    at its place, and the block's first token and last token's keys give each row its own causal bound."""
    from pallas_attn.core import metadata
    from pallas_attn.kernels.mosaic import sparse_mla
    from pallas_attn.ops import mla

    assert sparse_mla.tokens_per_block(heads, max_query_len) == per_block
    q_lens = rng.integers(0, max_query_len + 1, size=9)
    q_lens[0] = max_query_len
    num_tokens = int(q_lens.sum()) + 3  # padding rows
    cu = _cu(q_lens)
    seq_lens = jnp.asarray(rng.integers(0, 300, size=9), I32)
    token_req = metadata.token_requests(cu, num_tokens)
    token_keys = mla._token_keys(cu, seq_lens, token_req, 320)
    (req, token0, keys, ntok), rows = sparse_mla.query_blocks(cu, token_req, token_keys, per_block)
    if per_block == 1:
        assert rows is None
        rows = np.arange(num_tokens)
    req, token0, keys, ntok, rows = map(np.asarray, (req, token0, keys, ntok, rows))
    token_req, token_keys = np.asarray(token_req), np.asarray(token_keys)
    slots = set()
    for t in np.flatnonzero(token_req >= 0):
        b, place = divmod(int(rows[t]), per_block)
        assert req[b] == token_req[t] and token0[b] + place == t and place < ntok[b]
        assert keys[b] - ntok[b] + 1 + place == token_keys[t] or token_keys[t] == 0 >= keys[b] - ntok[b] + 1 + place
        slots.add((b, place))
    assert len(slots) == int(q_lens.sum()) == int(ntok.sum())  # no token twice, no block row beyond its tokens
    assert np.all(ntok[req < 0] == 0) and np.all(ntok[req >= 0] >= 1)


@pytest.mark.gpu
@pytest.mark.parametrize("heads, q_lens", [(16, [2, 1, 2]), (128, None)])
@pytest.mark.parametrize("split", [dict(split_size=1024), dict(num_splits=1)])
def test_mosaic_batch_invariant(heads, q_lens, split, rng):
    """The Mosaic kernel: with a fixed split_size (or no split) a request's output is bit-identical alone and in a
    batch, tokens sharing a tile included (16 heads, two tokens a step)."""
    seq_lens = [5000, 300, 70]
    kv, _, bt = make_paged_kv(rng, seq_lens, 64, None, 576, jnp.bfloat16)
    n = len(seq_lens) if q_lens is None else sum(q_lens)
    q = jnp.asarray(rng.standard_normal((n, heads, 576)), jnp.bfloat16)
    first = 1 if q_lens is None else q_lens[0]
    kw = dict(backend="mosaic", max_query_len=1 if q_lens is None else 2, **split)
    cu = (lambda lens: None) if q_lens is None else _cu
    alone = mla_attention(q[:first], kv, bt[:1], jnp.asarray(seq_lens[:1], I32), cu(q_lens and q_lens[:1]), **kw)
    batch = mla_attention(q, kv, bt, jnp.asarray(seq_lens, I32), cu(q_lens), **kw)
    np.testing.assert_array_equal(np.asarray(alone, np.float32), np.asarray(batch[:first], np.float32))


@pytest.mark.parametrize("programs, capacity, splits, decode_splits", [
    (256, 8192, 1, 3),  # L2: 128 tokens × 2 head blocks cover the 132 SMs once
    (256, 2048, 1, 2),  # 256 requests × 16 heads
    (128, 8192, 5, 5),  # L1: 128 programs leave SMs idle: split
    (1, 32768, 32, 32),  # one long request: a program a 1,024 keys
])
def test_mosaic_split_rule(programs, capacity, splits, decode_splits):
    """The dense Mosaic kernel takes a whole SM (its shared memory): a batch fills the GPU at one program an SM, not
    at the two of the decode heuristic (docs/performance.md#dense-mla-splits)."""
    from pallas_attn.core import config

    assert config.resolve_splits(programs, capacity, 64, None, None, programs_per_sm=1)[0] == splits
    assert config.resolve_splits(programs, capacity, 64, None, None)[0] == decode_splits


@pytest.mark.parametrize("hopper, interpret, heads, dtype, expected", [
    (True, False, 16, jnp.bfloat16, "mosaic"),  # L1: a TP-8 shard of 128 heads
    (True, False, 128, jnp.bfloat16, "mosaic"),  # L2
    (True, False, 24, jnp.float16, "mosaic"),
    (True, False, 12, jnp.bfloat16, "triton"),  # not whole 8-row tiles: the Mosaic kernel does not apply
    (True, False, 128, jnp.float32, "triton"),
    (True, True, 128, jnp.bfloat16, "triton"),  # interpret mode: the Mosaic kernel is compiled only
    (False, False, 128, jnp.bfloat16, "triton"),
])
def test_default_backend_rule(monkeypatch, hopper, interpret, heads, dtype, expected):
    from pallas_attn.core import backend
    from pallas_attn.ops import mla

    monkeypatch.setattr(backend, "is_hopper", lambda: hopper)
    assert mla.default_backend(jnp.zeros((2, heads, 576), dtype), 512, interpret) == expected
    assert mla.default_backend(jnp.zeros((2, heads, 576), dtype), 448, interpret) == "triton"  # 128 rope dims
