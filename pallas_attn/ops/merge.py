"""``merge_attention_states``: the split-KV reduction, public (split-KV segments, context-parallel shards).

The math is :func:`pallas_attn.core.softmax.fold_split_states`, which the kernels' own merges share.
"""

from __future__ import annotations

import jax

from pallas_attn.core import softmax, validation
from pallas_attn.ops import common


def _validate(outs, lses):
    validation.check_float("outs", outs)
    if outs.ndim < 2:
        raise ValueError(f"outs must be [num_splits, ..., head_dim]; got shape {tuple(outs.shape)}")
    if tuple(lses.shape) != tuple(outs.shape[:-1]):
        raise ValueError(f"lses must be f32[num_splits, ...] = outs.shape[:-1] = {tuple(outs.shape[:-1])}; "
                         f"got {tuple(lses.shape)}")
    if outs.shape[0] < 1:
        raise ValueError(f"outs and lses need at least one split; got num_splits = {outs.shape[0]}")


@common.front(arrays=("outs", "lses", "sinks"))
@jax.jit
def merge_attention_states(outs: jax.Array, lses: jax.Array, sinks: jax.Array | None = None
                           ) -> tuple[jax.Array, jax.Array]:
    """Merge attention computed over disjoint key sets (split-KV segments, context-parallel shards).

    ``m = max_s lse_s``, ``w_s = exp(lse_s - m)``, ``out = Σ_s w_s·out_s / Σ_s w_s``, ``lse = m + log Σ_s w_s``.

    Args:
      outs: ``[S, ..., D]`` per-split normalised outputs (any dtype; merged in float32).
      lses: ``[S, ...]`` float32 natural-log LSE per split, exactly ``outs.shape[:-1]`` (no broadcasting);
        ``-inf`` marks an empty split, whose ``outs`` entry is ignored even if it is NaN.
      sinks: ``f32[H]`` attention sinks (the last axis of ``lses`` is the heads axis), or None: applied once, to
        the merged state (the partial states carry none); the returned LSE stays over the keys.

    Returns:
      ``(out [..., D] float32, lse [...] float32)``; a row whose splits are all empty gives 0 and ``-inf``.

    The sum over splits is a left fold in split order, so appending empty splits (a wider static split count)
    changes no bit of the result: this is what makes fixed-``split_size`` decoding batch invariant.

    Example:
      >>> out, lse = merge_attention_states(jnp.stack([o1, o2]), jnp.stack([lse1, lse2]))
    """
    _validate(outs, lses)
    if sinks is not None and (sinks.ndim != 1 or lses.ndim < 2 or sinks.shape[0] != lses.shape[-1]):
        raise ValueError(f"sinks must be f32[H] with H = lses.shape[-1] (the heads axis); got sinks "
                         f"{tuple(sinks.shape)} for lses {tuple(lses.shape)}")
    out, lse = softmax.fold_split_states(outs.shape[0], lambda s: lses[s], lambda s: outs[s], lses.shape[1:],
                                         outs.shape[1:])
    return (out if sinks is None else softmax.apply_sink(out, lse, sinks)), lse


