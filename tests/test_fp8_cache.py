"""FP8 paged caches, first the definition: ``reference.quantize_kv`` / ``dequantize_kv`` (vLLM's per-tensor
scale: stored = value / scale, read = stored · scale), the paged oracles over a dequantised cache, the write
through ``write_kv_cache(k_scale=, v_scale=)``; then the paged kernels reading FP8 against the oracles (every batch
kind, split-KV on and off, pages of 16, 48 and 64, NaN in every slot no request owns, corrupt tables), and the
named errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import pallas_attn as pa
from pallas_attn import reference
from pallas_attn.testing import assert_attention_close, make_paged_kv, relative_l2
from tests.test_isolation import DECODE_SCENARIOS

FORMATS = [jnp.float8_e4m3fn, jnp.float8_e5m2]


@pytest.mark.parametrize("dtype", FORMATS)
def test_quantize_saturates_and_rounds(dtype):
    finite = float(jnp.finfo(dtype).max)
    x = jnp.array([0.0, 1.0, -3.3, 1e9, -1e9, jnp.inf, -jnp.inf, jnp.nan], jnp.float32)
    stored = reference.quantize_kv(x, 0.5, dtype)
    assert stored.dtype == dtype
    back = np.asarray(reference.dequantize_kv(stored, 0.5))
    np.testing.assert_array_equal(back[[3, 4, 5, 6]], [0.5 * finite, -0.5 * finite] * 2)  # saturated, never inf
    assert np.isnan(back[7]) and back[0] == 0 and back[1] == 1.0
    step = 2.0 ** -(3 if dtype == jnp.float8_e4m3fn else 2)  # mantissa bits 3 / 2: relative step near 3.3/0.5
    assert abs(back[2] + 3.3) <= 3.3 * step / 2 + 1e-6


@pytest.mark.parametrize("dtype", FORMATS)
def test_write_stores_what_the_reference_quantizes(dtype, rng):
    k_cache, v_cache = pa.allocate_kv_cache(4, 16, 2, 32, dtype)
    k = jnp.asarray(rng.standard_normal((5, 2, 32)) * 3, jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((5, 2, 32)), jnp.bfloat16)
    slots = jnp.array([0, 17, -1, 63, 40], jnp.int32)
    k_cache, v_cache = pa.write_kv_cache(k_cache, v_cache, k, v, slots, k_scale=0.25, v_scale=jnp.float32(0.125))
    flat_k, flat_v = k_cache.reshape(64, 2, 32), v_cache.reshape(64, 2, 32)
    for row, slot in ((0, 0), (1, 17), (3, 63), (4, 40)):
        np.testing.assert_array_equal(np.asarray(flat_k[slot], np.float32),
                                      np.asarray(reference.quantize_kv(k[row], 0.25, dtype), np.float32))
        np.testing.assert_array_equal(np.asarray(flat_v[slot], np.float32),
                                      np.asarray(reference.quantize_kv(v[row], 0.125, dtype), np.float32))
    assert not np.asarray(flat_k[1], np.float32).any()  # untouched slots stay zero


@pytest.mark.parametrize("dtype", FORMATS)
def test_per_tensor_calibration(dtype):
    """``kv_scale_per_tensor`` puts the largest finite magnitude (NaN ignored) at the top of the format: its scale
    is that magnitude times the float32 reciprocal of the format's largest finite value, the same bits on every
    backend, and ``quantize_kv`` stores that magnitude as the format's largest value."""
    x = jnp.array([[0.5, -3.0], [jnp.nan, 1.0]], jnp.float32)
    scale = reference.kv_scale_per_tensor(x, dtype)
    top = np.float32(jnp.finfo(dtype).max)
    assert float(scale) == float(np.float32(3.0) * (np.float32(1.0) / top))
    stored = reference.quantize_kv(x, scale, dtype)
    assert float(stored[0, 1]) == -float(top)
    assert float(reference.dequantize_kv(stored, scale)[0, 1]) == float(-top * np.float32(scale))
    assert float(reference.kv_scale_per_tensor(jnp.zeros(4), dtype)) > 0


