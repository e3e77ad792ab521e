"""What every public function shares around its jitted body.

* :func:`front`: the thin Python wrapper in front of the jitted function. It converts array arguments given as
  numpy arrays or lists (``jnp.asarray``; integer lists become int32 where the argument is int32) and checks the
  static Python arguments (:mod:`pallas_attn.core.validation`) before ``jax.jit`` hashes them, so a mistake is a
  ``TypeError`` / ``ValueError`` naming the argument instead of a hashing or attribute error from inside JAX. It
  only converts, checks and calls: the compile cache stays the jitted function's own (a new batch of the same
  shapes reuses its program), and ``functools.wraps`` keeps the signature and docstring for ``help`` and docs.
* :func:`renamed_argument`: a former argument name still accepted for one release, with a warning.
* Inside the jitted body: :func:`no_rows` (the answer of an empty batch, before any kernel: the kernels' grids and
  gathers need at least one row, one request and one page) and :func:`no_backward` (differentiation raises
  ``NotImplementedError`` naming the function instead of Pallas' bare ``AssertionError``).
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp

from pallas_attn.core import validation


def front(*, arrays: Sequence[str] = (), int_arrays: Sequence[str] = (),
          statics: Mapping[str, Callable] | None = None, scalars: Mapping[str, Callable] | None = None):
    """Decorator: the decorated (jitted) function behind a wrapper that converts and checks its arguments.

    Args:
      arrays: names of float array arguments (converted with :func:`pallas_attn.core.validation.as_array`).
      int_arrays: names of int32 array arguments (integer data converted to int32). An argument whose default is
        None may be None.
      statics: name → ``rule(name, value)`` returning the value to pass on (a ``check_static_*`` helper). Only the
        arguments the caller gives are checked: defaults are valid by construction.
      scalars: name → ``rule(name, value)`` for traced scalar arguments (FP8 cache scales): the rule converts a
        Python float to an array and checks the value where it is known, so a bad one is named here, while a new
        value does not recompile (it is an array to ``jax.jit``, not a static).

    The wrapper exposes ``normalize(*args, **kwargs) -> (args, kwargs)`` (what it would pass on), which
    :func:`pallas_attn.checked` uses to see the same arguments as the function, and the jitted function's
    ``lower`` / ``trace`` / ``eval_shape`` behind the same checks (``jax.ShapeDtypeStruct`` arguments pass as is).
    """
    statics = {**(statics or {}), **(scalars or {})}  # the same check-and-convert call; jit sees arrays for scalars
    int_set = frozenset(int_arrays)
    array_set = frozenset(arrays) | int_set

    def decorate(fn):
        name = fn.__name__
        sig = inspect.signature(fn)
        defaults = {k: p.default for k, p in sig.parameters.items()}

        def normalize(*args, **kwargs):
            try:
                bound = sig.bind(*args, **kwargs)
            except TypeError as e:  # missing / unexpected arguments: say whose
                raise TypeError(f"{name}(): {e}") from None
            values = bound.arguments
            for key, value in values.items():
                if key in array_set:
                    if value is None and defaults[key] is None:
                        continue
                    values[key] = validation.as_array(key, value, jnp.int32 if key in int_set else None)
                elif key in statics:
                    values[key] = statics[key](key, value)
            return bound.args, bound.kwargs

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            args, kwargs = normalize(*args, **kwargs)
            return fn(*args, **kwargs)

        wrapper.normalize = normalize
        for method in ("lower", "trace", "eval_shape"):  # the jitted function's AOT API, behind the same checks
            if hasattr(fn, method):
                setattr(wrapper, method, _behind(normalize, getattr(fn, method)))
        return wrapper

    return decorate


def _behind(normalize, method):
    @functools.wraps(method)
    def call(*args, **kwargs):
        args, kwargs = normalize(*args, **kwargs)
        return method(*args, **kwargs)
    return call


def renamed_argument(old: str, new: str):
    """Decorator: the argument ``new`` of the decorated function is also accepted under its former name ``old=``
    for one release. ``old=`` warns (``DeprecationWarning`` naming ``new``) and passes its value on; giving both
    raises ``TypeError``. A thin Python layer: the signature, the docstring and, for a jitted function, its compile
    cache stay the function's own (the value goes in as ``new``'s positional argument where it can, so a call with
    ``old=`` reuses the program compiled for positional calls)."""

    def decorate(fn):
        name = fn.__name__
        position = list(inspect.signature(fn).parameters).index(new)

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if old in kwargs:
                if new in kwargs or len(args) > position:
                    raise TypeError(f"{name}() got both {new} and its deprecated alias {old}=; pass {new} only")
                warnings.warn(f"{name}(): {old}= is deprecated, pass {new}= (the same values); {old}= will be "
                              f"removed in the next release", DeprecationWarning, stacklevel=2)
                value = kwargs.pop(old)
                if len(args) == position:
                    args = (*args, value)
                else:
                    kwargs[new] = value
            return fn(*args, **kwargs)

        wrapper.renamed_arguments = {**getattr(fn, "renamed_arguments", {}), old: new}
        return wrapper

    return decorate


def no_rows(rows: int, heads: int, dim: int, dtype, return_lse: bool):
    """The result of a batch in which no row sees a key (no tokens, no requests, no pages): ``out`` zeros
    ``dtype[rows, heads, dim]`` and ``lse`` ``f32[rows, heads]`` all ``-inf`` (the kernels' convention for a row
    that sees no key, and for padding rows)."""
    out = jnp.zeros((rows, heads, dim), dtype)
    return (out, jnp.full((rows, heads), -jnp.inf, jnp.float32)) if return_lse else out


def no_backward(name: str, fn: Callable) -> Callable:
    """``fn`` (arrays → arrays) as a :func:`jax.custom_jvp` whose rule raises ``NotImplementedError`` naming
    ``name``: ``jax.grad`` / ``jax.jvp`` / ``jax.vjp`` through a kernel fail loudly at trace time. A plain call
    runs ``fn`` unchanged (the ``custom_jvp_call`` is inlined when lowered: no runtime cost). Close over static
    arguments (``functools.partial``); integer arrays are fine as arguments."""
    guarded = jax.custom_jvp(fn)

    def rule(primals, tangents):
        del primals, tangents
        raise NotImplementedError(
            f"{name} has no backward pass yet; jax.grad, jax.jvp and jax.vjp cannot differentiate it. To "
            f"differentiate the rest of a model around it, pass its inputs through jax.lax.stop_gradient")

    guarded.defjvp(rule)
    return guarded
