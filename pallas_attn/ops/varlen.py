"""``varlen_attention``: packed varlen prefill — validation, backend choice, the jitted public function.

Kernels: :mod:`pallas_attn.kernels.triton.prefill` and :mod:`pallas_attn.kernels.mosaic.prefill` (Hopper); the
backward pass :mod:`pallas_attn.kernels.triton.prefill_bwd`, behind :func:`jax.custom_vjp`.
Reference: :func:`pallas_attn.reference.varlen_attention` (gradients: autodiff of
:func:`pallas_attn.reference.varlen_attention_dense`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_attn.core import backend as backend_lib, config as config_lib, masks, metadata, softmax, validation
from pallas_attn.kernels.mosaic import prefill as mosaic_prefill, prefill_bwd as mosaic_prefill_bwd
from pallas_attn.kernels.triton import prefill as triton_prefill, prefill_bwd
from pallas_attn.ops import common


def _validate(q, k, v, cu_seqlens):
    validation.check_rank("q", q, 3, "[num_tokens, num_q_heads, head_dim]")
    validation.check_rank("k", k, 3, "[num_tokens, num_kv_heads, head_dim]")
    validation.check_float("q", q)
    validation.check_same_dtype(("q", "k", "v"), q, k, v)
    validation.check_shape("v", v, k.shape, "k.shape")
    validation.check_shape("k", k, (q.shape[0], k.shape[1], q.shape[2]),
                           "[num_tokens, num_kv_heads, head_dim] matching q")
    validation.check_head_dim("q", q.shape[2])
    validation.check_gqa(q.shape[1], k.shape[1])
    validation.check_rank("cu_seqlens", cu_seqlens, 1, "i32[num_seqs + 1]")
    validation.check_int32("cu_seqlens", cu_seqlens)
    if cu_seqlens.shape[0] < 1:
        raise ValueError(f"cu_seqlens must be i32[num_seqs + 1] (at least one entry: [0] for no request); got "
                         f"shape {tuple(cu_seqlens.shape)}")


BACKENDS = backend_lib.BACKENDS
CONFIG_TYPES = {"triton": config_lib.PrefillConfig, "mosaic": config_lib.MosaicPrefillConfig}  # backend → config
# The default on sm_90: Mosaic from MOSAIC_MIN_SEQLEN[head_dim] on, in batches of at least MOSAIC_MIN_TOKENS rows;
# below, its work list and K/V staging launch (10-23 µs a call) outweigh its faster tiles (at head dim 64, half the
# matmul per softmax, it needs longer requests): docs/performance.md#prefill-backend-rule.
MOSAIC_MIN_SEQLEN = {128: 512, 64: 2048, 256: 512}
MOSAIC_MIN_TOKENS = 2048


def mosaic_unsupported(q, k, mods: masks.ScoreMods) -> str | None:
    """Why the Mosaic prefill cannot run this call, or None (it takes every model-family feature)."""
    del mods
    return mosaic_prefill.supported(q, k)


def default_backend(q, k, max_seqlen: int, interpret: bool, mods: masks.ScoreMods = masks.NO_MODS) -> str:
    """``varlen_attention``'s ``backend=None``: "mosaic" on a compiled Hopper GPU where it applies and was measured
    faster, else "triton"."""
    if interpret or not backend_lib.is_hopper() or mosaic_unsupported(q, k, mods) is not None:
        return "triton"
    long_enough = max_seqlen >= MOSAIC_MIN_SEQLEN.get(q.shape[-1], max_seqlen + 1)
    return "mosaic" if long_enough and q.shape[0] >= MOSAIC_MIN_TOKENS else "triton"


_OPTIONAL_BOOL = functools.partial(validation.check_static_bool, optional=True)


def _owned_rows(cu_seqlens, num_tokens: int, max_seqlen: int):
    """``bool[T]``: the rows a request owns within its first ``max_seqlen`` (those the kernels compute)."""
    cu = metadata.clamp_cu(cu_seqlens, num_tokens)
    req = metadata.token_requests(cu, num_tokens)
    local = jnp.arange(num_tokens, dtype=jnp.int32) - cu[jnp.maximum(req, 0)]
    return (req >= 0) & (local < max_seqlen)


def backward_backend_for(q, requested: str | None, backward_config, interpret: bool = False) -> str:
    """The backward pass's backend: ``requested`` ("triton" / "mosaic") checked, or with None the Mosaic kernels
    where they apply, on a compiled Hopper GPU (faster than the Triton ones on P1's and P2's training steps on the
    H200, by 1.06-1.43x: docs/performance.md#varlen-backward) or wherever JAX no longer ships the Pallas Triton
    backend; else Triton. A ``backward_config`` (the Triton kernels' tiles) and interpret mode keep Triton. Raises
    ``ValueError`` naming the argument at trace time; where neither applies, the backward raises
    :class:`pallas_attn.BackendUnavailableError`."""
    if requested not in (None, *backend_lib.BACKENDS):
        raise ValueError(f"backward_backend must be one of {backend_lib.BACKENDS} or None; got {requested!r}")
    reason = mosaic_prefill_bwd.supported(q)
    if requested == "mosaic":
        if backward_config is not None:
            raise ValueError("backward_config= tunes the Triton backward; the Mosaic backward takes none (pass "
                             "backward_backend='triton')")
        if reason is not None:
            raise ValueError(f"backward_backend='mosaic' does not support {reason}; pass backward_backend='triton'")
        return "mosaic"
    if (requested is None and reason is None and backward_config is None
            and ((backend_lib.is_hopper() and not interpret) or not backend_lib.triton_available())):
        return "mosaic"
    return "triton"


def _differentiable(forward, *, return_lse: bool, max_seqlen: int, causal: bool, scale: float, interpret: bool,
                    cfg: config_lib.PrefillConfig, mods: masks.ScoreMods, backward_backend: str = "triton"):
    """``forward(..., return_lse=)`` (a kernel on ``(q, k, v, cu_seqlens, alibi_slopes, sinks)`` returning
    ``(out, lse | None)``) under :func:`jax.custom_vjp`, returning ``(out, lse)``. A plain call runs the kernel as
    asked (the LSE only with ``return_lse``; else a placeholder, dropped by the caller); under differentiation the
    forward also computes the LSE and saves it with ``out``, and the backward runs ``backward_backend``'s kernels:
    "triton", :mod:`pallas_attn.kernels.triton.prefill_bwd` (the docstring there has the formulas), or "mosaic",
    :mod:`pallas_attn.kernels.mosaic.prefill_bwd` (the same contract). Gradients reach q, k, v and the sinks; a
    cotangent on the returned LSE is honoured."""

    @jax.custom_vjp
    def attention(q, k, v, cu_seqlens, alibi_slopes, sinks):
        if return_lse:
            return forward(q, k, v, cu_seqlens, alibi_slopes, sinks, return_lse=True)
        out, _ = forward(q, k, v, cu_seqlens, alibi_slopes, sinks, return_lse=False)
        return out, jnp.zeros(q.shape[:2], jnp.float32)  # not returned: the kernel writes no LSE

    def attention_fwd(q, k, v, cu_seqlens, alibi_slopes, sinks):
        out, lse = forward(q, k, v, cu_seqlens, alibi_slopes, sinks, return_lse=True)
        return (out, lse), (q, k, v, cu_seqlens, alibi_slopes, sinks, out, lse)

    def attention_bwd(residuals, cotangents):
        q, k, v, cu_seqlens, alibi_slopes, sinks, out, lse = residuals
        d_out, d_lse = cotangents
        if backward_backend == "triton":
            reason = mosaic_prefill_bwd.supported(q)
            why = (f"its Mosaic GPU backward does not apply ({reason})" if reason
                   else "backward_backend='triton' or a backward_config asks for it")
            backend_lib.require_triton("the gradient of varlen_attention", why)
        owned = _owned_rows(cu_seqlens, q.shape[0], max_seqlen)[:, None]  # [T, 1]
        sees_keys = jnp.isfinite(lse) & owned  # [T, Hq]
        d_out = jnp.where(owned[..., None], d_out, jnp.zeros((), d_out.dtype))  # padding cotangents reach nothing
        delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)  # [T, Hq]: rowsum(dO ∘ O)
        denominator = lse if sinks is None else jnp.logaddexp(lse, sinks.astype(jnp.float32))  # [T, Hq], natural
        # A returned LSE's cotangent: d lse / d s_j = exp(s_j - lse) = P_j · exp(L - lse), folded into D.
        lse_per_p = jnp.where(sees_keys, jnp.exp(denominator - jnp.where(sees_keys, lse, 0.0)), 0.0)
        delta_lse = delta - jnp.where(sees_keys, d_lse, 0.0) * lse_per_p
        l2 = jnp.where(sees_keys, denominator * softmax.LOG2E, jnp.inf)  # a row with no key: P = 0
        if backward_backend == "mosaic":
            kernels = functools.partial(mosaic_prefill_bwd.varlen_attention_bwd_mosaic, interpret=interpret)
        else:
            kernels = functools.partial(prefill_bwd.varlen_attention_bwd_triton, interpret=interpret, cfg=cfg)
        dq, dk, dv = kernels(q, k, v, cu_seqlens, d_out.astype(q.dtype), l2, delta_lse, alibi_slopes,
                             max_seqlen=max_seqlen, causal=causal, scale=scale, mods=mods)
        zero = lambda x, like: jnp.where(owned[..., None], x, 0.0).astype(like.dtype)  # noqa: E731  unwritten rows
        d_sinks = None
        if sinks is not None:  # d/d sink_h = -Σ_rows P_sink · D, P_sink = exp(sink - L); a row with no key has D = 0
            p_sink = jnp.exp(sinks.astype(jnp.float32) - jnp.where(owned, denominator, jnp.inf))
            d_sinks = -jnp.sum(jnp.where(owned, p_sink * delta, 0.0), axis=0).astype(sinks.dtype)
        return zero(dq, q), zero(dk, k), zero(dv, v), None, None, d_sinks

    attention.defvjp(attention_fwd, attention_bwd)
    return attention


@common.front(arrays=("q", "k", "v", "alibi_slopes", "sinks"), int_arrays=("cu_seqlens",),
              statics=dict(max_seqlen=validation.check_static_int, causal=validation.check_static_bool,
                           softmax_scale=validation.check_softmax_scale, window_size=validation.check_window_size,
                           softcap=validation.check_softcap, return_lse=validation.check_static_bool,
                           interpret=_OPTIONAL_BOOL, deterministic=validation.check_static_bool))
@functools.partial(jax.jit, static_argnames=("max_seqlen", "causal", "softmax_scale", "window_size", "softcap",
                                             "return_lse", "interpret", "config", "backend", "backward_config",
                                             "backward_backend", "deterministic"))
def varlen_attention(q, k, v, cu_seqlens, *, max_seqlen: int, causal: bool = True, softmax_scale: float | None = None,
                     window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0, alibi_slopes=None, sinks=None,
                     return_lse: bool = False, interpret: bool | None = None,
                     config: config_lib.PrefillConfig | config_lib.MosaicPrefillConfig | None = None,
                     backend: str | None = None, backward_config: config_lib.PrefillConfig | None = None,
                     backward_backend: str | None = None, deterministic: bool = True):
    """Attention over requests packed along the token axis; each request sees only its own tokens.

    Args:
      q: ``[num_tokens, num_q_heads, head_dim]`` float32 / bfloat16 / float16; head_dim a multiple of 8 in
        [16, 512] (Triton pads it to a power of two inside).
      k, v: ``[num_tokens, num_kv_heads, head_dim]``, same dtype; ``num_q_heads % num_kv_heads == 0`` (GQA/MQA).
      cu_seqlens: ``i32[num_seqs + 1]``, non-decreasing from 0; request ``b`` owns rows
        ``[cu_seqlens[b], cu_seqlens[b+1])``. Rows at or past ``cu_seqlens[-1]`` are padding (output 0).
        ``[0]`` (no request) and ``num_tokens == 0`` are valid: zeros (LSE -inf), no kernel launched.
      max_seqlen: static Python int >= 1 bounding every request's length (bucket it, e.g. next power of two, so
        batches share one compiled program). A longer request is silently truncated: check with
        :func:`pallas_attn.checked`.
      causal: request-local causal mask (query ``i`` sees keys ``j <= i``); False: each request attends to all of
        its own tokens.
      softmax_scale: None (``1/sqrt(head_dim)``) or a finite Python float > 0.
      window_size: ``(left, right)`` (static; -1 unbounded): query ``i`` sees keys ``i - left <= j <= i + right``,
        request-local, with causality where causal. Key tiles wholly outside every row's window are never loaded.
      softcap: static float, 0 = off: scaled scores become ``softcap * tanh(score / softcap)``.
      alibi_slopes: ``f32[num_q_heads]`` or None: adds ``slope_h * (key_pos - query_pos)`` after the soft-cap.
      sinks: ``f32[num_q_heads]`` or None: ``exp(sink_h)`` joins each row's softmax denominator, with no value; the
        LSE stays over the keys only. The order of these is docs/design.md#model-family-features.
      return_lse: also return the natural-log LSE ``f32[num_tokens, num_q_heads]`` (``-inf`` for padding rows).
      interpret: None → compiled on GPU, interpreted on CPU (see :mod:`pallas_attn.core.backend`).
      config: the kernel's tuning knobs, never its semantics: :class:`pallas_attn.core.config.PrefillConfig`
        (Triton: block sizes, warps, stages) or :class:`pallas_attn.core.config.MosaicPrefillConfig` (Mosaic GPU:
        K/V slot size and count, P's column blocks). A config selects its backend when ``backend`` is None and must
        match it otherwise (``TypeError`` naming both classes). None → the tuned default of the chosen backend.
      backend: "triton" or "mosaic": the Hopper kernel of :mod:`pallas_attn.kernels.mosaic.prefill` (wgmma, TMA,
        warp specialisation; bf16/fp16, head_dim a multiple of 8 up to 256: 64, 128 and 256 natively, others
        zero-padded to the next — anything else raises ``ValueError`` naming head_dim; interpreted on CPU by the
        Mosaic GPU interpreter). None: the config's backend if one is given, else :func:`default_backend` —
        Mosaic on a compiled sm_90 GPU where it applies and was measured faster (``max_seqlen >=
        MOSAIC_MIN_SEQLEN[head_dim]``, head dims 64, 128 and 256, and ``num_tokens >= MOSAIC_MIN_TOKENS``), else
        Triton (every other head dim).
      backward_config: the backward pass's tiles (:class:`pallas_attn.core.config.PrefillConfig`: ``block_m``
        query rows of one head, ``block_n`` keys, warps, stages); None: :func:`pallas_attn.core.config.
        default_backward_config`.
      backward_backend: "triton" or "mosaic": the backward pass's kernels, whichever the forward's
        (:mod:`pallas_attn.kernels.mosaic.prefill_bwd`: bf16/fp16, head dims 64 and 128; otherwise ``ValueError``
        naming head_dim or dtype). None: Mosaic where it applies on Hopper (and wherever the Pallas Triton
        backend is gone), else Triton.
      deterministic: static bool. Both backward passes use no atomics (dK / dV and dQ are separate kernels), so
        gradients are bit-identical run to run either way; ``False`` (FlashAttention's leave to use atomic dQ
        accumulation) is accepted for code written against it and changes nothing: dQ accumulated by TMA
        reductions inside the dK / dV kernel measured slower than the separate dQ kernel
        (docs/performance.md#varlen-backward).

    Returns:
      ``out [num_tokens, num_q_heads, head_dim]`` in q's dtype (and ``lse`` if asked). Array arguments may be
      numpy arrays or lists (converted; integer lists to int32).

    Gradients: ``jax.grad`` / ``jax.vjp`` reach ``q``, ``k``, ``v`` (GQA: dK and dV summed over each group) and
    ``sinks``, with every feature above and a cotangent on the returned LSE; the forward saves only ``out`` and the
    LSE, and the backward (``backward_backend``'s kernels, either forward backend) recomputes the probabilities
    tile by tile. Rows
    no request owns, and a request's rows past ``max_seqlen``, get zero gradients, and nothing in them (NaN
    included) reaches another row's. No atomics: the gradients are bit-identical run to run. ``alibi_slopes`` and
    ``cu_seqlens`` get none. Forward-mode (``jax.jvp``) raises.

    Example:
      >>> cu = jnp.array([0, 6, 10], jnp.int32)          # request A: 6 tokens, B: 4 tokens
      >>> out = varlen_attention(q, k, v, cu, max_seqlen=8)
    """
    _validate(q, k, v, cu_seqlens)
    for name, x in (("alibi_slopes", alibi_slopes), ("sinks", sinks)):
        if x is not None:
            validation.check_head_vector(name, x, q.shape[1])
    mods = masks.ScoreMods(*window_size, softcap, alibi_slopes is not None, sinks is not None)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    interpret = backend_lib.resolve_interpret(interpret)
    backend = backend_lib.select_backend(
        backend, config=config, default=lambda: default_backend(q, k, max_seqlen, interpret, mods),
        mosaic_unsupported=lambda: mosaic_unsupported(q, k, mods), config_types=CONFIG_TYPES,
        function="varlen_attention")
    if q.shape[0] == 0 or cu_seqlens.shape[0] == 1:  # no tokens or no request: every row is padding, no kernel
        return common.no_rows(*q.shape, q.dtype, return_lse)
    if backend == "mosaic":
        run = functools.partial(mosaic_prefill.varlen_attention_mosaic, max_seqlen=max_seqlen, causal=causal,
                                scale=float(scale), interpret=interpret,
                                cfg=config or config_lib.default_mosaic_prefill_config(q.shape[-1]), mods=mods)
    else:
        cfg = config or config_lib.default_prefill_config(q.shape[-1], q.dtype.itemsize)
        run = functools.partial(triton_prefill.varlen_attention_triton, max_seqlen=max_seqlen, causal=causal,
                                scale=float(scale), interpret=interpret, cfg=cfg, mods=mods)
    attention = _differentiable(run, return_lse=return_lse, max_seqlen=max_seqlen, causal=causal, scale=float(scale),
                                interpret=interpret, mods=mods,
                                cfg=backward_config or config_lib.default_backward_config(q.shape[-1]),
                                backward_backend=backward_backend_for(q, backward_backend, backward_config, interpret))
    out, lse = attention(q, k, v, cu_seqlens, alibi_slopes, sinks)
    return (out, lse) if return_lse else out