@pytest.mark.parametrize("dtype", FORMATS)
def test_write_per_token_head_scales(dtype, rng):
    """Scale caches: each written row gets its own scale (its largest magnitude over the format's largest finite
    value, ``reference.kv_scales_per_token_head``) and stores ``row / scale``; the other slots and their scales are
    untouched; a row of zeros stores zeros."""
    k_cache, v_cache = pa.allocate_kv_cache(4, 16, 2, 32, dtype)
    k_scales, v_scales = pa.allocate_kv_scales(4, 16, 2)
    k = np.asarray(rng.standard_normal((5, 2, 32)) * 10.0 ** rng.uniform(-3, 3, (5, 2, 1)), np.float32)
    k[2] = 0.0
    k, v = jnp.asarray(k, jnp.bfloat16), jnp.asarray(rng.standard_normal((5, 2, 32)), jnp.bfloat16)
    slots = jnp.array([0, 17, 5, -1, 40], jnp.int32)
    k_cache, v_cache, k_scales, v_scales = pa.write_kv_cache(k_cache, v_cache, k, v, slots, k_scale=k_scales,
                                                             v_scale=v_scales)
    assert k_scales.shape == (4, 16, 2) and k_scales.dtype == jnp.float32
    flat = lambda x: np.asarray(x.reshape(64, *x.shape[2:]), np.float32)  # noqa: E731
    for row, slot in ((0, 0), (1, 17), (2, 5), (4, 40)):
        for x, cache, scales in ((k, k_cache, k_scales), (v, v_cache, v_scales)):
            want_scale = reference.kv_scales_per_token_head(x[row], dtype)
            np.testing.assert_array_equal(flat(scales)[slot], np.asarray(want_scale))
            np.testing.assert_array_equal(flat(cache)[slot],
                                          np.asarray(reference.quantize_kv(x[row], want_scale, dtype), np.float32))
    assert not flat(k_cache)[5].any() and (flat(k_scales)[5] > 0).all()  # zeros store zeros, at a positive scale
    untouched = np.setdiff1d(np.arange(64), [0, 17, 5, 40])
    assert (flat(k_scales)[untouched] == 1).all() and not flat(k_cache)[untouched].any()
    back = np.asarray(reference.dequantize_kv(k_cache, k_scales)).reshape(64, 2, 32)[[0, 17, 40]]
    exact = np.asarray(k, np.float32)[[0, 1, 4]]
    assert np.linalg.norm(back - exact) / np.linalg.norm(exact) < (0.04 if dtype == jnp.float8_e4m3fn else 0.08)


@pytest.mark.parametrize("dtype", FORMATS)
def test_reference_attends_over_the_dequantised_cache(dtype, rng):
    """The paged oracles with an FP8 cache are the oracles over its dequantised float32 cache; against the bf16
    cache the error is the format's (e4m3: ~3%, e5m2: ~6% per element, less after the softmax's average)."""
    lens = [9, 40]
    kc, vc, bt = make_paged_kv(rng, lens, 16, 2, 32, jnp.float32, poison=0.0, max_blocks=3)
    q = jnp.asarray(rng.standard_normal((2, 4, 32)), jnp.float32)
    k_scale, v_scale = 0.05, 0.02
    k8, v8 = reference.quantize_kv(kc, k_scale, dtype), reference.quantize_kv(vc, v_scale, dtype)
    seq_lens = jnp.array(lens, jnp.int32)
    out = reference.paged_decode_attention(q, k8, v8, bt, seq_lens, k_scale=k_scale, v_scale=v_scale)
    want = reference.paged_decode_attention(q, reference.dequantize_kv(k8, k_scale),
                                            reference.dequantize_kv(v8, v_scale), bt, seq_lens)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want))
    ragged = reference.paged_attention(q, k8, v8, bt, seq_lens, jnp.array([0, 1, 2], jnp.int32), k_scale=k_scale,
                                       v_scale=v_scale)
    np.testing.assert_allclose(np.asarray(ragged), np.asarray(out), rtol=1e-6, atol=1e-6)
    exact = reference.paged_decode_attention(q, kc, vc, bt, seq_lens)
    assert relative_l2(out, exact) < (0.05 if dtype == jnp.float8_e4m3fn else 0.1)


