"""Where kernels run: compiled on a CUDA GPU, interpreted on CPU.

`interpret=None` (the default of every public function) resolves, in order, to
  1. the environment variable ``PALLAS_ATTN_INTERPRET`` ("1"/"true" forces interpret mode, "0"/"false" forces
     compilation), then
  2. interpret mode unless JAX's default backend is a GPU.
Interpret mode runs the very same kernel bodies through XLA on the host: slow, but a real test of the kernel code.
"""

from __future__ import annotations

import functools
import os

import jax

try:  # JAX deprecated the Pallas Triton backend in 0.11 and will remove it: the library imports without it
    from jax.experimental.pallas import triton as pallas_triton
except ImportError:
    pallas_triton = None

ENV_INTERPRET = "PALLAS_ATTN_INTERPRET"
BACKENDS = ("triton", "mosaic")  # kernels with a Hopper (Mosaic GPU) twin take backend= one of these
H200_SM_COUNT = 132  # used for heuristics when no GPU is visible (interpret mode, CPU tests)


class BackendUnavailableError(RuntimeError):
    """A kernel needs a Pallas backend that the installed JAX does not ship."""


def triton_available() -> bool:
    """The installed JAX still ships ``jax.experimental.pallas.triton``."""
    return pallas_triton is not None


def require_triton(function: str, why: str = "it has no Mosaic GPU kernel yet") -> None:
    """Raise :class:`BackendUnavailableError` naming ``function`` when the Pallas Triton backend is gone."""
    if pallas_triton is None:
        raise BackendUnavailableError(
            f"{function} runs on the Pallas Triton backend, which jax {jax.__version__} does not ship "
            f"(jax.experimental.pallas.triton cannot be imported), and {why}; use a JAX release that still ships "
            "it (up to the one that removes it: the Triton backend is deprecated since JAX 0.11)")


def resolve_interpret(interpret: bool | None) -> bool:
    """The effective interpret flag for a call (see the module docstring)."""
    if interpret is not None:
        return bool(interpret)
    env = os.environ.get(ENV_INTERPRET, "").strip().lower()
    if env in ("1", "true", "yes"):
        return True
    if env in ("0", "false", "no"):
        return False
    return not on_gpu()


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


@functools.cache
def device_kind() -> str:
    """`jax.devices()[0].device_kind`, e.g. 'NVIDIA H200' (or 'cpu')."""
    return jax.devices()[0].device_kind


@functools.cache
def num_sms() -> int:
    """Streaming multiprocessors of the first GPU; the H200's 132 when there is none (interpret mode)."""
    if on_gpu():
        count = getattr(jax.devices()[0], "core_count", None)
        if count:
            return int(count)
    return H200_SM_COUNT


@functools.cache
def is_hopper() -> bool:
    """A compiled sm_90 GPU (H100 / H200): where the Mosaic GPU kernels (wgmma, TMA) run."""
    if not on_gpu():
        return False
    return str(getattr(jax.devices()[0], "compute_capability", "")).startswith("9.")


def select_backend(backend: str | None, *, config, default, mosaic_unsupported, config_types=None,
                   function: str = "this function") -> str:
    """The ``backend=`` argument of a kernel with a Mosaic GPU twin, resolved and checked at trace time.

    ``config_types`` maps each backend to the config class it takes (e.g. ``{"triton": PrefillConfig, "mosaic":
    MosaicPrefillConfig}``): a ``config`` picks the backend of its class when ``backend`` is None and must be of the
    chosen backend's class, else ``TypeError``. Without ``config_types`` only the Triton kernel takes a config:
    ``None`` → ``default()`` unless a config was given (then "triton"), and ``"mosaic"`` with one raises
    ``ValueError``. ``"mosaic"`` where ``mosaic_unsupported()`` gives a reason raises ``ValueError``. Without the
    Pallas Triton backend (:func:`triton_available`) the default is Mosaic where it applies; "triton", asked for or
    the only choice, raises :class:`BackendUnavailableError` naming ``function``."""
    if backend not in (None, *BACKENDS):
        raise ValueError(f"backend must be one of {BACKENDS} or None; got {backend!r}")
    if config_types is not None and config is not None:
        owner = next((name for name, cls in config_types.items() if isinstance(config, cls)), None)
        if backend is None and owner is None:
            classes = " or ".join(f"{cls.__name__} (backend={name!r})" for name, cls in config_types.items())
            raise TypeError(f"config must be a {classes}; got {type(config).__name__}")
        if backend is not None and owner != backend:
            raise TypeError(f"config must be a {config_types[backend].__name__} for {backend=}; got "
                            f"{type(config).__name__}")
        backend = owner
    elif backend is None:
        if config is not None:
            backend = "triton"
        else:
            backend = default()
            if backend == "triton" and pallas_triton is None:  # the Hopper kernel where it applies, else an error
                reason = mosaic_unsupported()
                if reason is None:
                    return "mosaic"
                require_triton(function, f"its Mosaic GPU kernel does not apply here ({reason})")
    elif backend == "mosaic" and config is not None:
        raise ValueError("config= tunes the Triton kernel; the Mosaic kernel takes none (pass backend='triton')")
    if backend == "mosaic":
        reason = mosaic_unsupported()
        if reason is not None:
            raise ValueError(f"backend='mosaic' does not support {reason}; pass backend='triton'")
    if backend == "triton":
        require_triton(function, "backend='triton' (or a Triton config) asks for it")
    return backend
