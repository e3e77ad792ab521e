"""Safe mode: ``checked(kernel)`` verifies the batch DATA (lengths, tables, indices) before the kernel runs.

The kernels validate shapes and dtypes at trace time, always. Values they cannot check for free: a ``cu_seqlens``
that decreases, a request longer than the static ``max_seqlen`` (silently truncated), a block-table entry past the
page pool (an out-of-bounds read on the GPU), a top-k index past the request's keys. ``checked`` wraps one of the
five public kernels in a function of the same signature that first runs those rules as
:mod:`jax.experimental.checkify` checks inside a small jitted program, raises a readable error naming the argument
and the offending request / index, and only then calls the untouched kernel. Nothing changes when you do not use it
(zero cost when off); with it, each call pays one extra tiny launch and a host sync: a debug mode, not a hot path.

Rules (``B`` requests, ``T`` packed rows, ``bs`` = block_size; the kernel's static maxima in brackets):

* ``cu_seqlens`` / ``cu_query_lens``: ``[0] == 0``, non-decreasing, ``[-1] <= T``; each length ``<=`` the static
  maximum (``max_seqlen`` / ``max_query_len``).
* ``seq_lens``: ``>= 0``; ``q_len <= seq_len`` (ragged paged attention, dense MLA with ``cu_query_lens``).
* ``block_tables``: wide enough (``cdiv(len, bs) <= max_blocks``) and entries ``[b, :cdiv(len, bs)]`` in
  ``[0, num_blocks)``. Entries past a request's last page are never read, so they may hold anything.
* ``topk_indices`` (sparse MLA, real tokens only): ``>= -1``; ``< seq_lens[request]`` when ``seq_lens`` is given,
  else ``< max_blocks * bs``; the page each valid index lands on in ``[0, num_blocks)``.

The error is :class:`CheckError`, a ``ValueError``; checkify reports the first failing rule in the order above.

Example::

    >>> from pallas_attn import varlen_attention
    >>> from pallas_attn.checks import checked
    >>> safe_varlen = checked(varlen_attention)
    >>> cu = jnp.array([0, 6, 4], jnp.int32)              # decreasing: request 1 has length -2
    >>> safe_varlen(q, k, v, cu, max_seqlen=8)
    CheckError: varlen_attention: cu_seqlens must be non-decreasing; request 1 has cu_seqlens[1]=6 >
    cu_seqlens[2]=4 (failed at ...)

Empty batches (no request, no token, no page) are checked like any other (``cu_seqlens = [0]`` passes) and the
kernel returns zeros for them.

Inside your own ``jax.jit``: a check cannot raise from inside a compiled program, so ``checked`` emits its rules as
``checkify.check`` calls into your trace and runs the kernel only when they pass (``lax.cond``; otherwise it returns
zeros, so a bad page id never reaches the GPU). Functionalize the step with ``checkify.checkify`` and throw on the
host; the error's message is the failing rule's, naming the argument::

    >>> from jax.experimental import checkify
    >>> def step(q, k, v, cu):
    ...     return safe_varlen(q, k, v, cu, max_seqlen=8)
    >>> err, out = jax.jit(checkify.checkify(step))(q, k, v, cu)     # or checkify.checkify(jax.jit(step))
    >>> err.throw()
    JaxRuntimeError: cu_seqlens must be non-decreasing; request 1 has cu_seqlens[1]=6 > cu_seqlens[2]=4 ...

Called inside ``jax.jit`` (or ``lax.cond`` / ``lax.scan``) with no ``checkify.checkify`` around it, ``checked``
raises ``ValueError`` at once, showing that pattern (JAX itself would only fail later, when compiling the caller).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import checkify

from pallas_attn.core.metadata import token_requests
from pallas_attn.ops import (
    decode as decode_ops,
    mla as mla_ops,
    paged as paged_ops,
    sparse_mla as sparse_ops,
    varlen as varlen_ops,
)
from pallas_attn.ops.common import renamed_argument
from pallas_attn.ops.decode import paged_decode_attention
from pallas_attn.ops.mla import mla_attention
from pallas_attn.ops.paged import paged_attention
from pallas_attn.ops.sparse_mla import sparse_mla_attention
from pallas_attn.ops.varlen import varlen_attention


class CheckError(ValueError):
    """A data rule of :func:`checked` failed; the message names the argument and the offending request / index."""


# ------------------------------------------------------------------------------------------------ rule helpers
# Each helper checks one rule over a vector and returns a scalar bool "it holds" (for the lax.cond gate). The
# first offending position is found with argmax and formatted into the message by checkify.


def _first(bad):
    """Index of the first True of ``bad`` (any rank; a flat index for rank > 1); 0 when ``bad`` is empty."""
    if bad.size == 0:  # an empty batch: nothing is bad, the index only feeds a message that is never shown
        return jnp.int32(0)
    return jnp.argmax(bad.reshape(-1)).astype(jnp.int32)


def _at(x, *index):
    """``x[index]`` for a message; 0 when ``x`` is empty (an empty batch has no position to report)."""
    return x[index] if x.size else jnp.zeros((), x.dtype)


def _gather(x, rows):
    """``x[rows]`` along axis 0; zeros of that shape when ``x`` has no rows (no request)."""
    return x[rows] if x.shape[0] else jnp.zeros(rows.shape + x.shape[1:], x.dtype)


def _require(bad, msg: str, **fmt) -> jax.Array:
    """``checkify.check(not any(bad), msg)``; ``fmt`` values are gathered at the first bad position."""
    ok = ~jnp.any(bad)
    checkify.check(ok, msg, **fmt)
    return ok


def _check_cu(name: str, cu, num_tokens: int, max_len: int | None) -> tuple[jax.Array, jax.Array]:
    """``cu`` i32[B + 1]: starts at 0, non-decreasing, ends <= num_tokens, lengths <= max_len. Returns (ok, lens)."""
    lens = cu[1:] - cu[:-1]  # i32[B]
    oks = [_require(cu[0] != 0, f"{name} must start at 0; got {name}[0]={{v}}", v=cu[0])]
    dec = lens < 0
    b = _first(dec)
    oks.append(_require(dec, f"{name} must be non-decreasing; request {{b}} has {name}[{{b}}]={{lo}} > "
                             f"{name}[{{b1}}]={{hi}}", b=b, b1=b + 1, lo=_at(cu, b), hi=_at(cu, b + 1)))
    oks.append(_require(cu[-1] > num_tokens, f"{name}[-1]={{v}} must be <= num_tokens={num_tokens} (q.shape[0])",
                        v=cu[-1]))
    if max_len is not None:
        arg = "max_seqlen" if name == "cu_seqlens" else "max_query_len"
        long = lens > max_len
        b = _first(long)
        oks.append(_require(long, f"request {{b}} has length {{n}} ({name}[{{b1}}] - {name}[{{b}}]) > "
                                  f"{arg}={max_len}; the kernel would silently truncate it", b=b, b1=b + 1,
                            n=_at(lens, b)))
    return jnp.stack(oks).all(), lens


def _check_nonneg(name: str, lens) -> jax.Array:
    neg = lens < 0
    b = _first(neg)
    return _require(neg, f"{name} must be >= 0; {name}[{{b}}]={{v}}", b=b, v=_at(lens, b))


def _check_pages(lens, block_tables, num_blocks: int, block_size: int, len_name: str) -> jax.Array:
    """Every page request b uses (``cdiv(lens[b], block_size)``) fits the table and is in ``[0, num_blocks)``."""
    max_blocks = block_tables.shape[1]
    pages = (jnp.maximum(lens, 0) + block_size - 1) // block_size  # i32[B]
    wide = pages > max_blocks
    b = _first(wide)
    ok_wide = _require(wide, f"block_tables is too narrow: request {{b}} has {len_name}={{n}}, which needs "
                             f"{{p}} pages of block_size={block_size}, but max_blocks={max_blocks}",
                       b=b, n=_at(lens, b), p=_at(pages, b))
    used = jnp.arange(max_blocks)[None, :] < pages[:, None]  # bool[B, max_blocks]
    bad = used & ((block_tables < 0) | (block_tables >= num_blocks))
    i = _first(bad)
    b, p = i // max(max_blocks, 1), i % max(max_blocks, 1)
    ok_range = _require(bad, f"block_tables[{{b}}, {{p}}]={{v}} is not a page id in [0, num_blocks={num_blocks}) "
                             f"but request {{b}} uses page {{p}} ({len_name}={{n}}, block_size={block_size})",
                        b=b, p=p, v=_at(block_tables, b, p), n=_at(lens, b))
    return ok_wide & ok_range


# ------------------------------------------------------------------------------------------ per-kernel rules
# Each takes the bound arguments (a dict) and returns a scalar bool: all rules hold.


def _varlen_rules(a) -> jax.Array:
    ok, _ = _check_cu("cu_seqlens", a["cu_seqlens"], a["q"].shape[0], a["max_seqlen"])
    return ok


def _check_kv_scales(a) -> jax.Array:
    """An FP8 cache's scales, traced (their values unknown in front of the call): finite and positive."""
    ok = jnp.bool_(True)
    for name in ("k_scale", "v_scale"):
        if a.get(name) is not None and a[name].ndim == 0:  # a scale cache's unused slots may hold anything
            ok &= _require(~(jnp.isfinite(a[name]) & (a[name] > 0)), f"{name} must be finite and positive; got {{v}}",
                           v=a[name])
    return ok