def test_fp8_errors_are_named(rng):
    k8, v8 = pa.allocate_kv_cache(2, 16, 1, 32, jnp.float8_e4m3fn)
    kb, vb = pa.allocate_kv_cache(2, 16, 1, 32)
    k = v = jnp.ones((1, 1, 32), jnp.bfloat16)
    slots = jnp.array([0], jnp.int32)
    with pytest.raises(ValueError, match=r"needs k_scale= and v_scale="):
        pa.write_kv_cache(k8, v8, k, v, slots)
    with pytest.raises(ValueError, match=r"go with an FP8 cache"):
        pa.write_kv_cache(kb, vb, k, v, slots, k_scale=1.0, v_scale=1.0)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"k_scale must be finite and positive"):
            pa.write_kv_cache(k8, v8, k, v, slots, k_scale=bad, v_scale=1.0)
    with pytest.raises(ValueError, match=r"v_scale must be a float scalar"):
        pa.write_kv_cache(k8, v8, k, v, slots, k_scale=1.0, v_scale=jnp.ones(2))
    with pytest.raises(ValueError, match=r"dtype=.*int8.* must be one of"):
        pa.allocate_kv_cache(2, 16, 1, 32, jnp.int8)
    q = jnp.ones((1, 2, 32), jnp.bfloat16)
    bt, lens, cu = jnp.zeros((1, 1), jnp.int32), jnp.array([4], jnp.int32), jnp.array([0, 1], jnp.int32)
    with pytest.raises(ValueError, match=r"needs k_scale= and v_scale=.*v_scale missing"):
        pa.paged_decode_attention(q, k8, v8, bt, lens, k_scale=1.0)
    with pytest.raises(ValueError, match=r"needs k_scale= and v_scale="):
        pa.paged_attention(q, k8, v8, bt, lens, cu, max_query_len=1)
    with pytest.raises(ValueError, match=r"go with an FP8 cache"):
        pa.paged_decode_attention(q, kb, vb, bt, lens, k_scale=1.0, v_scale=1.0)
    for bad in (0.0, -2.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"v_scale must be finite and positive"):
            pa.paged_attention(q, k8, v8, bt, lens, cu, max_query_len=1, k_scale=1.0, v_scale=bad)
    with pytest.raises(ValueError, match=r"k_scale must be a float scalar"):
        pa.paged_decode_attention(q, k8, v8, bt, lens, k_scale=jnp.ones(2), v_scale=1.0)
    with pytest.raises(TypeError, match=r"k_scale must be a float scalar"):
        pa.paged_decode_attention(q, k8, v8, bt, lens, k_scale=jnp.int32(1), v_scale=1.0)
    with pytest.raises(TypeError, match=r"k_scale must be a float scalar"):
        pa.paged_decode_attention(q, k8, v8, bt, lens, k_scale=True, v_scale=1.0)
    ks, vs = pa.allocate_kv_scales(2, 16, 1)
    with pytest.raises(ValueError, match=r"k_scale and v_scale must be both scalars .* or both scale caches"):
        pa.paged_decode_attention(q, k8, v8, bt, lens, k_scale=ks, v_scale=1.0)
    with pytest.raises(ValueError, match=r"v_scale must be .* with the caches' \[num_blocks, block_size, "
                                          r"num_kv_heads\] = \[2, 16, 1\]; got float32\[2, 8, 1\]"):
        pa.paged_attention(q, k8, v8, bt, lens, cu, max_query_len=1, k_scale=ks, v_scale=vs[:, :8])
    with pytest.raises(TypeError, match=r"k_scale must be .*float32\[num_blocks, block_size, num_kv_heads\]"):
        pa.write_kv_cache(k8, v8, k, v, slots, k_scale=ks.astype(jnp.bfloat16), v_scale=vs)
    with pytest.raises(ValueError, match=r"go with an FP8 cache"):
        pa.paged_decode_attention(q, kb, vb, bt, lens, k_scale=ks, v_scale=vs)
    k5, v5 = pa.allocate_kv_cache(2, 16, 1, 32, jnp.float8_e5m2)
    with pytest.raises(TypeError, match=r"k_cache / v_cache must share one dtype"):
        pa.paged_decode_attention(q, k8, v5, bt, lens, k_scale=1.0, v_scale=1.0)
    with pytest.raises(TypeError, match=r"k_cache / v_cache must share one dtype"):
        pa.paged_decode_attention(q, k8, vb, bt, lens, k_scale=1.0, v_scale=1.0)
    with pytest.raises(ValueError, match=r"needs k_scale= and v_scale="):
        reference.paged_decode_attention(q, k8, v8, bt, lens)
    with pytest.raises(ValueError, match=r"go with an FP8 cache"):
        reference.paged_decode_attention(q, kb, vb, bt, lens, k_scale=1.0, v_scale=1.0)


