"""FP8 paged caches, first the definition: ``reference.quantize_kv`` / ``dequantize_kv`` (vLLM's per-tensor
scale: stored = value / scale, read = stored · scale), the paged oracles over a dequantised cache, the write
through ``write_kv_cache(k_scale=, v_scale=)``, and the named errors (the kernels do not read FP8 caches yet)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import pallas_attn as pa
from pallas_attn import reference
from pallas_attn.testing import make_paged_kv, relative_l2

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
    bt, lens = jnp.zeros((1, 1), jnp.int32), jnp.array([4], jnp.int32)
    with pytest.raises(TypeError, match=r"k_cache is float8_e4m3fn: the paged kernels do not read FP8"):
        pa.paged_decode_attention(q, k8, v8, bt, lens)
    with pytest.raises(TypeError, match=r"do not read FP8"):
        pa.paged_attention(q, k8, v8, bt, lens, jnp.array([0, 1], jnp.int32), max_query_len=1)
    with pytest.raises(ValueError, match=r"needs k_scale= and v_scale="):
        reference.paged_decode_attention(q, k8, v8, bt, lens)
    with pytest.raises(ValueError, match=r"go with an FP8 cache"):
        reference.paged_decode_attention(q, kb, vb, bt, lens, k_scale=1.0, v_scale=1.0)
