"""Static (trace-time) checks shared by every public function: one helper per rule, messages that name the
argument, what it got and what it needs.

Two kinds: array rules (rank, dtype, shape agreement; run inside the jitted function, once per trace) and Python
argument rules (``as_array`` and the ``check_static_*`` helpers; run by the thin wrapper in front of each jitted
function, :func:`pallas_attn.ops.common.front`, before ``jax.jit`` hashes the static arguments). Values inside
arrays (lengths, page ids, boundaries) are data, never checked here: :func:`pallas_attn.checked` reports them.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))  # paged caches: stored = value / scale
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 512  # multiples of 8; the Triton kernels pad to the next power of two inside
# Tokens per KV page: a power of two up to 16, or any multiple of 16 up to 1024 (vLLM's page sizes, 48 and 544
# included). The kernels read each key's page through the block table (core/tiles.paged_rows), so a page need not
# divide a key tile nor a tile a page.
SMALL_BLOCK_SIZES, BLOCK_SIZE_STEP, MAX_BLOCK_SIZE = (1, 2, 4, 8), 16, 1024
BLOCK_SIZE_RULE = (f"a power of two up to {BLOCK_SIZE_STEP} or a multiple of {BLOCK_SIZE_STEP} up to "
                   f"{MAX_BLOCK_SIZE} (e.g. 8, 16, 48, 544, {MAX_BLOCK_SIZE})")


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
    if not (block_size in SMALL_BLOCK_SIZES or (BLOCK_SIZE_STEP <= block_size <= MAX_BLOCK_SIZE
                                                and block_size % BLOCK_SIZE_STEP == 0)):
        raise ValueError(f"{block_size=} (tokens per page, cache axis 1) unsupported; need {BLOCK_SIZE_RULE}")


_INT32 = np.iinfo(np.int32)
_STATIC_HINT = ("it is static (part of the compiled program): compute it on the host, outside jax.jit, and "
                "bucket it (e.g. the next power of two) so that batches share one program")


def _describe(value) -> str:
    """``value`` for a message: arrays and tracers by kind, dtype and shape, anything else by repr and type."""
    if isinstance(value, jax.core.Tracer):
        return f"a traced {value.dtype}{list(value.shape)} (a jax.jit argument or a value computed from one)"
    if isinstance(value, (jax.Array, np.ndarray)):
        return f"a {'jax' if isinstance(value, jax.Array) else 'numpy'} array {value.dtype}{list(value.shape)}"
    return f"{value!r} ({type(value).__name__})"


def as_array(name: str, x, dtype=None):
    """``x`` as a jax array: jax arrays, tracers and ``jax.ShapeDtypeStruct`` s (ahead-of-time lowering) pass
    unchanged; numpy arrays, (nested) lists, tuples and scalars are converted. ``dtype=jnp.int32`` (the argument
    is int32): integer data (and an empty list) becomes int32; other data keeps its dtype, so the argument's dtype
    rule reports it."""
    if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)):  # tracers included: nothing to convert, no host copy
        return x
    try:
        arr = np.asarray(x)
    except (TypeError, ValueError) as e:  # ragged nesting, unconvertible objects
        raise TypeError(f"{name} must be an array (jax, numpy, or a nested list of numbers); got "
                        f"{_describe(x)}: {e}") from None
    if not (arr.dtype == np.bool_ or jnp.issubdtype(arr.dtype, jnp.number)):  # bfloat16 (kind "V") included
        raise TypeError(f"{name} must be an array of numbers (jax, numpy, or a nested list); got {_describe(x)}")
    if dtype is not None and jnp.dtype(dtype) == jnp.int32 and (arr.dtype.kind in "iu" or arr.size == 0):
        if arr.size and (arr.min() < _INT32.min or arr.max() > _INT32.max):
            raise ValueError(f"{name} must be int32; got values in [{arr.min()}, {arr.max()}], outside the int32 "
                             f"range")
        arr = arr.astype(np.int32)
    return jnp.asarray(arr)


def check_static_int(name: str, value, *, optional: bool = False) -> int | None:
    """A static size: a Python int >= 1 (a numpy integer scalar is accepted and converted); None too when
    ``optional``. Not a bool, not a jax / numpy array, not a traced value."""
    if value is None and optional:
        return None
    need = f"{name} must be a static Python int >= 1{' or None' if optional else ''}"
    if isinstance(value, (jax.Array, np.ndarray)):
        raise TypeError(f"{need}; got {_describe(value)}: pass a Python int; {_STATIC_HINT}")
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{need}; got {name}={_describe(value)}")
    if value < 1:
        raise ValueError(f"{need}; got {name}={int(value)}")
    return int(value)


def check_static_bool(name: str, value, *, optional: bool = False) -> bool | None:
    """A static flag: a Python (or numpy) bool; None too when ``optional``."""
    if value is None and optional:
        return None
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    need = f"{name} must be a static Python bool{' or None' if optional else ''}"
    if isinstance(value, (jax.Array, np.ndarray)):
        raise TypeError(f"{need}; got {_describe(value)}: pass True or False; it selects the compiled program")
    raise TypeError(f"{need}; got {name}={_describe(value)}")


def check_softmax_scale(name: str, value) -> float | None:
    """None (``1/sqrt(head_dim)``) or a finite positive Python / numpy number, returned as a Python float."""
    if value is None:
        return None
    need = f"{name} must be None or a finite Python float > 0"
    if isinstance(value, (jax.Array, np.ndarray)):
        raise TypeError(f"{need}; got {_describe(value)}: pass float(scale) computed on the host; it is static "
                        f"(part of the compiled program)")
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{need}; got {name}={_describe(value)}")
    scale = float(value)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"{need}; got {name}={scale}")
    return scale


def check_single_array(name: str, x, hint: str) -> None:
    """``x`` is one array, not a tuple of them (``(out, lse)`` from ``return_lse=True``, say)."""
    if isinstance(x, tuple):
        raise TypeError(f"{name} must be one array; got a tuple of {len(x)}: {hint}")


def check_mesh_axis(mesh, axis) -> int:
    """``axis`` names an axis of ``mesh``; returns its size."""
    if axis not in mesh.axis_names:
        raise ValueError(f"{axis=} is not an axis of the mesh; its axes are {tuple(mesh.axis_names)} "
                         f"(shape {dict(mesh.shape)})")
    return mesh.shape[axis]


def check_paged_kv(q, k_cache, v_cache, block_tables, q_layout: str) -> None:
    """The rules shared by the paged kernels: q, both caches, their agreement, and the block table. The caches
    hold q's dtype, or both one FP8 format (their scales: :func:`check_kv_scales`)."""
    check_rank("q", q, 3, q_layout)
    check_rank("k_cache", k_cache, 4, "[num_blocks, block_size, num_kv_heads, head_dim]")
    check_float("q", q)
    if jnp.dtype(k_cache.dtype) in FP8_DTYPES or jnp.dtype(v_cache.dtype) in FP8_DTYPES:
        check_same_dtype(("k_cache", "v_cache"), k_cache, v_cache)
    else:
        check_same_dtype(("q", "k_cache", "v_cache"), q, k_cache, v_cache)
    check_shape("v_cache", v_cache, k_cache.shape, "k_cache.shape")
    if k_cache.shape[3] != q.shape[2]:
        raise ValueError(f"k_cache head_dim {k_cache.shape[3]} must equal q head_dim {q.shape[2]}; "
                         f"got q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}")
    check_head_dim("q", q.shape[2])
    check_gqa(q.shape[1], k_cache.shape[2])
    check_block_size(k_cache.shape[1])
    check_rank("block_tables", block_tables, 2, "i32[num_seqs, max_blocks]")
    check_int32("block_tables", block_tables)


