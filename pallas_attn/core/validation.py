"""Static (trace-time) checks shared by every public function: one helper per rule, messages that name the
argument, the shape it got and the shape it needs."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256


def check_rank(name: str, x, rank: int, layout: str) -> None:
    if x.ndim != rank:
        raise ValueError(f"{name} must be {layout} (rank {rank}); got shape {tuple(x.shape)}")


def check_float(name: str, x) -> None:
    if jnp.dtype(x.dtype) not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16 or float16; got {x.dtype}")


def check_int32(name: str, x) -> None:
    if jnp.dtype(x.dtype) != jnp.dtype(jnp.int32):
        raise TypeError(f"{name} must be int32; got {x.dtype} (cast with .astype(jnp.int32))")


def check_same_dtype(names: tuple[str, ...], *xs) -> None:
    dtypes = {jnp.dtype(x.dtype) for x in xs}
    if len(dtypes) > 1:
        got = ", ".join(f"{n}={x.dtype}" for n, x in zip(names, xs))
        raise TypeError(f"{' / '.join(names)} must share one dtype; got {got}")


def check_shape(name: str, x, expected: tuple, layout: str) -> None:
    if tuple(x.shape) != tuple(expected):
        raise ValueError(f"{name} must be {layout} = {tuple(expected)}; got {tuple(x.shape)}")


def check_head_dim(name: str, head_dim: int) -> None:
    if not (MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM and head_dim % 8 == 0):
        raise ValueError(f"{name}: head_dim={head_dim} unsupported; need a multiple of 8 in "
                         f"[{MIN_HEAD_DIM}, {MAX_HEAD_DIM}]")


def check_gqa(num_q_heads: int, num_kv_heads: int) -> None:
    if num_kv_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads=} must be a positive multiple of {num_kv_heads=}")


def check_block_size(block_size: int) -> None:
    if not (1 <= block_size <= 256 and block_size & (block_size - 1) == 0):
        raise ValueError(f"{block_size=} (cache axis 1) must be a power of two in [1, 256]")


def check_static_positive(name: str, value) -> int:
    if isinstance(value, (jnp.ndarray, np.ndarray)) or not isinstance(value, (int, np.integer)) or value < 0:
        raise TypeError(f"{name} must be a static Python int >= 0 (a bucketed maximum); got {value!r}")
    return int(value)


def check_paged_kv(q, k_cache, v_cache, block_tables, q_layout: str) -> None:
    """The rules shared by the paged kernels: q, both caches, their agreement, and the block table."""
    check_rank("q", q, 3, q_layout)
    check_rank("k_cache", k_cache, 4, "[num_blocks, block_size, num_kv_heads, head_dim]")
    check_float("q", q)
    check_same_dtype(("q", "k_cache", "v_cache"), q, k_cache, v_cache)
    check_shape("v_cache", v_cache, k_cache.shape, "k_cache.shape")
    if k_cache.shape[3] != q.shape[2]:
        raise ValueError(f"k_cache head_dim {k_cache.shape[3]} must equal q head_dim {q.shape[2]}; "
                         f"got q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}")
    check_head_dim("q", q.shape[2])
    check_gqa(q.shape[1], k_cache.shape[2])
    check_block_size(k_cache.shape[1])
    check_rank("block_tables", block_tables, 2, "i32[num_seqs, max_blocks]")
    check_int32("block_tables", block_tables)