# ---------------------------------------------------------------------------------------------- the kernels
K_SCALE, V_SCALE = 0.02, 0.01  # random normal K and V: stored values around ±50 and ±100, well inside e4m3's 448

# name: (query_lens, seq_lens) per request; q_len 0 and a one-key request included.
BATCHES = {
    "decode": ([1, 1, 1, 1], [1, 17, 64, 100]),
    "verification": ([6, 6, 6], [6, 40, 97]),
    "chunked_prefill": ([20, 33], [52, 120]),
    "mixed": ([1, 6, 0, 24, 30, 1], [50, 70, 9, 24, 90, 1]),
}
# name: (block_size, num_q_heads, num_kv_heads, head_dim, q dtype)
LAYOUTS = {
    "bs16_gqa4_f32": (16, 8, 2, 64, jnp.float32),
    "bs48_gqa2_bf16": (48, 4, 2, 64, jnp.bfloat16),
    "bs64_mha_f16": (64, 2, 2, 32, jnp.float16),
}


SCALES = dict(k_scale=K_SCALE, v_scale=V_SCALE)
MODES = ["tensor", "token"]


def _quantized(rng, kc, vc, fmt, mode):
    """``(k8, v8, scales)``: per tensor (``SCALES``), or per token and head with each token's magnitude drawn from
    10^U(-2, 1) (the kernel's probabilities times value scales stay normal fp16); a slot no request owns holds NaN
    and gets a NaN scale."""
    if mode == "tensor":
        return reference.quantize_kv(kc, K_SCALE, fmt), reference.quantize_kv(vc, V_SCALE, fmt), SCALES
    spread = lambda x: x * jnp.asarray(10.0 ** rng.uniform(-2, 1, x.shape[:3] + (1,)), jnp.float32)  # noqa: E731
    kc, vc = spread(kc), spread(vc)
    ks, vs = reference.kv_scales_per_token_head(kc, fmt), reference.kv_scales_per_token_head(vc, fmt)
    return reference.quantize_kv(kc, ks, fmt), reference.quantize_kv(vc, vs, fmt), dict(k_scale=ks, v_scale=vs)


def _fp8_inputs(rng, fmt, q_lens, seq_lens, bs, hq, hkv, d, dtype, pad=3, mode="tensor"):
    """q (NaN in its padding rows), FP8 caches with NaN in every slot no request owns, the table, lengths, cu, and
    the scales (``mode``: :func:`_quantized`)."""
    kc, vc, bt = make_paged_kv(rng, seq_lens, bs, hkv, d, jnp.float32)
    k8, v8, scales = _quantized(rng, kc, vc, fmt, mode)  # NaN stays NaN
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = np.full((cu[-1] + pad, hq, d), np.nan, np.float32)
    q[: cu[-1]] = rng.standard_normal((cu[-1], hq, d))
    return jnp.asarray(q, dtype), k8, v8, bt, jnp.asarray(seq_lens, jnp.int32), jnp.asarray(cu), scales


# per-token-head scales on e4m3 over every batch and layout, on e5m2 over the decode batch
FORMAT_MODES = [(jnp.float8_e4m3fn, "tensor"), (jnp.float8_e5m2, "tensor"), (jnp.float8_e4m3fn, "token")]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("fmt, mode", FORMAT_MODES, ids=lambda x: x if isinstance(x, str) else jnp.dtype(x).name)
def test_paged_attention_reads_fp8(fmt, mode, batch, layout, rng):
    q_lens, seq_lens = BATCHES[batch]
    bs, hq, hkv, d, dtype = LAYOUTS[layout]
    q, k8, v8, bt, sl, cu, scales = _fp8_inputs(rng, fmt, q_lens, seq_lens, bs, hq, hkv, d, dtype, mode=mode)
    splits = dict(num_splits=1) if layout == "bs64_mha_f16" else dict(num_splits=3)
    out, lse = pa.paged_attention(q, k8, v8, bt, sl, cu, max_query_len=max(q_lens), return_lse=True,
                                  config=pa.DecodeConfig(block_n=16), **scales, **splits)
    ref_out, ref_lse = reference.paged_attention(q, k8, v8, bt, sl, cu, return_lse=True, **scales)
    n = sum(q_lens)
    assert_attention_close(out, ref_out, dtype=dtype, valid_rows=n)
    np.testing.assert_allclose(np.asarray(lse)[:n], np.asarray(ref_lse)[:n], rtol=1e-5, atol=1e-4)
    assert np.all(np.asarray(out, np.float32)[n:] == 0) and np.all(np.asarray(lse)[n:] == -np.inf)


