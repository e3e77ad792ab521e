"""Online softmax and the split-KV merge, shared by every kernel (docs/design.md#online-softmax,
#split-kv-and-the-merge).

Inside kernels scores live in the base-2 domain: ``s2 = q·k * softmax_scale * log2(e)``, so ``exp`` becomes
``exp2`` (one multiply folded into the scale). State per query row: running max ``m`` (base 2), running sum
``l`` and the unnormalised accumulator ``acc``. Rows that have seen no key yet keep ``m = -inf``; every exponent is
taken against a *safe* max (0 where ``m`` is ``-inf``) so ``exp2(-inf - -inf)`` never makes a NaN.

LSE convention (public outputs): natural log, float32, ``-inf`` for a row that sees no key (its output is 0).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


def init_state(rows: int, width: int, parts: int = 1):
    """``(acc [rows, width] f32, m [rows] f32 = -inf, l [rows] f32 = 0)``; with ``parts > 1`` the accumulator is a
    tuple of ``parts`` column groups (an FP8 cache's even and odd dims: :func:`pallas_attn.core.tiles.fp8_pairs`)."""
    if parts > 1:
        _, m, l = init_state(rows, width)
        return tuple(jnp.zeros((rows, width), jnp.float32) for _ in range(parts)), m, l
    return (jnp.zeros((rows, width), jnp.float32),
            jnp.full((rows,), -jnp.inf, jnp.float32),
            jnp.zeros((rows,), jnp.float32))


def approx_exp2(x):
    """``2**x`` with PTX ``ex2.approx.ftz.f32`` (one MUFU op; GPU only). libdevice's ``exp2f``, which Pallas uses for
    ``jnp.exp2``, adds denormal handling around it."""
    from jax.experimental.pallas import triton as plgpu
    [y] = plgpu.elementwise_inline_asm("ex2.approx.ftz.f32 $0, $1;", args=[x], constraints="=f,f", pack=1,
                                       result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, x.dtype)])
    return y


def softmax_update(m, l, s2, exp2=jnp.exp2, scale=None):
    """One key tile's softmax bookkeeping, before its ``P @ V``.

    Args:
      m, l: ``[M]`` running max (base 2) and sum.
      s2: ``[M, N]`` float32 scores in base 2, ``-inf`` where masked; with ``scale``, raw scores (``q·k``) that
        ``scale`` (softmax scale · log2 e, > 0) takes to base 2 here.
      scale: the row max is then taken on the raw scores and the scale folds into the exponent's multiply-add
        (``exp2(s · scale - m)``: one FMA an element instead of a multiply and a subtraction). The max is the same
        number either way: rounding ``s · scale`` is monotonic in ``s``.

    Returns:
      ``(m_new, alpha [M], p [M, N] f32, l_new)``: the accumulator is to be scaled by ``alpha`` and ``p @ v`` added.
    """
    m_new, m_safe, alpha = _new_max(m, s2, exp2, scale)
    p = exp2(_exponent(s2, m_safe, scale))  # [M, N]; masked entries are exp2(-inf) = 0
    return m_new, alpha, p, alpha * l + jnp.sum(p, axis=1)


def softmax_update_packed(m, l, s2, dtype, chunks: int, exp2=jnp.exp2, scale=None):
    """:func:`softmax_update` with ``p`` returned in ``dtype`` (the ``P @ V`` operand), its exponentials taken
    ``chunks`` column blocks at a time: each block is summed and packed before the next block's exponentials, so
    the program order keeps one block of float32 ``p`` live beside the raw scores instead of all of it (a register
    knob for the compiled kernels; the same numbers up to the row sum's order).

    Returns ``(m_new, alpha [M], p [M, N] dtype, l_new)``."""
    m_new, m_safe, alpha = _new_max(m, s2, exp2, scale)
    width = s2.shape[1] // chunks
    l_new, packed = alpha * l, []
    for c in range(chunks):
        p = exp2(_exponent(s2[:, c * width:(c + 1) * width], m_safe, scale))
        l_new = l_new + jnp.sum(p, axis=1)
        packed.append(p.astype(dtype))
    return m_new, alpha, jnp.concatenate(packed, axis=1), l_new


def safe_max(m):
    """The running max ``m [M]`` with -inf (a row that has seen no key) as 0: exponents ``x - safe_max(m)`` are then
    -inf for such a row, never ``-inf - -inf`` (NaN)."""
    return jnp.where(m == -jnp.inf, 0.0, m)


def _new_max(m, s2, exp2, scale):
    """``(m_new, m_safe, alpha)`` for :func:`softmax_update`: the running max, its NaN-safe twin and the rescale."""
    row_max = jnp.max(s2, axis=1)
    m_new = jnp.maximum(m, row_max if scale is None else row_max * scale)
    m_safe = safe_max(m_new)  # a row with no visible key yet: exponents against 0
    return m_new, m_safe, exp2(m - m_safe)  # alpha [M]: 0 for a row's first visible tile (m = -inf)