def _decode_rules(a) -> jax.Array:
    seq_lens, k_cache = a["seq_lens"], a["k_cache"]
    return (_check_nonneg("seq_lens", seq_lens) & _check_kv_scales(a)
            & _check_pages(seq_lens, a["block_tables"], k_cache.shape[0], k_cache.shape[1], "seq_lens"))


def _check_new_tokens(a) -> jax.Array:
    """``cu_query_lens`` and ``seq_lens`` of a batch of new tokens over a paged cache: each request's new tokens
    are among its keys."""
    seq_lens = a["seq_lens"]
    ok, q_lens = _check_cu("cu_query_lens", a["cu_query_lens"], a["q"].shape[0], a["max_query_len"])
    ok &= _check_nonneg("seq_lens", seq_lens)
    over = q_lens > seq_lens
    b = _first(over)
    return ok & _require(over, "request {b} has q_len={n} new tokens > seq_lens[{b}]={s} keys (its new tokens "
                               "must already be in the cache)", b=b, n=_at(q_lens, b), s=_at(seq_lens, b))


def _paged_rules(a) -> jax.Array:
    seq_lens, k_cache = a["seq_lens"], a["k_cache"]
    ok = _check_new_tokens(a) & _check_kv_scales(a)
    return ok & _check_pages(seq_lens, a["block_tables"], k_cache.shape[0], k_cache.shape[1], "seq_lens")


