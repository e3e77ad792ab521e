"""Paged KV cache: allocation, write through slot_mapping (against a numpy loop), gather round trip."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_attn.core.cache import allocate_kv_cache, gather_kv, write_kv_cache
from pallas_attn.core.metadata import build_metadata

NUM_KV_HEADS, HEAD_DIM = 2, 8


def write_by_loop(cache, rows, slot_mapping):
    cache = np.array(cache, copy=True)
    block_size = cache.shape[1]
    for t, slot in enumerate(np.asarray(slot_mapping).tolist()):
        if slot >= 0:
            cache[slot // block_size, slot % block_size] = rows[t]
    return cache


def random_caches(rng, num_blocks, block_size, dtype=np.float32, v_dim=HEAD_DIM):
    k = rng.standard_normal((num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)).astype(dtype)
    v = rng.standard_normal((num_blocks, block_size, NUM_KV_HEADS, v_dim)).astype(dtype)
    return k, v


def test_allocate_kv_cache():
    k_cache, v_cache = allocate_kv_cache(5, 16, 2, 64)
    assert k_cache.shape == v_cache.shape == (5, 16, 2, 64)
    assert k_cache.dtype == v_cache.dtype == jnp.bfloat16
    assert not jnp.any(k_cache) and not jnp.any(v_cache)
    assert allocate_kv_cache(1, 1, 1, 8, jnp.float32)[0].dtype == jnp.float32


@pytest.mark.parametrize("bad", [dict(num_blocks=0), dict(head_dim=8.0), dict(block_size=True)])
def test_allocate_kv_cache_rejects(bad):
    args = {**dict(num_blocks=2, block_size=4, num_kv_heads=1, head_dim=8), **bad}
    name = next(iter(bad))
    with pytest.raises(ValueError, match=f"{name}=.* must be a positive int"):
        allocate_kv_cache(**args)


@pytest.mark.parametrize("block_size", [48, 544, 1024])
def test_allocate_kv_cache_any_multiple_of_16(block_size):
    assert allocate_kv_cache(2, block_size, 1, 320, jnp.float32)[0].shape == (2, block_size, 1, 320)


@pytest.mark.parametrize("block_size", [12, 24, 1040])
def test_allocate_kv_cache_rejects_a_page_the_kernels_refuse(block_size):
    with pytest.raises(ValueError, match=rf"block_size={block_size} \(tokens per page, cache axis 1\) unsupported; "
                                         r"need a power of two up to 16 or a multiple of 16 up to 1024"):
        allocate_kv_cache(2, block_size, 1, 8)


@pytest.mark.parametrize("block_size, head_dim", [(48, 320), (544, 512)])
def test_write_and_gather_pages_of_any_multiple_of_16(block_size, head_dim):
    """Pages of 48 and 544 tokens (not powers of two), heads of 320 and 512: the write lands where the slot formula
    says, and each request reads back through its table."""
    rng = np.random.default_rng(5)
    query_lens, context_lens = [50, 1, 0, 600], [47, 543, 0, 0]  # across page ends
    md = build_metadata(query_lens, context_lens, block_size, seed=6)
    num_blocks = int(md.block_tables.max()) + 2
    k_cache, v_cache = allocate_kv_cache(num_blocks, block_size, 1, head_dim, jnp.float32)
    k = rng.standard_normal((md.num_tokens, 1, head_dim)).astype(np.float32)
    want = write_by_loop(np.zeros(k_cache.shape, np.float32), k, md.slot_mapping)
    new_k, new_v = write_kv_cache(k_cache, v_cache, k, -k, md.slot_mapping)
    np.testing.assert_array_equal(new_k, want)
    np.testing.assert_array_equal(new_v, -want)
    for i, (n, c) in enumerate(zip(query_lens, context_lens)):
        start = int(md.cu_query_lens[i])
        np.testing.assert_array_equal(gather_kv(new_k, md.block_tables[i], c + n)[c:], k[start:start + n])


@pytest.mark.parametrize("v_dim", [HEAD_DIM, 4])
def test_write_matches_loop_and_skips_padding(v_dim):
    rng = np.random.default_rng(0)
    md = build_metadata([5, 1, 0, 7], [3, 20, 2, 0], 4, num_blocks=16, seed=2)  # rows past 13 are padding (-1)
    assert (md.slot_mapping[13:] == -1).all()
    k_cache, v_cache = random_caches(rng, 16, 4, v_dim=v_dim)
    k = rng.standard_normal((md.num_tokens, NUM_KV_HEADS, HEAD_DIM)).astype(np.float32)
    v = rng.standard_normal((md.num_tokens, NUM_KV_HEADS, v_dim)).astype(np.float32)
    want_k, want_v = write_by_loop(k_cache, k, md.slot_mapping), write_by_loop(v_cache, v, md.slot_mapping)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no donation warning, no other
        new_k, new_v = write_kv_cache(jnp.asarray(k_cache), jnp.asarray(v_cache), k, v, md.slot_mapping)
    np.testing.assert_array_equal(new_k, want_k)
    np.testing.assert_array_equal(new_v, want_v)


def test_write_is_donated_and_exact_in_bf16():
    rng = np.random.default_rng(1)
    k_cache, v_cache = allocate_kv_cache(4, 2, NUM_KV_HEADS, HEAD_DIM, jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((3, NUM_KV_HEADS, HEAD_DIM)), jnp.float32)  # cast to the cache dtype
    slots = jnp.array([7, -1, 0], jnp.int32)
    new_k, new_v = write_kv_cache(k_cache, v_cache, k, k, slots)
    assert k_cache.is_deleted() and v_cache.is_deleted()  # donated: the old buffers are gone
    assert new_k.dtype == jnp.bfloat16
    np.testing.assert_array_equal(new_k[3, 1], k[0].astype(jnp.bfloat16))
    np.testing.assert_array_equal(new_k[0, 0], k[2].astype(jnp.bfloat16))
    assert int(jnp.count_nonzero(new_v)) == 2 * NUM_KV_HEADS * HEAD_DIM  # row 1 (slot -1) written nowhere


def test_write_drops_every_out_of_pool_slot():
    k_cache, v_cache = allocate_kv_cache(2, 4, 1, 8, jnp.float32)
    rows = jnp.ones((4, 1, 8))
    new_k, _ = write_kv_cache(k_cache, v_cache, rows, rows, jnp.array([-1, -5, 8, 2**30], jnp.int32))
    assert not jnp.any(new_k)  # -1 would otherwise wrap to the last slot, 8 is one past the pool


def test_write_under_jit():
    rng = np.random.default_rng(2)
    md = build_metadata([3, 2], [1, 6], 2, seed=4)
    k_cache, v_cache = random_caches(rng, md.block_tables.max() + 1, 2)
    k = rng.standard_normal((md.num_tokens, NUM_KV_HEADS, HEAD_DIM)).astype(np.float32)

    @jax.jit
    def step(k_cache, v_cache, k, md):
        return write_kv_cache(k_cache, v_cache, k, 2 * k, md.slot_mapping)

    new_k, new_v = step(jnp.asarray(k_cache), jnp.asarray(v_cache), k, md)
    np.testing.assert_array_equal(new_k, write_by_loop(k_cache, k, md.slot_mapping))
    np.testing.assert_array_equal(new_v, write_by_loop(v_cache, 2 * k, md.slot_mapping))


SHAPE_ERRORS = {
    "cache_rank": (dict(k_cache=np.zeros((2, 4, 8))), "must be [num_blocks, block_size, num_kv_heads, head_dim]"),
    "cache_mismatch": (dict(v_cache=np.zeros((3, 4, 2, 8))), "must agree on [num_blocks, block_size, num_kv_heads]"),
    "slot_mapping_rank": (dict(slot_mapping=np.zeros((3, 1), np.int32)), "slot_mapping (3, 1) int32 must be integer"),
    "slot_mapping_dtype": (dict(slot_mapping=np.zeros(3, np.float32)), "slot_mapping (3,) float32"),
    "k_shape": (dict(k=np.zeros((3, 2, 4))), "k (3, 2, 4) must be [num_tokens, num_kv_heads, head_dim] = (3, 2, 8)"),
    "v_tokens": (dict(v=np.zeros((2, 2, 8))), "v (2, 2, 8) must be [num_tokens, num_kv_heads, head_dim] = (3, 2, 8)"),
}


@pytest.mark.parametrize("name", SHAPE_ERRORS)
def test_write_validates_shapes(name):
    args = dict(k_cache=np.zeros((2, 4, 2, 8)), v_cache=np.zeros((2, 4, 2, 8)), k=np.zeros((3, 2, 8)),
                v=np.zeros((3, 2, 8)), slot_mapping=np.zeros(3, np.int32))
    change, words = SHAPE_ERRORS[name]
    args.update(change)
    with pytest.raises(ValueError) as info:
        write_kv_cache(**args)
    assert words in str(info.value), str(info.value)


@pytest.mark.parametrize("latent", [False, True])
def test_gather_round_trip(latent):
    """Prefill every request through write_kv_cache, then read each back through its table."""
    rng = np.random.default_rng(3)
    block_size, query_lens = 4, [9, 1, 0, 4]
    md = build_metadata(query_lens, [0] * 4, block_size, num_blocks=12, seed=7)
    head_shape = (HEAD_DIM,) if latent else (NUM_KV_HEADS, HEAD_DIM)
    k = rng.standard_normal((md.num_tokens, *head_shape)).astype(np.float32)
    cache = jnp.zeros((12, block_size, *head_shape), jnp.float32)
    if latent:  # the latent cache has no head axis: write it with a one-head view
        one_head = cache[:, :, None]
        cache = write_kv_cache(one_head, jnp.zeros_like(one_head), k[:, None], k[:, None], md.slot_mapping)[0][:, :, 0]
    else:
        cache = write_kv_cache(cache, jnp.zeros_like(cache), k, k, md.slot_mapping)[0]
    gather = jax.jit(gather_kv, static_argnums=2)
    for i, n in enumerate(query_lens):
        start = int(md.cu_query_lens[i])
        np.testing.assert_array_equal(gather_kv(cache, md.block_tables[i], n), k[start : start + n])
        np.testing.assert_array_equal(gather(cache, jnp.asarray(md.block_tables[i]), n), k[start : start + n])


GATHER_ERRORS = {
    "length_negative": (dict(length=-1), "length=-1 must be a non-negative int"),
    "length_not_int": (dict(length=3.0), "length=3.0 must be a non-negative int"),
    "row_not_1d": (dict(block_table_row=np.zeros((1, 2), np.int32)), "block_table_row (1, 2) must be 1-D"),
    "row_too_short": (dict(length=9), "length=9 needs 3 pages of block_size=4, block_table_row has 2"),
    "page_out_of_pool": (
        dict(block_table_row=[1, 5]), "block_table_row[:2]=[1, 5] must be page ids in [0, num_blocks=3)"),
    "page_negative": (dict(block_table_row=[-1, 0]), "block_table_row[:2]=[-1, 0]"),
}


@pytest.mark.parametrize("name", GATHER_ERRORS)
def test_gather_validates(name):
    args = dict(cache=jnp.zeros((3, 4, 1, 8)), block_table_row=np.array([2, 0], np.int32), length=6)
    change, words = GATHER_ERRORS[name]
    args.update(change)
    with pytest.raises(ValueError) as info:
        gather_kv(**args)
    assert words in str(info.value), str(info.value)