def _exponent(s2, m_safe, scale):
    return s2 - m_safe[:, None] if scale is None else s2 * scale - m_safe[:, None]


def online_softmax_step(state, s2, v, dot, exp2=jnp.exp2, v_scale=None):
    """Fold one key tile into the running state.

    Args:
      state: ``(acc [M, D], m [M], l [M])``.
      s2: ``[M, N]`` float32 scores in base 2, ``-inf`` where masked.
      v: ``[N, D]`` value tile (input dtype), or a tuple of column groups matching ``state``'s accumulator;
        masked keys must hold finite values (loads use ``other=0``).
      dot: the backend's matmul ``dot(a [M, N], b [N, D]) -> f32 [M, D]``.
      exp2: ``jnp.exp2`` (interpret mode, exact) or :func:`approx_exp2` (compiled).
      v_scale: ``f32[N]`` each value's scale (an FP8 cache with per-token scales), or None. The probabilities
        meet ``v`` in its 16-bit dtype, so each column is scaled by ``v_scale / 2**e``, ``2**e`` the tile's
        largest scale rounded up to a power of two (then in ``(0, 1]``: fp16 keeps them normal however small the
        scales are), and the product by ``2**e`` after the dot.
    """
    acc, m, l = state
    m_new, alpha, p, l = softmax_update(m, l, s2, exp2)
    parts = v if isinstance(v, tuple) else (v,)
    p, top = scaled_probabilities(p, v_scale, parts[0].dtype)  # once for every part
    products = tuple(dot(p, part) if top is None else dot(p, part) * top for part in parts)
    if isinstance(v, tuple):
        return tuple(alpha[:, None] * a + pv for a, pv in zip(acc, products)), m_new, l
    return alpha[:, None] * acc + products[0], m_new, l


def scaled_probabilities(p, v_scale, dtype):
    """``(p', top)`` with ``dot(p', v) · top == p @ (v_scale[:, None] · v)`` for ``v [N, D]`` in its 16-bit
    ``dtype``: each column of ``p [M, N]`` scaled by ``v_scale / 2**e``, ``2**e`` (``top``) the largest scale
    rounded up to a power of two (then in ``(0, 1]``: fp16 keeps them normal however small the scales are). Without
    scales (None): ``(p in dtype, None)``."""
    if v_scale is None:
        return p.astype(dtype), None
    top = jnp.max(v_scale)
    top = jnp.exp2(jnp.ceil(jnp.log2(jnp.where(top > 0, top, 1.0))))
    return (p * (v_scale / top)[None, :]).astype(dtype), top


def normalize(acc, l):
    """``acc [M, D] / l [M]``; rows with no key (``l == 0``) give 0."""
    return acc / jnp.where(l == 0.0, 1.0, l)[:, None]


def log_sum_exp(m, l):
    """The natural-log LSE ``[M]`` of a state's base-2 running max ``m`` and row sum ``l``; ``-inf`` where
    ``l == 0``."""
    empty = l == 0.0
    return jnp.where(empty, -jnp.inf, (m + jnp.log2(jnp.where(empty, 1.0, l))) * LN2)


def finalize(state, sink2=None):
    """``(out [M, D] f32, lse [M] f32 natural log)``; rows with no key give 0 and ``-inf``.

    ``sink2 [M]`` (attention sinks in base 2): each row's denominator gets ``2**sink2`` with no value; the LSE
    stays over the keys only, so split states still merge (the merge applies the sink once)."""
    acc, m, l = state
    denominator = with_sink(m, l, sink2)
    if isinstance(acc, tuple):
        return tuple(normalize(a, denominator) for a in acc), log_sum_exp(m, l)
    return normalize(acc, denominator), log_sum_exp(m, l)


def with_sink(m, l, sink2=None):
    """A row's denominator ``l [M]`` with ``2**sink2 [M]`` added on the state's scale (``2**-m``, ``m`` the base-2
    running max); ``l`` itself where ``sink2`` is None. A row with no key (``m = -inf``) adds ``2**sink2``: its
    accumulator is 0, so its output stays 0."""
    if sink2 is None:
        return l
    m_safe = safe_max(m)
    return l + jnp.exp2(sink2 - m_safe)


def merge_split_outputs(out, lse, num_splits: int, shape: tuple, dtype, sinks=None):
    """The kernels' flat outputs → ``(out [*shape] dtype, lse [*shape[:-1]] f32)``; with ``num_splits > 1`` they
    are ``num_splits`` float32 partial states, merged here (the second pass of split-KV), and ``sinks`` (``f32[H]``,
    the heads axis ``shape[-2]``) applied once to the merged state."""
    if num_splits == 1:
        return out.reshape(shape), lse.reshape(shape[:-1])
    out, lse = out.reshape(num_splits, *shape), lse.reshape(num_splits, *shape[:-1])
    out, lse = fold_split_states(num_splits, lambda s: lse[s], lambda s: out[s], shape[:-1], shape)
    if sinks is not None:
        out = apply_sink(out, lse, sinks)
    return out.astype(dtype), lse


