"""Safe mode (`pallas_attn.checks.checked`): every data rule raises with a message naming the argument and the
offending request / index; valid batches pass through bit-identical to the unchecked kernel; padding the kernels
never read (table tails, padding tokens' top-k rows) is not flagged.

Runtime on CPU: ~15 s (a bad value is caught before the kernel runs, so only the pass-through tests compile a kernel).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

from pallas_attn import (
    DecodeConfig,
    PrefillConfig,
    SparseConfig,
    paged_attention,
    paged_decode_attention,
    sparse_mla_attention,
    varlen_attention,
)
from pallas_attn.checks import CheckError, checked
from pallas_attn.testing import make_paged_kv, random_packed

PREFILL = PrefillConfig(block_m=16, block_n=16)
DECODE = DecodeConfig(block_n=16)
SPARSE = SparseConfig(block_n=16, block_h=16, num_warps=4)
BS = 4  # block_size of every paged scenario


# ---------------------------------------------------------------------------------------------------- inputs
# One small valid batch per kernel: (kernel, positional args, keyword args). Empty requests included.


def _varlen(rng):
    q, cu = random_packed(rng, [6, 0, 4], 2, 16, jnp.float32, pad_to=12)
    k, _ = random_packed(rng, [6, 0, 4], 1, 16, jnp.float32, pad_to=12)
    v, _ = random_packed(rng, [6, 0, 4], 1, 16, jnp.float32, pad_to=12)
    heads = jnp.asarray(rng.uniform(0.1, 0.5, 2), jnp.float32)  # model-family features pass through
    return (varlen_attention, dict(q=q, k=k, v=v, cu_seqlens=cu, alibi_slopes=heads, sinks=-heads),
            dict(max_seqlen=8, config=PREFILL, window_size=(3, -1)))


def _decode(rng):
    kc, vc, bt = make_paged_kv(rng, [5, 0, 17], BS, 1, 16, jnp.float32)
    q = jnp.asarray(rng.standard_normal((3, 2, 16)), jnp.float32)
    return (paged_decode_attention, dict(q=q, k_cache=kc, v_cache=vc, block_tables=bt,
                                         seq_lens=jnp.array([5, 0, 17], jnp.int32),
                                         sinks=jnp.asarray(rng.standard_normal(2), jnp.float32)),
            dict(num_splits=2, config=DECODE, window_size=(6, -1)))


def _paged(rng):
    kc, vc, bt = make_paged_kv(rng, [5, 3, 9], BS, 1, 16, jnp.float32)
    q, cu = random_packed(rng, [1, 3, 0], 2, 16, jnp.float32, pad_to=6)
    return (paged_attention, dict(q=q, k_cache=kc, v_cache=vc, block_tables=bt,
                                  seq_lens=jnp.array([5, 3, 9], jnp.int32), cu_query_lens=cu,
                                  alibi_slopes=jnp.asarray(rng.uniform(0.1, 0.5, 2), jnp.float32)),
            dict(max_query_len=4, config=DECODE, softcap=5.0))


def _sparse(rng):
    kv, _, bt = make_paged_kv(rng, [10, 7], BS, None, 80, jnp.float32)
    q = jnp.asarray(rng.standard_normal((4, 4, 80)), jnp.float32)
    topk = np.full((4, 16), -1, np.int32)
    topk[0, :5] = [0, 9, 3, 3, 8]
    topk[1, :3] = [1, 2, 9]
    topk[2, :4] = [6, 0, 5, 1]
    topk[3] = 999  # token 3 is padding (past cu_query_lens[-1]): never read, never checked
    return (sparse_mla_attention, dict(q=q, kv_cache=kv, block_tables=bt, topk_indices=jnp.asarray(topk),
                                       cu_query_lens=jnp.array([0, 2, 3], jnp.int32),
                                       sinks=jnp.asarray(rng.standard_normal(4), jnp.float32)),
            dict(kv_lora_rank=64, config=SPARSE))


BUILDERS = {"varlen": _varlen, "decode": _decode, "paged": _paged, "sparse": _sparse}


def _set(x, index, value):
    return jnp.asarray(x).at[index].set(value)


# ------------------------------------------------------------------------------------------ one row per rule
# name: (kernel, {argument: new value from the valid one}, extra kwargs for the wrapper, expected message regex)
BAD = {
    "cu_seqlens_start": ("varlen", dict(cu_seqlens=lambda a: _set(a, 0, 1)), {},
                         r"cu_seqlens must start at 0; got cu_seqlens\[0\]=1"),
    "cu_seqlens_decreasing": ("varlen", dict(cu_seqlens=lambda a: jnp.array([0, 6, 4, 10], jnp.int32)), {},
                              r"non-decreasing; request 1 has cu_seqlens\[1\]=6 > cu_seqlens\[2\]=4"),
    "cu_seqlens_past_num_tokens": ("varlen", dict(cu_seqlens=lambda a: _set(a, 3, 13)), {},
                                   r"cu_seqlens\[-1\]=13 must be <= num_tokens=12"),
    "seqlen_over_max_seqlen": ("varlen", dict(cu_seqlens=lambda a: jnp.array([0, 9, 9, 10], jnp.int32)), {},
                               r"request 0 has length 9 .* > max_seqlen=8"),
    "decode_seq_lens_negative": ("decode", dict(seq_lens=lambda a: _set(a, 1, -3)), {},
                                 r"seq_lens must be >= 0; seq_lens\[1\]=-3"),
    "decode_table_too_narrow": ("decode", dict(block_tables=lambda a: a[:, :3]), {},
                                r"too narrow: request 2 has seq_lens=17, which needs 5 pages .* max_blocks=3"),
    "decode_page_negative": ("decode", dict(block_tables=lambda a: _set(a, (2, 4), -1)), {},
                             r"block_tables\[2, 4\]=-1 is not a page id in \[0, num_blocks=\d+\)"),
    "decode_page_past_pool": ("decode", dict(block_tables=lambda a: _set(a, (0, 1), 10**6)), {},
                              r"block_tables\[0, 1\]=1000000 is not a page id"),
    "cu_query_lens_decreasing": ("paged", dict(cu_query_lens=lambda a: jnp.array([0, 3, 1, 4], jnp.int32)), {},
                                 r"cu_query_lens must be non-decreasing; request 1"),
    "q_len_over_max_query_len": ("paged", dict(cu_query_lens=lambda a: jnp.array([0, 5, 5, 5], jnp.int32),
                                               seq_lens=lambda a: jnp.array([5, 3, 9], jnp.int32)), {},
                                 r"request 0 has length 5 .* > max_query_len=4"),
    "q_len_over_seq_len": ("paged", dict(seq_lens=lambda a: _set(a, 1, 2)), {},
                           r"request 1 has q_len=3 new tokens > seq_lens\[1\]=2"),
    "seq_lens_negative": ("paged", dict(seq_lens=lambda a: _set(a, 2, -1)), {}, r"seq_lens\[2\]=-1"),
    "paged_page_out_of_range": ("paged", dict(block_tables=lambda a: _set(a, (2, 2), 99)), {},
                                r"block_tables\[2, 2\]=99 is not a page id .* request 2 uses page 2"),
    "topk_below_minus_one": ("sparse", dict(topk_indices=lambda a: _set(a, (1, 7), -2)), {},
                             r"topk_indices\[1, 7\]=-2 must be >= 0, or -1"),
    "topk_past_capacity": ("sparse", dict(topk_indices=lambda a: _set(a, (2, 9), 1000)), {},
                           r"topk_indices\[2, 9\]=1000 must be < max_blocks \* block_size"),
    "topk_page_invalid": ("sparse", dict(block_tables=lambda a: _set(a, (0, 2), -7)), {},
                          r"topk_indices\[0, 1\]=9 lands on block_tables\[0, 2\]=-7"),
    "topk_past_seq_len": ("sparse", dict(topk_indices=lambda a: _set(a, (2, 0), 7)),
                          dict(seq_lens=jnp.array([10, 7], jnp.int32)),
                          r"topk_indices\[2, 0\]=7 must be < seq_lens\[1\]=7 \(token 2 belongs to request 1\)"),
    "sparse_seq_lens_page": ("sparse", dict(block_tables=lambda a: _set(a, (1, 1), 10**4)),
                             dict(seq_lens=jnp.array([10, 7], jnp.int32)), r"block_tables\[1, 1\]=10000"),
    "sparse_cu_query_lens_past_tokens": ("sparse", dict(cu_query_lens=lambda a: _set(a, 2, 5)), {},
                                         r"cu_query_lens\[-1\]=5 must be <= num_tokens=4"),
}


@pytest.mark.parametrize("name", BAD)
def test_bad_value_raises(name, rng):
    kind, mutations, extra, match = BAD[name]
    fn, arrays, statics = BUILDERS[kind](rng)
    for arg, mutate in mutations.items():
        arrays[arg] = mutate(arrays[arg])
    with pytest.raises(CheckError, match=match) as info:
        checked(fn)(**arrays, **statics, **extra)
    assert isinstance(info.value, ValueError) and info.value.args[0].startswith(fn.__name__)


@pytest.mark.parametrize("kind", BUILDERS)
def test_valid_batch_is_bit_identical(kind, rng):
    fn, arrays, statics = BUILDERS[kind](rng)
    extra = dict(seq_lens=jnp.array([10, 7], jnp.int32)) if kind == "sparse" else {}
    want = fn(**arrays, **statics, return_lse=True)
    got = checked(fn)(**arrays, **statics, **extra, return_lse=True)
    for w, g in zip(want, got):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))

    # Inside the caller's jit: checks become checkify.check, the kernel runs behind them; same outputs.
    inner = jax.jit(functools.partial(checked(fn), **statics, **extra, return_lse=True))
    err, got = checkify.checkify(inner)(**arrays)
    err.throw()
    for w, g in zip(want, got):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_bad_value_inside_callers_jit(rng):
    """Under the caller's jax.jit + checkify: the same message, and the kernel is skipped (zeros, no bad read)."""
    fn, arrays, statics = BUILDERS["decode"](rng)
    arrays["block_tables"] = _set(arrays["block_tables"], (2, 4), -1)
    err, out = checkify.checkify(jax.jit(functools.partial(checked(fn), **statics)))(**arrays)
    with pytest.raises(ValueError, match=r"block_tables\[2, 4\]=-1 is not a page id"):
        err.throw()
    assert np.all(np.asarray(out) == 0)


def test_decode_context_lens_alias(rng):
    """The decode kernel's former argument name ``context_lens=`` works through ``checked`` too: it warns, the
    rules check it (under its new name) and the output is the kernel's."""
    fn, arrays, statics = BUILDERS["decode"](rng)
    want = fn(**arrays, **statics)
    lens = arrays.pop("seq_lens")
    with pytest.warns(DeprecationWarning, match="pass seq_lens="):
        got = checked(fn)(**arrays, context_lens=lens, **statics)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    with pytest.warns(DeprecationWarning), pytest.raises(CheckError, match=r"seq_lens\[1\]=-3"):
        checked(fn)(**arrays, context_lens=_set(lens, 1, -3), **statics)


def test_signature_and_unknown_function():
    assert checked(varlen_attention).__name__ == "varlen_attention"
    import inspect
    assert "seq_lens" in inspect.signature(checked(sparse_mla_attention)).parameters
    with pytest.raises(TypeError, match="checked\\(\\) takes one of"):
        checked(jnp.dot)
