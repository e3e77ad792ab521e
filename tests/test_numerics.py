"""bf16 accuracy at long contexts: the kernel may be at most 2x as wrong as a plain bf16 jnp attention, both
measured against float32 attention on the same (bf16-rounded) inputs. And no NaN from exp(-inf - -inf): empty
rows, empty splits and all-masked tiles all stay finite."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_attn import paged_decode_attention, varlen_attention
from pallas_attn.core import softmax
from pallas_attn.testing import relative_l2


def _dense(q, k, v, causal, dtype, chunk=2048):
    """Dense attention computed in `dtype` end to end: q [L, H, D], k/v [S, H, D] (GQA already expanded).

    Query rows go in chunks so the [H, chunk, S] scores fit beside other tests on one GPU (32k x 32k would not)."""
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    precision = "highest" if dtype == jnp.float32 else None
    L, S = q.shape[0], k.shape[0]

    @jax.jit  # k and v are arguments: closed over, they would be baked into the program as constants
    def rows(q_chunk, start, k, v):
        s = jnp.einsum("qhd,khd->hqk", q_chunk, k, precision=precision)
        s = s * jnp.asarray(q.shape[-1] ** -0.5, dtype)
        if causal:
            q_pos = start + jnp.arange(q_chunk.shape[0]) + (S - L)
            s = jnp.where(jnp.arange(S)[None, :] <= q_pos[:, None], s, -jnp.inf)
        p = jax.nn.softmax(s, axis=-1)
        return jnp.einsum("hqk,khd->qhd", p, v, precision=precision)

    return jnp.concatenate([rows(q[i:i + chunk], i, k, v) for i in range(0, L, chunk)])


def _assert_within_2x_of_bf16_jnp(out, q, k, v, *, causal):
    """The kernel's error against float32 attention is at most twice that of a plain bf16 jnp attention."""
    group = q.shape[1] // k.shape[1]
    k, v = jnp.repeat(k, group, axis=1), jnp.repeat(v, group, axis=1)
    exact = _dense(q, k, v, causal, jnp.float32)
    baseline = relative_l2(_dense(q, k, v, causal, jnp.bfloat16), exact)
    err = relative_l2(out, exact)
    assert np.isfinite(np.asarray(out, np.float32)).all()
    assert err <= 2 * baseline, f"kernel {err:.2e} vs bf16 jnp {baseline:.2e}"


@pytest.mark.parametrize("seq_len", [pytest.param(2048, id="2k"),
                                     pytest.param(32768, id="32k", marks=pytest.mark.gpu)])
def test_prefill_bf16_error_within_2x_of_jnp_bf16(seq_len):
    key = jax.random.key(seq_len)
    hq, hkv, d = (4, 1, 64) if seq_len <= 2048 else (8, 2, 128)
    q, k, v = (jax.random.normal(jax.random.fold_in(key, i), (seq_len, h, d), jnp.float32).astype(jnp.bfloat16)
               for i, h in enumerate((hq, hkv, hkv)))
    cu = jnp.array([0, seq_len], jnp.int32)
    out = varlen_attention(q, k, v, cu, max_seqlen=seq_len)
    _assert_within_2x_of_bf16_jnp(out, q, k, v, causal=True)


@pytest.mark.parametrize("context", [pytest.param(8192, id="8k"),
                                     pytest.param(131072, id="128k", marks=pytest.mark.gpu)])