def _mla_rules(a) -> jax.Array:
    seq_lens, kv_cache = a["seq_lens"], a["kv_cache"]
    ok = _check_nonneg("seq_lens", seq_lens) if a["cu_query_lens"] is None else _check_new_tokens(a)
    return ok & _check_pages(seq_lens, a["block_tables"], kv_cache.shape[0], kv_cache.shape[1], "seq_lens")


def _sparse_rules(a) -> jax.Array:
    q, kv_cache, tables, topk = a["q"], a["kv_cache"], a["block_tables"], a["topk_indices"]
    num_tokens = q.shape[0]
    num_blocks, block_size = kv_cache.shape[:2]
    max_blocks = tables.shape[1]
    cu, seq_lens = a["cu_query_lens"], a["seq_lens"]
    ok = jnp.bool_(True)
    tok = jnp.arange(num_tokens, dtype=jnp.int32)
    if cu is None:
        req = tok  # one token per request
    else:
        ok &= _check_cu("cu_query_lens", cu, num_tokens, None)[0]
        req = token_requests(cu, num_tokens)  # -1: padding token, never read
    real = (req >= 0)[:, None]  # bool[T, 1]
    req_safe = jnp.maximum(req, 0)
    topk_len = topk.shape[1]

    def at(bad):  # (token, slot) of the first bad entry
        i = _first(bad)
        return i // max(topk_len, 1), i % max(topk_len, 1)

    bad = real & (topk < -1)
    t, j = at(bad)
    ok &= _require(bad, "topk_indices[{t}, {j}]={v} must be >= 0, or -1 for an unused slot", t=t, j=j,
                   v=_at(topk, t, j))
    valid = real & (topk >= 0)
    if seq_lens is not None:
        ok &= _check_nonneg("seq_lens", seq_lens)
        ok &= _check_pages(seq_lens, tables, num_blocks, block_size, "seq_lens")
        limit = _gather(seq_lens, req_safe)[:, None]  # i32[T, 1]
        bad = valid & (topk >= limit)
        t, j = at(bad)
        b = _at(req_safe, t)
        ok &= _require(bad, "topk_indices[{t}, {j}]={v} must be < seq_lens[{b}]={n} (token {t} belongs to "
                            "request {b})", t=t, j=j, v=_at(topk, t, j), b=b, n=_at(seq_lens, b))
    else:
        capacity = max_blocks * block_size
        bad = valid & (topk >= capacity)
        t, j = at(bad)
        ok &= _require(bad, f"topk_indices[{{t}}, {{j}}]={{v}} must be < max_blocks * block_size = {capacity} "
                            f"(pass seq_lens= to check against each request's length)", t=t, j=j,
                       v=_at(topk, t, j))
        if max_blocks == 0:  # no page at all: every index >= 0 already failed the capacity rule
            return ok
        page_idx = jnp.clip(topk // block_size, 0, max_blocks - 1)
        page = jnp.take_along_axis(_gather(tables, req_safe), page_idx, axis=1)  # i32[T, topk]
        bad = valid & (topk < capacity) & ((page < 0) | (page >= num_blocks))
        t, j = at(bad)
        ok &= _require(bad, f"topk_indices[{{t}}, {{j}}]={{v}} lands on block_tables[{{b}}, {{p}}]={{g}}, not a "
                            f"page id in [0, num_blocks={num_blocks})", t=t, j=j, v=_at(topk, t, j),
                       b=_at(req_safe, t), p=_at(page_idx, t, j), g=_at(page, t, j))
    return ok


@dataclasses.dataclass(frozen=True)
class _Spec:
    rules: Callable  # bound arguments -> scalar bool (emits checkify.check calls)
    validate: Callable  # bound arguments -> None: the kernel's own static (shape / dtype) rules, raised first
    arrays: tuple[str, ...]  # traced arguments; every other argument is static


_SPECS: dict[Callable, _Spec] = {
    varlen_attention: _Spec(_varlen_rules, lambda a: varlen_ops._validate(a["q"], a["k"], a["v"], a["cu_seqlens"]),
                            ("q", "k", "v", "cu_seqlens", "alibi_slopes", "sinks")),
    paged_decode_attention: _Spec(_decode_rules,
                                  lambda a: decode_ops._validate(*(a[k] for k in ("q", "k_cache", "v_cache",
                                                                                  "block_tables", "seq_lens")),
                                                                 a.get("k_scale"), a.get("v_scale")),
                                  ("q", "k_cache", "v_cache", "block_tables", "seq_lens", "alibi_slopes", "sinks",
                                   "k_scale", "v_scale")),
    paged_attention: _Spec(_paged_rules,
                           lambda a: paged_ops._validate(*(a[k] for k in ("q", "k_cache", "v_cache", "block_tables",
                                                                          "seq_lens", "cu_query_lens")),
                                                         a.get("k_scale"), a.get("v_scale")),
                           ("q", "k_cache", "v_cache", "block_tables", "seq_lens", "cu_query_lens", "alibi_slopes",
                            "sinks", "k_scale", "v_scale")),
    mla_attention: _Spec(_mla_rules,
                         lambda a: mla_ops._validate(*(a[k] for k in ("q", "kv_cache", "block_tables", "seq_lens",
                                                                      "cu_query_lens", "kv_lora_rank",
                                                                      "max_query_len"))),
                         ("q", "kv_cache", "block_tables", "seq_lens", "cu_query_lens", "sinks")),
    sparse_mla_attention: _Spec(_sparse_rules,
                                lambda a: sparse_ops._validate(*(a[k] for k in (
                                    "q", "kv_cache", "block_tables", "topk_indices", "cu_query_lens", "seq_lens",
                                    "kv_lora_rank"))),
                                ("q", "kv_cache", "block_tables", "topk_indices", "cu_query_lens", "seq_lens",
                                 "sinks")),
}


# ----------------------------------------------------------------------------------------------- the wrapper


@functools.partial(jax.jit, static_argnames=("fn", "statics"))
def _run_checks(arrays: dict, *, fn: Callable, statics: tuple):
    """The jitted check program: ``(checkify error, ok)``; the kernel is not part of it."""
    return checkify.checkify(_SPECS[fn].rules)({**arrays, **dict(statics)})


def _is_traced(tree) -> bool:
    return any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves(tree))


