"""varlen_attention against the reference: compositions with 0, 1, tile±1 and long requests, GQA 1/4/8, head dims
from 64 to 512 (80, 96, 192, 320: padded inside), causal and not, LSE, isolation, padding rows, recompilation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_attn import PrefillConfig, reference, varlen_attention
from pallas_attn.testing import assert_attention_close, random_packed

SMALL = PrefillConfig(block_m=16, block_n=16, num_warps=4, num_stages=2)

# name: (lens, num_q_heads, num_kv_heads, head_dim, causal, dtype, config); tiles are 16 rows = 16/hp tokens.
SCENARIOS = {
    "edges_mha": ([0, 1, 15, 16, 17, 50], 2, 2, 64, True, jnp.float32, SMALL),
    "edges_gqa4": ([17, 0, 1, 3, 4, 5, 40], 8, 2, 64, True, jnp.float32, SMALL),
    "edges_gqa8_mqa": ([9, 1, 2, 33], 8, 1, 64, True, jnp.float32, SMALL),
    "noncausal_gqa4": ([0, 1, 15, 16, 17, 50], 4, 1, 64, False, jnp.float32, SMALL),
    "d80_padded": ([7, 31, 1], 4, 2, 80, True, jnp.float32, SMALL),
    "d96_noncausal": ([19, 4], 2, 1, 96, False, jnp.float32, SMALL),
    "d128_bf16": ([65, 3, 0, 30], 8, 2, 128, True, jnp.bfloat16, PrefillConfig(block_m=32, block_n=16)),
    "d192_fp16": ([21, 2], 4, 4, 192, True, jnp.float16, SMALL),
    "d256_bf16": ([18, 1], 2, 1, 256, True, jnp.bfloat16, SMALL),
    "d320_gqa2": ([9, 1, 17], 4, 2, 320, True, jnp.float32, SMALL),
    "d512_bf16_default": ([33, 2, 0], 2, 1, 512, True, jnp.bfloat16, None),  # heads padded to 512: their own tiles
    "d512_noncausal_default": ([20, 5], 2, 2, 512, False, jnp.float32, None),
    "gqa6_not_pow2": ([13, 20], 12, 2, 64, True, jnp.float32, SMALL),
    "default_config": ([130, 7], 4, 2, 64, True, jnp.float32, None),
}


def _inputs(rng, lens, hq, hkv, d, dtype, pad=3):
    total = sum(lens) + pad
    q, cu = random_packed(rng, lens, hq, d, dtype, pad_to=total)
    k, _ = random_packed(rng, lens, hkv, d, dtype, pad_to=total)
    v, _ = random_packed(rng, lens, hkv, d, dtype, pad_to=total)
    return q, k, v, cu


@pytest.mark.parametrize("name", SCENARIOS)
def test_matches_reference(name, rng):
    lens, hq, hkv, d, causal, dtype, cfg = SCENARIOS[name]
    q, k, v, cu = _inputs(rng, lens, hq, hkv, d, dtype)
    max_seqlen = max(lens)
    out, lse = varlen_attention(q, k, v, cu, max_seqlen=max_seqlen, causal=causal, return_lse=True, config=cfg)
    ref_out, ref_lse = reference.varlen_attention(q, k, v, cu, causal=causal, return_lse=True)
    n = sum(lens)
    assert out.dtype == q.dtype and out.shape == q.shape and lse.shape == q.shape[:2]
    assert_attention_close(out, ref_out, dtype=dtype, valid_rows=n)
    np.testing.assert_allclose(np.asarray(lse)[:n], np.asarray(ref_lse)[:n], rtol=1e-5, atol=1e-4)
    # Padding rows (NaN inputs there) come back as finite zeros, LSE -inf.
    assert np.all(np.asarray(out, np.float32)[n:] == 0)
    assert np.all(np.asarray(lse)[n:] == -np.inf)


def test_isolation_bit_identical(rng):
    """Changing one request's K/V (to huge values) leaves every other request's output bit-identical."""
    lens = [20, 33, 1, 17]
    q, k, v, cu = _inputs(rng, lens, 8, 2, 64, jnp.bfloat16)
    run = lambda k, v: np.asarray(varlen_attention(q, k, v, cu, max_seqlen=64, config=SMALL), np.float32)
    before = run(k, v)
    lo, hi = int(cu[1]), int(cu[2])  # request 1
    after = run(k.at[lo:hi].set(1e30), v.at[lo:hi].set(jnp.nan))
    others = np.r_[0:lo, hi:sum(lens)]
    np.testing.assert_array_equal(before[others], after[others])


def test_one_compile_per_bucket(rng):
    """Three batches with different lengths but one bucket (T, num_seqs, max_seqlen) share one program."""
    traces = []

    @jax.jit
    def step(q, k, v, cu):
        traces.append(1)
        return varlen_attention(q, k, v, cu, max_seqlen=64, config=SMALL)

    for lens in ([10, 20, 30], [64, 1, 0], [5, 5, 50]):
        q, k, v, cu = _inputs(rng, lens, 4, 2, 64, jnp.float32, pad=100 - sum(lens))
        ref_out = reference.varlen_attention(q, k, v, cu)
        assert_attention_close(step(q, k, v, cu), ref_out, dtype=jnp.float32, valid_rows=sum(lens))
    assert len(traces) == 1


@pytest.mark.parametrize("bad, match", [
    (dict(cu=np.array([0, 4], np.int16)), "cu_seqlens must be int32"),
    (dict(k_heads=3), "num_q_heads=4 must be a positive multiple of num_kv_heads=3"),
    (dict(d=100), "head_dim=100 unsupported"),
    (dict(d=520), r"head_dim=520 unsupported; need a multiple of 8 in \[16, 512\]"),
    (dict(v_dtype=jnp.float16), "must share one dtype"),
])
def test_bad_input_raises(bad, match, rng):
    d = bad.get("d", 64)
    q = jnp.ones((4, 4, d), jnp.float32)
    k = jnp.ones((4, bad.get("k_heads", 2), d), jnp.float32)
    v = k.astype(bad.get("v_dtype", jnp.float32))
    cu = jnp.asarray(bad.get("cu", np.array([0, 4], np.int32)))
    with pytest.raises((ValueError, TypeError), match=match):
        varlen_attention(q, k, v, cu, max_seqlen=4)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_long_compiled_default_config(dtype, rng):
    lens = [2049, 1, 128, 127, 700, 0, 1500]
    q, k, v, cu = _inputs(rng, lens, 32, 8, 128, dtype)
    out = varlen_attention(q, k, v, cu, max_seqlen=4096)
    # The reference on the first two KV heads' groups only (heads are independent): on all 32 heads it took 47 s on
    # the GPU machine's host, against a 3 s compile, and timed the test out among parallel workers.
    ref_out = reference.varlen_attention(q[:, :8], k[:, :2], v[:, :2], cu)
    assert_attention_close(out[:, :8], ref_out, dtype=dtype, valid_rows=sum(lens))


def test_batch_invariance_position_and_company(rng):
    """A request's output is bit-identical alone, among other requests, or at another place in the packed tensor."""
    lens = [37, 5, 64, 1, 20]
    q, k, v, cu = _inputs(rng, lens, 8, 2, 64, jnp.bfloat16, pad=0)
    run = lambda q, k, v, cu: np.asarray(varlen_attention(q, k, v, cu, max_seqlen=64, config=SMALL), np.float32)
    full = run(q, k, v, cu)
    lo, hi = int(cu[2]), int(cu[3])  # request 2 (64 tokens)
    alone = run(q[lo:hi], k[lo:hi], v[lo:hi], jnp.array([0, hi - lo], jnp.int32))
    np.testing.assert_array_equal(full[lo:hi], alone)
    order = [2, 0, 4, 1, 3]  # request 2 moves to the front
    pieces = [slice(int(cu[i]), int(cu[i + 1])) for i in order]
    cat = lambda x: jnp.concatenate([x[p] for p in pieces])
    moved_cu = jnp.asarray(np.concatenate([[0], np.cumsum([lens[i] for i in order])]), jnp.int32)
    moved = run(cat(q), cat(k), cat(v), moved_cu)
    np.testing.assert_array_equal(full[lo:hi], moved[: hi - lo])


@pytest.mark.parametrize("backend", ["triton", "mosaic"])
def test_no_tokens_gives_empty_outputs(backend):
    """``T = 0`` (an empty prefill batch) returns empty outputs instead of failing inside a gather."""
    q, k = jnp.zeros((0, 4, 64), jnp.bfloat16), jnp.zeros((0, 2, 64), jnp.bfloat16)
    out, lse = varlen_attention(q, k, k, jnp.zeros((2,), jnp.int32), max_seqlen=1, return_lse=True, backend=backend)
    assert out.shape == (0, 4, 64) and out.dtype == q.dtype and lse.shape == (0, 4) and lse.dtype == jnp.float32
