"""Every static rule raises a ValueError/TypeError naming the argument, what it got and what it needs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_attn.core import validation as v

F32 = jnp.zeros((2, 4, 64), jnp.float32)
CACHE = jnp.zeros((3, 16, 2, 64), jnp.float32)
TABLE = jnp.zeros((2, 2), jnp.int32)

CASES = {
    "rank": (lambda: v.check_rank("q", jnp.zeros((2, 4)), 3, "[num_tokens, num_q_heads, head_dim]"),
             ValueError, r"q must be \[num_tokens, num_q_heads, head_dim\] \(rank 3\); got shape \(2, 4\)"),
    "float": (lambda: v.check_float("q", jnp.zeros((2,), jnp.int32)), TypeError, "q must be float32, bfloat16"),
    "int32": (lambda: v.check_int32("block_tables", jnp.zeros((2,), jnp.float32)), TypeError,
              "block_tables must be int32; got float32"),
    "same_dtype": (lambda: v.check_same_dtype(("q", "k"), F32, F32.astype(jnp.bfloat16)), TypeError,
                   "q / k must share one dtype; got q=float32, k=bfloat16"),
    "shape": (lambda: v.check_shape("seq_lens", jnp.zeros((3,), jnp.int32), (2,), "i32[num_seqs]"), ValueError,
              r"seq_lens must be i32\[num_seqs\] = \(2,\); got \(3,\)"),
    "head_dim": (lambda: v.check_head_dim("q", 20), ValueError, "head_dim=20 unsupported"),
    "head_dim_big": (lambda: v.check_head_dim("q", 520), ValueError,
                     r"q: head_dim=520 unsupported; need a multiple of 8 in \[16, 512\]"),
    "head_dim_not_multiple_of_8": (lambda: v.check_head_dim("q", 324), ValueError, "head_dim=324 unsupported"),
    "gqa": (lambda: v.check_gqa(6, 4), ValueError, "num_q_heads=6 must be a positive multiple of num_kv_heads=4"),
    "block_size": (lambda: v.check_block_size(24), ValueError,
                   r"block_size=24 \(tokens per page, cache axis 1\) unsupported; need a power of two up to 16 or a "
                   r"multiple of 16 up to 1024 \(e.g. 8, 16, 48, 544, 1024\)"),
    "block_size_past_1024": (lambda: v.check_block_size(1040), ValueError, "block_size=1040 .* up to 1024"),
    "block_size_zero": (lambda: v.check_block_size(0), ValueError, "block_size=0 .* unsupported"),
    "static_int_negative": (lambda: v.check_static_int("max_seqlen", np.int32(-1)), ValueError,
                            r"max_seqlen must be a static Python int >= 1; got max_seqlen=-1"),
    "static_int_zero": (lambda: v.check_static_int("max_query_len", 0), ValueError,
                        r"max_query_len must be a static Python int >= 1; got max_query_len=0"),
    "static_int_bool": (lambda: v.check_static_int("max_seqlen", True), TypeError,
                        r"max_seqlen must be a static Python int >= 1; got max_seqlen=True \(bool\)"),
    "static_int_float": (lambda: v.check_static_int("num_splits", 2.0, optional=True), TypeError,
                         r"num_splits must be a static Python int >= 1 or None; got num_splits=2.0 \(float\)"),
    "static_int_array": (lambda: v.check_static_int("max_seqlen", jnp.int32(8)), TypeError,
                         r"got a jax array int32\[\]: pass a Python int; it is static .* bucket it"),
    "static_int_numpy_array": (lambda: v.check_static_int("max_seqlen", np.array(8)), TypeError,
                               r"got a numpy array int64\[\]: pass a Python int"),
    "static_bool": (lambda: v.check_static_bool("causal", "yes"), TypeError,
                    r"causal must be a static Python bool; got causal='yes' \(str\)"),
    "static_bool_array": (lambda: v.check_static_bool("return_lse", jnp.bool_(True)), TypeError,
                          r"return_lse must be a static Python bool; got a jax array bool\[\]"),
    "scale_nan": (lambda: v.check_softmax_scale("softmax_scale", float("nan")), ValueError,
                  "softmax_scale must be None or a finite Python float > 0; got softmax_scale=nan"),
    "scale_inf": (lambda: v.check_softmax_scale("softmax_scale", np.float32("inf")), ValueError,
                  "got softmax_scale=inf"),
    "scale_zero": (lambda: v.check_softmax_scale("softmax_scale", 0.0), ValueError, "got softmax_scale=0.0"),
    "scale_negative": (lambda: v.check_softmax_scale("softmax_scale", -0.125), ValueError,
                       "got softmax_scale=-0.125"),
    "scale_array": (lambda: v.check_softmax_scale("softmax_scale", jnp.float32(0.5)), TypeError,
                    r"got a jax array float32\[\]: pass float\(scale\) computed on the host"),
    "scale_type": (lambda: v.check_softmax_scale("softmax_scale", "0.5"), TypeError,
                   r"got softmax_scale='0.5' \(str\)"),
    "as_array_str": (lambda: v.as_array("cu_seqlens", "0, 4", jnp.int32), TypeError,
                     r"cu_seqlens must be an array of numbers .*; got '0, 4' \(str\)"),
    "as_array_ragged": (lambda: v.as_array("block_tables", [[0, 1], [2]], jnp.int32), TypeError,
                        r"block_tables must be an array \(jax, numpy, or a nested list of numbers\); got"),
    "as_array_int32_range": (lambda: v.as_array("seq_lens", np.array([2**40]), jnp.int32), ValueError,
                             r"seq_lens must be int32; got values in \[1099511627776, 1099511627776\]"),
    "single_array": (lambda: v.check_single_array("out", (F32, F32), "pass out[0]"), TypeError,
                     "out must be one array; got a tuple of 2: pass out"),
    "mesh_axis": (lambda: v.check_mesh_axis(jax.make_mesh((1,), ("tp",)), "model"), ValueError,
                  r"axis='model' is not an axis of the mesh; its axes are \('tp',\)"),
    "paged_head_dim": (lambda: v.check_paged_kv(F32, CACHE[..., :32], CACHE[..., :32], TABLE, "[B, Hq, D]"),
                       ValueError, "k_cache head_dim 32 must equal q head_dim 64"),
    "paged_v_shape": (lambda: v.check_paged_kv(F32, CACHE, CACHE[:2], TABLE, "[B, Hq, D]"), ValueError,
                      r"v_cache must be k_cache.shape = \(3, 16, 2, 64\); got \(2, 16, 2, 64\)"),
}


@pytest.mark.parametrize("name", CASES)
def test_rule_raises_with_a_clear_message(name):
    call, exc, match = CASES[name]
    with pytest.raises(exc, match=match):
        call()


def test_valid_inputs_pass():
    v.check_paged_kv(F32, CACHE, CACHE, TABLE, "[B, Hq, D]")
    for head_dim in (16, 80, 96, 264, 320, 512):
        v.check_head_dim("q", head_dim)
    for block_size in (1, 2, 4, 8, 16, 32, 48, 256, 544, 1024):
        v.check_block_size(block_size)
    assert v.check_static_int("max_seqlen", np.int32(8)) == 8 and type(v.check_static_int("m", np.int64(3))) is int
    assert v.check_static_int("num_splits", None, optional=True) is None
    assert v.check_static_bool("causal", np.bool_(False)) is False
    assert v.check_static_bool("interpret", None, optional=True) is None
    assert v.check_softmax_scale("softmax_scale", np.float32(0.5)) == 0.5 and v.check_softmax_scale("s", 1) == 1.0
    assert v.check_softmax_scale("softmax_scale", None) is None
    assert v.check_mesh_axis(jax.make_mesh((1,), ("tp",)), "tp") == 1


def test_as_array():
    """Lists, tuples and numpy arrays become jax arrays (integer data int32 where the argument is int32); jax
    arrays pass unchanged; float data for an int32 argument keeps its dtype, so the dtype rule names it."""
    cu = v.as_array("cu_seqlens", [0, 6, 8], jnp.int32)
    assert cu.dtype == jnp.int32 and cu.tolist() == [0, 6, 8]
    assert v.as_array("cu_seqlens", np.array([0, 4], np.int64), jnp.int32).dtype == jnp.int32
    assert v.as_array("cu_seqlens", [], jnp.int32).dtype == jnp.int32
    assert v.as_array("cu_seqlens", (0.0, 4.0), jnp.int32).dtype == jnp.float32
    assert v.as_array("q", np.zeros((2, 3), np.float16)).dtype == jnp.float16
    assert v.as_array("q", np.zeros((2,), jnp.bfloat16)).dtype == jnp.bfloat16
    assert v.as_array("q", F32) is F32