def _checks_reach_checkify() -> bool:
    """Whether ``checkify.check`` calls made now will be functionalized: True eagerly (``jax.vmap`` of a call, say)
    and under a ``checkify.checkify`` trace; False inside a staged function (``jax.jit``, ``lax.cond``, ...) that
    no ``checkify.checkify`` encloses, where JAX would fail only when lowering the caller's program, after
    ``checked`` has returned, with a message that does not say what to do.

    Reads JAX's trace stack (``jax._src.core.trace_ctx``, each trace's ``parent_trace`` and its ``traced_for``:
    private, so read defensively); when it cannot be read, it answers True and JAX's own error stands.
    """
    try:
        from jax._src import core as jax_core
        trace = jax_core.trace_ctx.trace
    except (ImportError, AttributeError):
        return True
    staged = False
    while trace is not None:
        frame = getattr(trace, "frame", None)  # staging traces (jaxpr builders) have one
        if frame is not None:
            if getattr(getattr(frame, "debug_info", None), "traced_for", None) == "checkify":
                return True
            staged = True
        trace = getattr(trace, "parent_trace", None)
    return not staged


def _not_functionalized(name: str) -> ValueError:
    return ValueError(
        f"checked({name}) was called inside jax.jit (or another staged function: lax.cond, lax.scan, ...) that "
        f"checkify does not functionalize: a check cannot raise from inside a compiled program. Functionalize the "
        f"step and throw on the host:\n"
        f"    from jax.experimental import checkify\n"
        f"    err, out = jax.jit(checkify.checkify(step))(*args)\n"
        f"    err.throw()  # raises with the failing rule's message\n"
        f"or call checked({name}) outside jax.jit.")


