"""Helpers of the public API layer shared by several public functions."""

from __future__ import annotations

import functools
import inspect
import warnings


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