SCALE_WANT = ("a float scalar (shape []: per tensor) or float32[num_blocks, block_size, num_kv_heads] (per token "
              "and head)")


FP8_LATENT_GROUP = 128  # latent values per float32 scale in an FP8 latent row (FlashMLA's layout)


def fp8_latent_width(kv_lora_rank: int, rope_dim: int) -> int:
    """Bytes of an FP8 latent row: e4m3 values, a float32 scale per 128 of them, bf16 rope dims (DeepSeek: 656)."""
    return kv_lora_rank + 4 * (kv_lora_rank // FP8_LATENT_GROUP) + 2 * rope_dim


def check_fp8_latent_rank(kv_lora_rank: int, dim: int) -> None:
    if kv_lora_rank % FP8_LATENT_GROUP or not 0 < kv_lora_rank <= dim:
        raise ValueError(f"an FP8 latent cache needs kv_lora_rank a multiple of {FP8_LATENT_GROUP} in (0, {dim}] "
                         f"(a float32 scale per {FP8_LATENT_GROUP} values); got {kv_lora_rank}")


def is_fp8_latent(kv_cache) -> bool:
    """An FP8 latent cache (:func:`pallas_attn.quantize_latent`): uint8 bytes, FlashMLA's layout."""
    return kv_cache.dtype == jnp.uint8


def check_latent_cache(q, kv_cache, block_tables, kv_lora_rank: int, *, fp8: bool = False) -> None:
    """The MLA arguments (dense and sparse): absorbed queries ``[T, H, Dqk]`` over one shared latent head per
    position ``[num_blocks, block_size, Dqk]``, values the first ``kv_lora_rank`` dims, an ``i32`` block table.
    ``fp8``: the caller also reads FP8 latent caches, ``uint8[num_blocks, block_size, fp8_latent_width]``."""
    check_rank("q", q, 3, "[num_tokens, num_heads, kv_lora_rank + rope_dim]")
    check_rank("kv_cache", kv_cache, 3, "[num_blocks, block_size, kv_lora_rank + rope_dim]")
    check_float("q", q)
    fp8_layout = ("a uint8 [num_blocks, block_size, kv_lora_rank + 4 * kv_lora_rank / 128 + 2 * rope_dim] array of "
                  "FlashMLA's layout (pallas_attn.quantize_latent)")
    if not (16 <= kv_lora_rank <= q.shape[2] and kv_lora_rank & (kv_lora_rank - 1) == 0):
        raise ValueError(f"{kv_lora_rank=} must be a power of two >= 16 and <= q.shape[2]={q.shape[2]}")
    if is_fp8_latent(kv_cache):
        if not fp8:
            raise TypeError("kv_cache is uint8 (an FP8 latent cache): this function reads bf16 / fp16 / f32 latent "
                            "caches only; mla_attention reads FP8 ones")
        if q.dtype not in (jnp.bfloat16, jnp.float16):
            raise TypeError(f"q is {q.dtype}: an FP8 latent cache takes bf16 / fp16 queries (its e4m3 values meet "
                            f"them in that dtype)")
        check_fp8_latent_rank(kv_lora_rank, q.shape[2])
        width = fp8_latent_width(kv_lora_rank, q.shape[2] - kv_lora_rank)
        if kv_cache.shape[2] != width:
            raise ValueError(f"an FP8 latent kv_cache for q's {q.shape[2]} dims and {kv_lora_rank=} must be "
                             f"uint8[num_blocks, block_size, {width}]; got {tuple(kv_cache.shape)}")
    else:
        if jnp.issubdtype(kv_cache.dtype, jnp.floating) and jnp.finfo(kv_cache.dtype).bits == 8:
            raise TypeError(f"kv_cache is {kv_cache.dtype}: the MLA kernels read bf16 / fp16 / f32 latent caches; an "
                            f"FP8 latent cache (mla_attention) is {fp8_layout}")
        check_same_dtype(("q", "kv_cache"), q, kv_cache)
        if kv_cache.shape[2] != q.shape[2]:
            raise ValueError(f"kv_cache must be [num_blocks, block_size, {q.shape[2]}] (q's dim); "
                             f"got {tuple(kv_cache.shape)}")
    check_block_size(kv_cache.shape[1])
    check_rank("block_tables", block_tables, 2, "i32[num_seqs, max_blocks]")
    check_int32("block_tables", block_tables)


def check_kv_scale(name: str, scale, *, cache_rank: int = 4):
    """An FP8 cache scale (``stored = value / scale``): a float scalar (Python float, numpy or jax 0-d array, traced
    or not) → ``f32[]``, finite and positive where its value is known; or a float32 scale cache ``[num_blocks,
    block_size, num_kv_heads]`` (per token and head, written by ``write_kv_cache``; its shape against the cache:
    :func:`check_kv_scales`), passed on as is. None passes as None. Never inside ``jax.jit``: the public functions
    call this in front of it. ``cache_rank`` 5: caches with a leading device axis (``pallas_attn.parallel``), whose
    scale caches have one too.

    A Python or numpy value is checked on the host before its transfer; a jax scalar's value costs one 4-byte
    read, and none when traced (``checked`` tests it in the jitted program). No device operation runs here, and no
    read waits on one: that stalls asynchronous dispatch (docs/performance.md#fp8-kv-caches)."""
    if scale is None:
        return None
    if isinstance(scale, bool):
        raise TypeError(f"{name} must be {SCALE_WANT}; got a bool")
    if isinstance(scale, (jax.Array, jax.ShapeDtypeStruct)):  # tracers included
        _check_scale_array(name, scale, cache_rank)
        if scale.ndim:
            return scale
        if isinstance(scale, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct((), jnp.float32)
        if not isinstance(scale, jax.core.Tracer):
            _check_scale_value(name, float(scale))
        return scale if scale.dtype == jnp.float32 else scale.astype(jnp.float32)
    try:
        arr = np.asarray(scale)
    except (TypeError, ValueError):
        arr = None
    if arr is None or not jnp.issubdtype(arr.dtype, jnp.number):
        raise TypeError(f"{name} must be {SCALE_WANT}; got {_describe(scale)}")
    _check_scale_array(name, arr, cache_rank)
    if arr.ndim:
        return jnp.asarray(arr)
    value = float(np.float32(arr))
    _check_scale_value(name, value)
    return _device_scale(value)


@functools.lru_cache(maxsize=256)
def _device_scale(value: float) -> jax.Array:
    """``f32[]`` on the default device, one transfer per distinct value: a serving loop passes the same calibrated
    scale every step, and a transfer per call costs more than an 8k-token cache write
    (docs/performance.md#fp8-kv-caches)."""
    return jnp.asarray(value, jnp.float32)


def _check_scale_value(name: str, value: float) -> None:
    if not (np.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be finite and positive (stored = value / {name}); got {value}")


def _check_scale_array(name: str, x, cache_rank: int = 4) -> None:
    if not jnp.issubdtype(x.dtype, jnp.floating) or (x.ndim and x.dtype != jnp.float32):
        raise TypeError(f"{name} must be {SCALE_WANT}; got {x.dtype}{list(x.shape)}")
    if x.ndim not in (0, cache_rank - 1):
        raise ValueError(f"{name} must be {SCALE_WANT}; got {x.dtype}{list(x.shape)}")


def check_kv_scales(k_cache, v_cache, k_scale, v_scale) -> str | None:
    """An FP8 pair of caches has both scales, any other pair neither. Returns the scale mode of an FP8 pair,
    ``"tensor"`` (scalars) or ``"token"`` (scale caches ``[num_blocks, block_size, num_kv_heads]``, both), else
    None. Shapes and dtypes only (the values: :func:`check_kv_scale`)."""
    fp8 = [jnp.dtype(c.dtype) in FP8_DTYPES for c in (k_cache, v_cache)]
    if any(fp8):
        if not all(fp8) or k_cache.dtype != v_cache.dtype:
            raise TypeError(f"k_cache and v_cache must share one FP8 dtype; got {k_cache.dtype}, {v_cache.dtype}")
        missing = [n for n, x in (("k_scale", k_scale), ("v_scale", v_scale)) if x is None]
        if missing:
            raise ValueError(f"an FP8 cache ({k_cache.dtype}) needs k_scale= and v_scale= (stored = value / scale, "
                             f"as written by write_kv_cache); {' and '.join(missing)} missing")
        slots = tuple(k_cache.shape[:-1])
        for name, x in (("k_scale", k_scale), ("v_scale", v_scale)):
            _check_scale_array(name, x, k_cache.ndim)
            if x.ndim and tuple(x.shape) != slots:
                raise ValueError(f"{name} must be {SCALE_WANT} with the caches' [num_blocks, block_size, "
                                 f"num_kv_heads] = {list(slots)}; got {x.dtype}{list(x.shape)}")
        if k_scale.ndim != v_scale.ndim:
            raise ValueError(f"k_scale and v_scale must be both scalars (per tensor) or both scale caches (per token "
                             f"and head); got {k_scale.dtype}{list(k_scale.shape)} and "
                             f"{v_scale.dtype}{list(v_scale.shape)}")
        return "token" if k_scale.ndim else "tensor"
    if k_scale is not None or v_scale is not None:
        raise ValueError(f"k_scale / v_scale go with an FP8 cache (float8_e4m3fn, float8_e5m2); k_cache is "
                         f"{k_cache.dtype}")
    return None


def check_window_size(name: str, value) -> tuple[int, int]:
    """A window ``(left, right)`` of Python ints >= -1 (a list or numpy ints are accepted) → a tuple."""
    ok = isinstance(value, (tuple, list)) and len(value) == 2 and all(
        isinstance(x, (int, np.integer)) and not isinstance(x, bool) and x >= -1 for x in value)
    if not ok:
        raise TypeError(f"{name} must be a pair (left, right) of Python ints >= -1 (-1: unbounded); got "
                        f"{_describe(value)}")
    return int(value[0]), int(value[1])


def check_softcap(name: str, value) -> float:
    """A soft-cap: a finite Python float >= 0 (0: off)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise TypeError(f"{name} must be a static Python float >= 0 (0: off); got {_describe(value)}")
    value = float(value)
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be finite and >= 0 (0: off); got {name}={value}")
    return value


def check_head_vector(name: str, x, num_q_heads: int) -> None:
    """``f32[num_q_heads]`` per-head parameters (ALiBi slopes, sinks)."""
    check_rank(name, x, 1, "f32[num_q_heads]")
    check_shape(name, x, (num_q_heads,), "f32[num_q_heads]")
    check_float(name, x)