def checked(fn: Callable) -> Callable:
    """``fn`` (one of the five public kernels) with its data rules checked first; same signature and outputs.

    Args:
      fn: :func:`~pallas_attn.varlen_attention`, :func:`~pallas_attn.paged_decode_attention`,
        :func:`~pallas_attn.paged_attention`, :func:`~pallas_attn.mla_attention` or
        :func:`~pallas_attn.sparse_mla_attention`.

    Returns:
      A function with ``fn``'s signature that raises :class:`CheckError` when the data breaks a rule of this
      module's docstring and otherwise returns exactly what ``fn`` returns (the same compiled kernel on the same
      arguments: bit-identical). It takes the arguments ``fn`` takes (numpy arrays and lists included) and raises
      ``fn``'s own static errors (shapes, dtypes, static arguments) before checking any value.

    Raises:
      TypeError: ``fn`` is not one of the five kernels.
      ValueError (when called): inside ``jax.jit`` without ``checkify.checkify`` around it; the message shows
        the pattern to use (this module's docstring).
    """
    spec = _SPECS.get(fn)
    if spec is None:
        raise TypeError(f"checked() takes one of {[f.__name__ for f in _SPECS]}; got {fn!r}")
    name = fn.__name__
    sig = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        args, kwargs = fn.normalize(*args, **kwargs)  # fn's own conversions and static-argument checks
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        arrays = {k: bound.arguments[k] for k in spec.arrays}
        statics = tuple(sorted((k, v) for k, v in bound.arguments.items() if k not in spec.arrays))
        spec.validate({**arrays, **dict(statics)})
        if _is_traced(arrays):  # inside the caller's trace: emit checks, gate the kernel on them
            if not _checks_reach_checkify():
                raise _not_functionalized(name)
            ok = spec.rules({**arrays, **dict(statics)})
            shapes = jax.eval_shape(functools.partial(fn, **kwargs), *args)
            zeros = lambda: jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
            return jax.lax.cond(ok, lambda: fn(*args, **kwargs), zeros)
        err, _ = _run_checks(arrays, fn=fn, statics=statics)
        try:
            err.throw()
        except checkify.JaxRuntimeError as e:
            raise CheckError(f"{name}: {e}") from None
        return fn(*args, **kwargs)

    del wrapper.normalize  # copied from fn by functools.wraps: the wrapper normalizes through fn
    for old, new in getattr(fn, "renamed_arguments", {}).items():  # the kernel's deprecated names work here too
        wrapper = renamed_argument(old, new)(wrapper)
    return wrapper