@pytest.mark.parametrize("split", [dict(num_splits=1), dict(num_splits=4), dict(split_size=32), dict()])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_paged_decode_reads_fp8(fmt, mode, layout, split, rng):
    q_lens, seq_lens = BATCHES["decode"]
    bs, hq, hkv, d, dtype = LAYOUTS[layout]
    q, k8, v8, bt, sl, _, scales = _fp8_inputs(rng, fmt, q_lens, seq_lens, bs, hq, hkv, d, dtype, pad=0, mode=mode)
    out, lse = pa.paged_decode_attention(q, k8, v8, bt, sl, return_lse=True, config=pa.DecodeConfig(block_n=16),
                                         **scales, **split)
    ref_out, ref_lse = reference.paged_decode_attention(q, k8, v8, bt, sl, return_lse=True, **scales)
    assert_attention_close(out, ref_out, dtype=dtype)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_fp8_with_every_feature(fmt, mode, rng):
    """Window, soft-cap, ALiBi and sinks over an FP8 cache: the K scale sits inside the soft-cap's tanh (it is part
    of the score), the V scale outside the sink's denominator."""
    q_lens, seq_lens = BATCHES["mixed"]
    q, k8, v8, bt, sl, cu, scales = _fp8_inputs(rng, fmt, q_lens, seq_lens, 16, 4, 2, 64, jnp.float32, mode=mode)
    feats = dict(window_size=(20, 0), softcap=5.0, alibi_slopes=jnp.asarray(rng.uniform(0.01, 0.3, 4), jnp.float32),
                 sinks=jnp.asarray(rng.standard_normal(4), jnp.float32))
    out = pa.paged_attention(q, k8, v8, bt, sl, cu, max_query_len=30, num_splits=2,
                             config=pa.DecodeConfig(block_n=16), **scales, **feats)
    ref = reference.paged_attention(q, k8, v8, bt, sl, cu, **scales, **feats)
    assert_attention_close(out, ref, dtype=jnp.float32, valid_rows=sum(q_lens))


@pytest.mark.parametrize("fmt", FORMATS)
def test_per_token_scales_keep_tiny_values(fmt, rng):
    """Values near 1e-5 with per-token scales (e5m2: scales near 2e-10): the probabilities times the value scales
    would underflow fp16; the kernel scales them by the tile's largest scale first, so the output keeps the
    reference's precision with fp16 queries."""
    q_lens, seq_lens = BATCHES["verification"]
    kc, vc, bt = make_paged_kv(rng, seq_lens, 16, 2, 32, jnp.float32)
    vc = vc * 1e-5
    ks, vs = reference.kv_scales_per_token_head(kc, fmt), reference.kv_scales_per_token_head(vc, fmt)
    k8, v8 = reference.quantize_kv(kc, ks, fmt), reference.quantize_kv(vc, vs, fmt)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    q = jnp.asarray(rng.standard_normal((sum(q_lens), 4, 32)), jnp.float16)
    sl = jnp.asarray(seq_lens, jnp.int32)
    out = pa.paged_attention(q, k8, v8, bt, sl, cu, max_query_len=6, k_scale=ks, v_scale=vs,
                             config=pa.DecodeConfig(block_n=16))
    ref = reference.paged_attention(q, k8, v8, bt, sl, cu, k_scale=ks, v_scale=vs)
    assert relative_l2(out.astype(jnp.float32) * 1e5, ref * 1e5) < 1e-2


