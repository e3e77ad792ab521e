"""The two ceilings every ratio is taken against, measured in the same run as the kernels.

* matmul: bf16 ``jnp.dot`` of two random ``[n, n]`` matrices (n = 8192), bf16 or f32 output, whichever is
  faster; TFLOP/s = 2·n³ / t.
* copy: an elementwise op over a 2 GiB array (``~x`` on uint32 or ``-x`` on bf16, whichever is faster: a streaming
  read + write XLA cannot elide, unlike a plain copy); GB/s = 2·bytes(x) / t (read + write).

Both are timed with the harness's own method (:func:`benchmarks.timing.time_fn`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from benchmarks.timing import time_fn

MATMUL_N = 8192
COPY_BYTES = 2 * 2**30
TINY_MATMUL_N = 256
TINY_COPY_BYTES = 8 * 2**20


@dataclasses.dataclass
class Ceiling:
    name: str
    unit: str
    value: float
    median_ms: float
    what: str


def _best(candidates: dict[str, tuple], target_s: float) -> tuple[str, float]:
    """Times each ``name: (fn, args)`` and returns the fastest (name, median seconds): a ceiling is the best the
    device does, so the op that XLA happens to run best stands for it."""
    best = None
    for name, (fn, args) in candidates.items():
        t = time_fn(fn, args, target_s=target_s / len(candidates))
        if best is None or t.median_s < best[1]:
            best = (name, t.median_s)
    return best


def measure_matmul(tiny: bool = False, target_s: float = 0.5) -> Ceiling:
    n = TINY_MATMUL_N if tiny else MATMUL_N
    ka, kb = jax.random.split(jax.random.key(1234))
    a = jax.random.normal(ka, (n, n), jnp.float32).astype(jnp.bfloat16)
    b = jax.random.normal(kb, (n, n), jnp.float32).astype(jnp.bfloat16)
    args = [(a, b), (b, a)]
    candidates = {
        "bf16 out": (jax.jit(jnp.dot), args),
        "f32 out": (jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32)), args),
    }
    name, t = _best(candidates, target_s)
    return Ceiling(f"matmul_bf16_{n}", "TFLOP/s", 2 * n**3 / t / 1e12, t * 1e3,
                   f"jnp.dot bf16 [{n}x{n}] @ [{n}x{n}] ({name}; best of {', '.join(candidates)})")


def measure_copy(tiny: bool = False, target_s: float = 0.5) -> Ceiling:
    nbytes = TINY_COPY_BYTES if tiny else COPY_BYTES
    shape = (nbytes // 4 // 4096, 4096)
    bits = jax.random.bits(jax.random.key(99), shape, jnp.uint32)
    halves = jax.lax.bitcast_convert_type(bits, jnp.bfloat16).reshape(shape[0], -1)  # same bytes as bf16
    candidates = {"~x u32": (jax.jit(jnp.invert), [(bits,)]),
                  "-x bf16": (jax.jit(jnp.negative), [(jnp.nan_to_num(halves),)])}
    name, t = _best(candidates, target_s)
    return Ceiling("copy", "GB/s", 2 * nbytes / t / 1e9, t * 1e3,
                   f"{nbytes / 2**30:.2f} GiB read + written ({name}; best of {', '.join(candidates)})")


def measure_all(tiny: bool = False, target_s: float = 0.5) -> dict[str, Ceiling]:
    """{unit: Ceiling}: 'TFLOP/s' -> matmul, 'GB/s' -> copy."""
    mm = measure_matmul(tiny, target_s)
    cp = measure_copy(tiny, target_s)
    return {mm.unit: mm, cp.unit: cp}