def test_decode_bf16_error_within_2x_of_jnp_bf16(context):
    key = jax.random.key(context)
    hq, hkv, d, bs = (8, 2, 64, 16) if context <= 8192 else (32, 8, 128, 16)
    k = jax.random.normal(jax.random.fold_in(key, 1), (context, hkv, d), jnp.float32).astype(jnp.bfloat16)
    v = jax.random.normal(jax.random.fold_in(key, 2), (context, hkv, d), jnp.float32).astype(jnp.bfloat16)
    q = jax.random.normal(jax.random.fold_in(key, 3), (1, hq, d), jnp.float32).astype(jnp.bfloat16)
    pages = context // bs
    perm = jax.random.permutation(jax.random.fold_in(key, 4), pages).astype(jnp.int32)
    k_cache = jnp.zeros((pages, bs, hkv, d), jnp.bfloat16).at[perm].set(k.reshape(pages, bs, hkv, d))
    v_cache = jnp.zeros((pages, bs, hkv, d), jnp.bfloat16).at[perm].set(v.reshape(pages, bs, hkv, d))
    out = paged_decode_attention(q, k_cache, v_cache, perm[None], jnp.array([context], jnp.int32))
    _assert_within_2x_of_bf16_jnp(out, q, k, v, causal=False)


def test_no_nan_from_empty_rows_splits_and_tiles():
    """Context 0, splits that own no key, and fully masked rows: outputs 0 / finite, LSE -inf only where empty."""
    q = jnp.ones((3, 4, 64), jnp.float32)
    cache = jnp.ones((4, 16, 2, 64), jnp.float32)
    tables = jnp.array([[0, 1, 2, 3], [1, -1, -1, -1], [-7, 9, 9, 9]], jnp.int32)
    out, lse = paged_decode_attention(q, cache, cache, tables, jnp.array([64, 3, 0], jnp.int32), num_splits=8,
                                      return_lse=True)
    out, lse = np.asarray(out), np.asarray(lse)
    assert np.isfinite(out).all() and np.all(out[2] == 0)
    assert np.all(lse[2] == -np.inf) and np.isfinite(lse[:2]).all()


def _softmax_state(rng, cols: int, mask_from: int):
    """``(m [8], l [8], s [8, cols])`` for one softmax step: row 2 masked from column ``mask_from`` (a diagonal tile),
    row 5 sees no key (its m stays -inf, l 0), every third row meets its first tile (m = -inf)."""
    s = rng.normal(0, 4, (8, cols)).astype(np.float32)
    s[2, mask_from:] = -np.inf
    s[5] = -np.inf
    m = np.where(np.arange(8) % 3 == 0, -np.inf, rng.normal(0, 2, 8)).astype(np.float32)
    m[5] = -np.inf
    l = np.where(m == -np.inf, 0.0, rng.uniform(1, 5, 8)).astype(np.float32)
    return m, l, s


@pytest.mark.parametrize("scale", [0.088 * 1.4427, 1.0 / 3.0, 7.5])
def test_softmax_update_with_folded_scale_matches_prescaled(scale):
    """``softmax_update(..., scale=c)`` on raw scores (the Mosaic prefill's form: the row max on raw scores, the scale
    in the exponent's FMA) against the same update on pre-scaled scores: the running max bit for bit, the rest to
    float32 rounding; masked entries and a fully masked row (first tile: m = -inf) give p = 0, never NaN."""
    m, l, s = _softmax_state(np.random.default_rng(0), cols=32, mask_from=5)
    folded = softmax.softmax_update(jnp.asarray(m), jnp.asarray(l), jnp.asarray(s), scale=scale)
    prescaled = softmax.softmax_update(jnp.asarray(m), jnp.asarray(l), jnp.asarray(s * np.float32(scale)))
    np.testing.assert_array_equal(np.asarray(folded[0]), np.asarray(prescaled[0]))  # m_new
    for got, want in zip(folded[1:], prescaled[1:]):  # alpha, p, l_new
        got, want = np.asarray(got), np.asarray(want)
        assert not np.isnan(got).any()
        np.testing.assert_allclose(got, want, rtol=2e-6, atol=0)
    assert np.all(np.asarray(folded[2])[5] == 0) and np.asarray(folded[3])[5] == 0