def test_scales_are_traced_not_static(rng):
    """A new scale reuses the compiled program (it is data, as a serving engine's calibration is) and still
    matters: doubling k_scale doubles every score."""
    q, k8, v8, bt, sl, _, _ = _fp8_inputs(rng, jnp.float8_e4m3fn, [1, 1], [30, 7], 16, 4, 2, 32, jnp.float32, pad=0)
    run = lambda ks, vs: pa.paged_decode_attention(q, k8, v8, bt, sl, k_scale=ks, v_scale=vs)  # noqa: E731
    run(0.02, 0.01)
    run(0.02, 0.01)  # a process's first interpreted call registers a JAX config (Pallas' fuser): one more trace
    jitted = pa.paged_decode_attention
    while not hasattr(jitted, "_cache_size"):  # the jitted function behind the argument checks
        jitted = jitted.__wrapped__
    before = jitted._cache_size()
    for ks, vs in ((0.04, 0.01), (jnp.float32(0.02), jnp.float32(0.03))):
        assert_attention_close(run(ks, vs), reference.paged_decode_attention(q, k8, v8, bt, sl, k_scale=ks,
                                                                             v_scale=vs), dtype=jnp.float32)
    assert jitted._cache_size() == before
    outer = jax.jit(lambda ks, vs: pa.paged_decode_attention(q, k8, v8, bt, sl, k_scale=ks, v_scale=vs))
    assert_attention_close(outer(0.04, 0.02), reference.paged_decode_attention(q, k8, v8, bt, sl, k_scale=0.04,
                                                                                 v_scale=0.02), dtype=jnp.float32)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name, corrupt", DECODE_SCENARIOS, ids=[s[0] for s in DECODE_SCENARIOS])
def test_fp8_corrupt_request_stays_alone(rng, name, corrupt, mode):
    """The isolation scenarios over an FP8 cache, both kernels: the other requests' outputs are bit-identical to
    the clean run's, the corrupted one's is the reference's."""
    lens, q_lens = [13, 17, 1, 16], [1, 6, 1, 1]
    kc, vc, bt = make_paged_kv(rng, lens, 4, 2, 16, jnp.float32, max_blocks=6, table_padding="neg")
    k8, v8, scales = _quantized(rng, kc, vc, jnp.float8_e4m3fn, mode)
    sl = jnp.asarray(lens, jnp.int32)
    sl_bad, bt_bad = corrupt(sl, bt, kc.shape[0])
    q = jnp.asarray(rng.standard_normal((4, 4, 16)), jnp.float32)
    decode = lambda s, t: pa.paged_decode_attention(q, k8, v8, t, s, num_splits=3, **scales)  # noqa: E731
    clean, out = decode(sl, bt), decode(sl_bad, bt_bad)
    np.testing.assert_array_equal(np.asarray(out)[[0, 2, 3]], np.asarray(clean)[[0, 2, 3]])
    assert not np.isnan(np.asarray(out)[[0, 2, 3]]).any()
    np.testing.assert_allclose(np.asarray(out), np.asarray(reference.paged_decode_attention(
        q, k8, v8, bt_bad, sl_bad, **scales)), rtol=2e-5, atol=2e-5, equal_nan=True)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    qr = jnp.asarray(rng.standard_normal((12, 4, 16)), jnp.float32)
    ragged = lambda s, t: pa.paged_attention(qr, k8, v8, t, s, cu, max_query_len=8, **scales)  # noqa: E731
    clean, out = ragged(sl, bt), ragged(sl_bad, bt_bad)
    others = np.r_[0:1, 7:12]
    np.testing.assert_array_equal(np.asarray(out)[others], np.asarray(clean)[others])
    np.testing.assert_allclose(np.asarray(out), np.asarray(reference.paged_attention(
        qr, k8, v8, bt_bad, sl_bad, cu, **scales)), rtol=2e-5, atol=2e-5, equal_nan=True)


