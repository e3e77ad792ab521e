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
