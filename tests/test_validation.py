"""Every static rule raises a ValueError/TypeError naming the argument, what it got and what it needs."""

from __future__ import annotations

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
    "head_dim_big": (lambda: v.check_head_dim("q", 264), ValueError, "head_dim=264 unsupported"),
    "gqa": (lambda: v.check_gqa(6, 4), ValueError, "num_q_heads=6 must be a positive multiple of num_kv_heads=4"),
    "block_size": (lambda: v.check_block_size(512), ValueError, "block_size=512"),
    "static": (lambda: v.check_static_positive("max_seqlen", np.int32(-1)), TypeError, "max_seqlen must be a static"),
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
    v.check_head_dim("q", 80)
    assert v.check_static_positive("max_seqlen", 0) == 0
