"""pallas_attn.testing: the comparison passes and fails as it should; hostile inputs are poisoned exactly."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_attn.testing import (
    TOLERANCES,
    assert_attention_close,
    make_paged_kv,
    poisoned_like,
    random_packed,
    relative_l2,
)


def noisy(ref, rel, seed=0):
    """`ref` plus noise of relative L2 size `rel` (exactly)."""
    noise = np.random.default_rng(seed).standard_normal(ref.shape)
    return ref + rel * np.linalg.norm(ref) / np.linalg.norm(noise) * noise


REF = np.random.default_rng(42).standard_normal((6, 4, 16)).astype(np.float64)


# ------------------------------------------------------------------------------------------------- comparison


def test_relative_l2():
    assert relative_l2(REF, REF) == 0.0
    assert relative_l2(noisy(REF, 3e-3), REF) == pytest.approx(3e-3)
    assert relative_l2(np.ones(3), np.zeros(3)) == pytest.approx(np.sqrt(3))  # zero ref: absolute error
    out = REF.copy()
    out[4:] = np.nan
    assert relative_l2(out, REF, valid=4) == 0.0
    assert relative_l2(out, REF, valid=np.array([True, True, False, True, False, False])) == 0.0
    with pytest.raises(ValueError, match=r"valid=7 must lie in \[0, 6\]"):
        relative_l2(REF, REF, valid=7)
    with pytest.raises(ValueError, match="bool\\[6\\] row mask"):
        relative_l2(REF, REF, valid=np.ones(5, bool))


def test_tolerance_table():
    assert TOLERANCES == {np.dtype(jnp.float32): 1e-5, np.dtype(jnp.float16): 5e-3, np.dtype(jnp.bfloat16): 1e-2}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
def test_passes_below_and_fails_above_the_dtype_tolerance(dtype):
    tol = TOLERANCES[np.dtype(dtype)]
    assert_attention_close(noisy(REF, 0.5 * tol), REF, dtype=dtype)
    with pytest.raises(AssertionError, match=f"relative L2 error {2 * tol:.3e} > rtol={tol:.1e}"):
        assert_attention_close(noisy(REF, 2 * tol), REF, dtype=dtype)


def test_dtype_defaults_to_out_dtype_and_rtol_overrides():
    out = jnp.asarray(noisy(REF, 4e-3), jnp.bfloat16)
    assert_attention_close(out, REF.astype(np.float32))  # bf16 output: the bf16 tolerance
    with pytest.raises(AssertionError, match="input dtype float32"):
        assert_attention_close(out, REF, dtype=jnp.float32)  # a float32 kernel must do better
    assert_attention_close(noisy(REF, 1e-3), REF, dtype=jnp.float32, rtol=2e-3)
    with pytest.raises(ValueError, match="no tolerance for dtype=int8"):
        assert_attention_close(REF, REF, dtype=jnp.int8)


def test_nan_fails_with_count_and_place():
    out = REF.copy()
    out[2, 1, 3] = np.nan
    out[5, 0, 0] = np.inf
    with pytest.raises(AssertionError) as info:
        assert_attention_close(out, REF, dtype=jnp.float32, rtol=1.0)  # fails even with a huge tolerance
    message = str(info.value)
    assert "out has 2 non-finite values (NaN: 1, Inf: 1) in 2 of 6 compared rows" in message
    assert "rows [2, 5]" in message and "(2, 1, 3)" in message


def test_nan_in_reference_fails():
    ref = REF.copy()
    ref[0, 0, 0] = -np.inf
    with pytest.raises(AssertionError, match="ref has 1 non-finite"):
        assert_attention_close(REF, ref, dtype=jnp.float32)


def test_valid_rows_ignores_padding():
    out = REF.copy()
    out[4:] = np.nan  # padding rows: unspecified
    assert_attention_close(out, REF, dtype=jnp.float32, valid_rows=4)
    with pytest.raises(AssertionError, match=r"in 1 of 5 compared rows \(valid_rows=5\)"):
        assert_attention_close(out, REF, dtype=jnp.float32, valid_rows=5)


def test_out_lse_tuple_is_named():
    """``(out, lse)`` from ``return_lse=True`` passed as ``out`` or ``ref``: a TypeError saying what to pass."""
    out, lse = np.ones((4, 2, 8), np.float32), np.zeros((4, 2), np.float32)
    with pytest.raises(TypeError, match=r"out must be one array; got a tuple of 2: pass out\[0\] .* compare the LSE "
                                        r"separately"):
        assert_attention_close((out, lse), out)
    with pytest.raises(TypeError, match=r"ref must be one array; got a tuple of 2: pass ref\[0\]"):
        assert_attention_close(out, (out, lse))


def test_shape_mismatch_fails():
    with pytest.raises(AssertionError):
        assert_attention_close(REF[:5], REF)


# ----------------------------------------------------------------------------------------------- hostile inputs


@pytest.mark.parametrize("num_kv_heads", [2, None])
@pytest.mark.parametrize("seq_lens", [[5, 0, 16, 1], [33]])
def test_make_paged_kv_poisons_exactly_what_no_request_owns(seq_lens, num_kv_heads):
    block_size, head_dim = 8, 16
    k_cache, v_cache, tables = make_paged_kv(
        np.random.default_rng(0), seq_lens, block_size, num_kv_heads, head_dim, jnp.float32)
    pages = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(pages) + 3
    head_shape = (head_dim,) if num_kv_heads is None else (num_kv_heads, head_dim)
    assert k_cache.shape == (num_blocks, block_size, *head_shape) and k_cache.dtype == jnp.float32
    assert tables.shape == (len(seq_lens), max(pages) + 1) and tables.dtype == jnp.int32
    assert (v_cache is None) == (num_kv_heads is None)

    owned = np.zeros((num_blocks, block_size), bool)
    owned_pages = []
    for i, s in enumerate(seq_lens):
        for pos in range(s):
            owned[tables[i, pos // block_size], pos % block_size] = True
        owned_pages += np.asarray(tables[i, : pages[i]]).tolist()
    assert sorted(owned_pages) == sorted(set(owned_pages)) and all(0 <= p < num_blocks for p in owned_pages)
    for cache in (k_cache, v_cache) if v_cache is not None else (k_cache,):
        values = np.asarray(cache)
        assert np.isfinite(values[owned]).all()
        assert np.isnan(values[~owned]).all()  # other pages, free pages, the tail of each last page
        assert values[owned].std() > 0.5  # random normal, not zeros
    if v_cache is not None:
        assert not np.array_equal(k_cache, v_cache)  # independent draws


def test_make_paged_kv_shuffles_pages():
    _, _, tables = make_paged_kv(np.random.default_rng(1), [64, 64], 4, 1, 8, jnp.float32, extra_blocks=0)
    owned = np.asarray(tables[:, :16]).ravel()
    assert sorted(owned.tolist()) == list(range(32)) and owned.tolist() != list(range(32))


def test_make_paged_kv_table_padding():
    rng = np.random.default_rng(2)
    seq_lens = [1, 0, 3, 2] * 25
    _, _, tables = make_paged_kv(rng, seq_lens, 1, 1, 8, jnp.float32, max_blocks=8)
    num_blocks = sum(seq_lens) + 3
    padding = np.concatenate([np.asarray(tables[i, s:]) for i, s in enumerate(seq_lens)])
    assert (padding == -1).any()
    assert ((padding >= 0) & (padding < num_blocks)).any()  # real pages, other requests'
    assert (padding >= num_blocks).any()  # past the pool
    assert (padding < -1).any()  # negative, not the sentinel
    _, _, tables = make_paged_kv(rng, seq_lens, 1, 1, 8, jnp.float32, max_blocks=8, table_padding="neg")
    assert all((np.asarray(tables[i, s:]) == -1).all() for i, s in enumerate(seq_lens))


@pytest.mark.parametrize("dtype, poison, expected", [
    (jnp.bfloat16, 1e30, 1e30), (jnp.float32, -1e30, -1e30), (jnp.float16, 1e30, np.inf)])
def test_make_paged_kv_poison_value(dtype, poison, expected):
    k_cache, _, tables = make_paged_kv(np.random.default_rng(3), [3], 4, 1, 8, dtype, poison=poison)
    assert k_cache.dtype == dtype
    tail = np.asarray(k_cache[int(tables[0, 0]), 3], np.float64)  # position 3 of the only page: unowned
    np.testing.assert_allclose(tail, expected, rtol=1e-2)


MAKE_ERRORS = {
    "table_padding": (dict(table_padding="zeros"), "table_padding='zeros' must be 'garbage' or 'neg'"),
    "extra_blocks": (dict(extra_blocks=-1), "extra_blocks=-1 must be non-negative"),
    "empty": (dict(seq_lens=[0], extra_blocks=0), "own no pages"),
    "max_blocks": (dict(max_blocks=1), "max_blocks=1 is smaller than the pages of the longest request (2)"),
    "seq_lens": (dict(seq_lens=[3, -1]), "seq_lens must be a 1-D sequence of non-negative ints"),
}


@pytest.mark.parametrize("name", MAKE_ERRORS)
def test_make_paged_kv_errors(name):
    change, words = MAKE_ERRORS[name]
    args = dict(rng=np.random.default_rng(0), seq_lens=[5], block_size=4, num_kv_heads=1, head_dim=8,
                dtype=jnp.float32)
    args.update(change)
    with pytest.raises(ValueError) as info:
        make_paged_kv(**args)
    assert words in str(info.value), str(info.value)


def test_random_packed():
    x, cu = random_packed(np.random.default_rng(4), [3, 0, 5], 2, 16, jnp.bfloat16, pad_to=12)
    assert x.shape == (12, 2, 16) and x.dtype == jnp.bfloat16
    assert cu.dtype == jnp.int32 and cu.tolist() == [0, 3, 3, 8]
    assert jnp.isfinite(x[:8]).all() and jnp.isnan(x[8:]).all()
    x, _ = random_packed(np.random.default_rng(4), [2], 1, 8, jnp.float32)
    assert x.shape == (2, 1, 8) and jnp.isfinite(x).all()
    with pytest.raises(ValueError, match=r"pad_to=4 is smaller than sum\(lens\)=8"):
        random_packed(np.random.default_rng(4), [3, 5], 2, 16, jnp.float32, pad_to=4)
    with pytest.raises(ValueError, match="lens must be a 1-D sequence"):
        random_packed(np.random.default_rng(4), [[3]], 2, 16, jnp.float32)


def test_poisoned_like():
    x = poisoned_like(jnp.zeros((3, 2), jnp.bfloat16))
    assert x.shape == (3, 2) and x.dtype == jnp.bfloat16 and jnp.isnan(x).all()
    with pytest.raises(ValueError, match="floating dtype"):
        poisoned_like(jnp.zeros(3, jnp.int32))