def _needle_weight(rng, num_keys: int, fmt) -> tuple[float, float]:
    """One query, ``num_keys`` keys of which one (the needle) holds 90% of the attention over a bf16 cache (its
    score set from the other scores: ``exp(s) = 9 · Σ exp(others)``, FlashAttention 3's 91% retrieval case): its
    weight read over the bf16 cache and over an FP8 one (scales from each tensor's largest magnitude, as
    calibration sets them). The needle's value is the one-hot of channel 0 and every other value's channel 0 is 0,
    so ``out[0]`` is the weight times the needle's stored value. At 90% the weight moves by ``0.1 · Δs`` for an
    error ``Δs`` of the needle's score, so FP8's rounding of the keys moves it by 0.6% (e4m3) and 1.2% (e5m2)
    (1 σ over seeds): a 5% bound is no coin toss, while quantised probabilities (FA3's 91% → 13%) break it."""
    d, bs = 128, 16
    pages = -(-num_keys // bs)
    q = np.asarray(jnp.asarray(rng.standard_normal((1, 1, d)), jnp.bfloat16), np.float64)
    k = np.asarray(jnp.asarray(rng.standard_normal((pages, bs, 1, d)), jnp.bfloat16), np.float64)
    v = rng.standard_normal((pages, bs, 1, d))
    v[..., 0] = 0.0
    pos = int(rng.integers(num_keys))
    table = rng.permutation(pages).astype(np.int32)[None, :]
    page, slot = table[0, pos // bs], pos % bs
    scores = np.einsum("d,pbd->pb", q[0, 0], k[:, :, 0]) / np.sqrt(d)
    keys = np.zeros((pages, bs), bool)
    keys[table[0], :] = (np.arange(pages * bs).reshape(pages, bs) < num_keys)
    keys[page, slot] = False
    needle_score = np.log(9 * np.exp(scores[keys]).sum())
    k[page, slot, 0] = q[0, 0] * needle_score * np.sqrt(d) / (q[0, 0] @ q[0, 0])
    v[page, slot, 0] = np.eye(d)[0]
    q, kb, vb = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
    bt, sl = jnp.asarray(table), jnp.asarray([num_keys], jnp.int32)
    ks, vs = reference.kv_scale_per_tensor(kb, fmt), reference.kv_scale_per_tensor(vb, fmt)
    k8, v8 = reference.quantize_kv(kb, ks, fmt), reference.quantize_kv(vb, vs, fmt)
    bf16 = float(pa.paged_decode_attention(q, kb, vb, bt, sl)[0, 0, 0])
    fp8 = float(pa.paged_decode_attention(q, k8, v8, bt, sl, k_scale=ks, v_scale=vs)[0, 0, 0])
    # The needle's value 1.0 is stored to FP8's precision (up to 6% off in e4m3): divide it out, to read the weight.
    return bf16, fp8 / float(reference.dequantize_kv(v8[page, slot, 0, 0], vs))


@pytest.mark.parametrize("fmt", FORMATS)
def test_needle_keeps_its_weight(fmt, rng):
    """The retrieval failure of FP8 attention at long context (a dominant key's weight lost to a coarse scale of
    the probabilities) cannot happen here: probabilities stay bf16 and accumulate in float32; only K and V are
    FP8. 4,096 keys interpreted; 131,072 compiled (``test_needle_at_128k``)."""
    bf16, fp8 = _needle_weight(rng, 4096, fmt)
    assert 0.85 < bf16 < 0.95 and abs(fp8 - bf16) <= 0.05 * bf16, (bf16, fp8)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_needle_at_128k(fmt, rng):
    bf16, fp8 = _needle_weight(rng, 131072, fmt)
    assert 0.85 < bf16 < 0.95 and abs(fp8 - bf16) <= 0.05 * bf16, (bf16, fp8)


def test_checked_catches_a_traced_bad_scale(rng):
    """Inside the caller's jit the scales' values are unknown in front of the call: ``checked`` checks them with
    the data rules (and skips the kernel)."""
    q, k8, v8, bt, sl, _, _ = _fp8_inputs(rng, jnp.float8_e4m3fn, [1, 1], [30, 7], 16, 4, 2, 32, jnp.float32, pad=0)
    step = jax.jit(lambda ks: pa.checked(pa.paged_decode_attention)(q, k8, v8, bt, sl, k_scale=ks, v_scale=0.01))
    err, out = checkify.checkify(step)(jnp.float32(jnp.nan))
    assert "k_scale must be finite and positive" in str(err.get())
    err, out = checkify.checkify(step)(jnp.float32(0.02))
    assert err.get() is None
    assert_attention_close(out, reference.paged_decode_attention(q, k8, v8, bt, sl, **SCALES), dtype=jnp.float32)