@pytest.mark.parametrize("chunks", [1, 2, 4])
@pytest.mark.parametrize("scale", [None, 0.088 * 1.4427])
def test_softmax_update_packed_matches_softmax_update(chunks, scale):
    """``softmax_update_packed`` (the Mosaic prefill's ``p_chunks`` knob: exponentials summed and packed a column
    block at a time) against ``softmax_update``: the running max and alpha bit for bit, ``p`` the same bf16 values,
    the row sum to float32 rounding; a masked block and a row with no visible key stay 0, never NaN."""
    m, l, s = _softmax_state(np.random.default_rng(1), cols=64, mask_from=20)  # the mask crosses blocks
    args = (jnp.asarray(m), jnp.asarray(l), jnp.asarray(s))
    m_new, alpha, p16, l_new = softmax.softmax_update_packed(*args, jnp.bfloat16, chunks, scale=scale)
    want_m, want_alpha, want_p, want_l = softmax.softmax_update(*args, scale=scale)
    np.testing.assert_array_equal(np.asarray(m_new), np.asarray(want_m))
    np.testing.assert_array_equal(np.asarray(alpha), np.asarray(want_alpha))
    assert p16.dtype == jnp.bfloat16 and p16.shape == s.shape
    np.testing.assert_array_equal(np.asarray(p16, np.float32), np.asarray(want_p.astype(jnp.bfloat16), np.float32))
    assert not np.isnan(np.asarray(l_new)).any()
    np.testing.assert_allclose(np.asarray(l_new), np.asarray(want_l), rtol=2e-6, atol=0)
    assert np.all(np.asarray(p16, np.float32)[5] == 0) and np.asarray(l_new)[5] == 0


@pytest.mark.parametrize("stride", [1, 2, 3])
@pytest.mark.parametrize("bounds", [(0, 0, 5, 5), (3, None, 9, 12), (2, 4, 7, 11), (5, 6, 6, 6), (1, 1, 1, 2)])
def test_kv_loop_shares_each_tile_once(stride, bounds):
    """``kv_loop(..., stride=n, phase=w)`` over workers ``w < n``: every tile of ``[tile_start, kv_end)`` runs once,
    by worker ``(j - tile_start) % n``, masked exactly where the one-worker loop masks it."""
    tile_start, full_start, full_end, kv_end = bounds

    def record(j, seen, masked):
        return seen.at[j].add(jnp.where(masked, 10, 1))

    whole = softmax.kv_loop(jnp.zeros(16, jnp.int32), tile_start, full_end, kv_end, record, full_start)
    parts = []
    for w in range(stride):
        part = softmax.kv_loop(jnp.zeros(16, jnp.int32), tile_start, full_end, kv_end, record, full_start,
                               stride=stride, phase=jnp.int32(w))
        owned = (np.arange(16) >= tile_start) & (np.arange(16) < kv_end) & ((np.arange(16) - tile_start) % stride == w)
        assert np.all(np.asarray(part)[~owned] == 0)
        parts.append(np.asarray(part))
    np.testing.assert_array_equal(sum(parts), np.asarray(whole))


def test_merge_states_matches_one_pass():
    """Two states over disjoint key sets merged (the Mosaic paged kernel's two compute warpgroups) against one
    state over all keys: rows with keys in one set only, in neither (0 and -inf, never NaN) and in both."""
    rng = np.random.default_rng(2)
    s = rng.normal(0, 3, (6, 40)).astype(np.float32)
    v = rng.normal(size=(40, 8)).astype(np.float32)
    s[1, 20:] = -np.inf  # row 1: keys in the first set only
    s[2, :20] = -np.inf  # row 2: in the second only
    s[3] = -np.inf  # row 3: none

    def state(cols):
        m0, l0 = jnp.full((6,), -jnp.inf), jnp.zeros((6,))
        m, alpha, p, l = softmax.softmax_update(m0, l0, jnp.asarray(s[:, cols]))
        return p @ v[cols], m, l

    acc, m, l = softmax.merge_states(state(slice(0, 20)), state(slice(20, 40)))
    want_acc, want_m, want_l = state(slice(0, 40))
    for got, want in ((acc, want_acc), (m, want_m), (l, want_l)):
        assert not np.isnan(np.asarray(got)).any()
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