def apply_sink(out, lse, sinks):
    """A normalised state ``(out [..., H, D], lse [..., H])`` with ``exp(sinks [H])`` added to its denominator:
    ``out · Σ / (Σ + e^sink) = out / (1 + e^(sink − lse))``; the LSE stays over the keys. A row with no key stays
    0 (its ``lse`` is ``-inf``), a sink far above the keys takes it to 0."""
    return out / (1.0 + jnp.exp(sinks.astype(jnp.float32) - lse))[..., None]


def _unrolled(n: int, body, init):
    for s in range(n):
        init = body(s, init)
    return init


def fold_split_states(num_splits: int, lse_at, out_at, lse_shape: tuple, out_shape: tuple, loop=_unrolled):
    """The split-KV merge (:func:`pallas_attn.merge_attention_states`) over states fetched one split at a time:
    ``lse_at(s)`` ``[...]``, ``out_at(s)`` ``[..., D]``. A left fold in split order, empty (``-inf``) splits ignored
    even where their outputs are NaN. ``loop(n, body, init)`` runs the folds: unrolled in XLA, ``lax.fori_loop``
    inside a kernel (:mod:`pallas_attn.kernels.triton.paged` merges one launch's partial states in the next
    launch's programs).

    Returns ``(out [..., D] float32, lse [...] float32)``."""
    m = loop(num_splits, lambda s, m: jnp.maximum(m, lse_at(s).astype(jnp.float32)),
             jnp.full(lse_shape, -jnp.inf, jnp.float32))
    m_safe = safe_max(m)

    def fold(s, carry):
        num, den = carry
        w = jnp.exp(lse_at(s).astype(jnp.float32) - m_safe)  # 0 for an empty split
        return num + jnp.where((w > 0)[..., None], w[..., None] * out_at(s).astype(jnp.float32), 0.0), den + w

    num, den = loop(num_splits, fold, (jnp.zeros(out_shape, jnp.float32), jnp.zeros(lse_shape, jnp.float32)))
    empty = den == 0.0
    out = num / jnp.where(empty, 1.0, den)[..., None]
    lse = jnp.where(empty, -jnp.inf, m_safe + jnp.log(jnp.where(empty, 1.0, den)))
    return out, lse


def kv_loop(state, tile_start, full_end, kv_end, step, full_start=None, *, stride: int = 1, phase=0):
    """Run ``step(j, state, masked)`` over key tiles: ``[tile_start, full_end)`` unmasked, ``[full_end, kv_end)``
    masked. Two loops, so the full tiles (■) carry no mask code at all and each loop is pipelined on its own. With
    ``full_start`` (a sliding window), ``[tile_start, full_start)`` runs masked first (a third loop).

    ``stride > 1``: only the tiles ``j`` with ``(j - tile_start) % stride == phase`` (``phase`` may be traced), one
    worker's share when ``stride`` workers take turns on a program's tiles."""
    origin = tile_start

    def run(lo, hi, masked, state):
        if stride == 1:
            return jax.lax.fori_loop(lo, hi, lambda j, s: step(j, s, masked), state)
        # the first j >= lo of this worker's residue class (lax.rem keeps the sign of lo - origin: + stride)
        first = lo + jax.lax.rem(phase - jax.lax.rem(lo - origin, stride) + stride, stride)
        count = jnp.maximum(hi - first + stride - 1, 0) // stride
        return jax.lax.fori_loop(0, count, lambda i, s: step(first + stride * i, s, masked), state)

    if full_start is not None:
        state = run(tile_start, full_start, True, state)
        tile_start = full_start
    state = run(tile_start, full_end, False, state)
    return run(full_end, kv_end, True, state)


def merge_states(a, b):
    """Two online-softmax states ``(acc [M, D], m [M], l [M])`` (base-2 running max) over disjoint key sets, as
    one: each rescaled to the larger max. A row that saw no key in either stays 0 with ``m = -inf``."""
    (acc_a, m_a, l_a), (acc_b, m_b, l_b) = a, b
    m = jnp.maximum(m_a, m_b)
    m_safe = safe_max(m)
    alpha, beta = jnp.exp2(m_a - m_safe), jnp.exp2(m_b - m_safe)
    acc = acc_a * jax.lax.broadcast_in_dim(alpha, acc_a.shape, [0]) + \
        acc_b * jax.lax.broadcast_in_dim(beta, acc_b.shape, [0])
    return acc, m, l_a * alpha + l_b * beta
