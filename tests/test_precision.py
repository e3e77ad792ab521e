"""float32 inputs get IEEE float32 dots inside every kernel; bf16/fp16 get the tensor-core default.

On the GPU a dot without ``precision=HIGHEST`` runs float32 operands as TF32 (10-bit mantissa): a relative error
near 3e-4 instead of 1e-6. Interpret mode on a CPU computes float32 dots exactly either way, so the CPU suite
cannot see a missing precision in the numbers; this test reads it from the traced kernel instead. Every
``dot_general`` inside every ``pallas_call`` of a public function must carry HIGHEST for float32 inputs and must
not for bf16 (that would fall off the tensor-core path).
"""

from __future__ import annotations

import functools

import jax
import jax.extend.core as jex_core
import jax.numpy as jnp
import pytest

from pallas_attn import DecodeConfig, SparseConfig

from .test_memory import SMALL, decode_case, prefill_case, ragged_prefill_case, sparse_case

CASES = {
    "varlen_attention": lambda dtype: prefill_case(256, 2, 64, dtype, SMALL["prefill"]),
    "paged_attention": lambda dtype: ragged_prefill_case(256, 2, 64, dtype, SMALL["decode"]),
    "paged_decode_attention": lambda dtype: decode_case(256, 2, 4, 2, 64, dtype, SMALL["decode"]),
    "paged_decode_attention/no_split": lambda dtype: decode_case(256, 2, 4, 2, 64, dtype, DecodeConfig(block_n=16)),
    "sparse_mla_attention": lambda dtype: sparse_case(4, 16, 64, 256, dtype, SMALL["sparse"]),
    "sparse_mla_attention/value_splits": lambda dtype: sparse_case(
        4, 16, 64, 256, dtype, SparseConfig(block_n=16, block_h=16, num_warps=4, value_splits=2)),
}


def _sub_jaxprs(value):
    if isinstance(value, (jex_core.Jaxpr, jex_core.ClosedJaxpr)):  # one class in recent JAX, two in older ones
        yield getattr(value, "jaxpr", value)
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _sub_jaxprs(item)


def _kernel_dot_precisions(jaxpr, in_kernel=False):
    """The ``precision`` of every dot_general reached inside a pallas_call, through jit, loops and conds."""
    for eqn in jaxpr.eqns:
        if in_kernel and eqn.primitive.name == "dot_general":
            yield eqn.params["precision"]
        for value in eqn.params.values():
            for sub in _sub_jaxprs(value):
                yield from _kernel_dot_precisions(sub, in_kernel or eqn.primitive.name == "pallas_call")


def _is_highest(precision) -> bool:
    if precision is None:
        return False
    pair = precision if isinstance(precision, tuple) else (precision, precision)
    return all(p == jax.lax.Precision.HIGHEST for p in pair)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("name", CASES)
def test_kernel_dots_use_ieee_float32_only_for_float32(name, dtype):
    fn, args, kwargs, *_ = CASES[name](dtype)
    if name == "paged_decode_attention/no_split":
        kwargs = {**kwargs, "num_splits": 1}
    jaxpr = jax.make_jaxpr(functools.partial(fn, interpret=True, **kwargs))(*args)
    precisions = list(_kernel_dot_precisions(jaxpr.jaxpr))
    assert precisions, f"{name}: no dot_general found inside a pallas_call"
    if dtype == jnp.float32:
        assert all(map(_is_highest, precisions)), f"{name}: float32 kernel dots {precisions} are not all HIGHEST"
    else:
        assert not any(map(_is_highest, precisions)), f"{name}: bf16 kernel dots {precisions} ask for HIGHEST"
