"""What ``pallas-attn inspect`` looks at: a kernel, on a standard workload's shapes, with the backend the H200 would
run it on; and what the Mosaic GPU kernels declare about themselves where their compiled code cannot be read.

The workloads are the benchmark harness's (``benchmarks/workloads.py``, benchmarks/README.md), read from the source
checkout: the package holds no second copy of their shapes. Only shapes are built (``jax.ShapeDtypeStruct``), never
arrays, so P1's 29,184 tokens cost nothing; the call is the one the harness makes (``benchmarks/impls.py``).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import pathlib
import subprocess
import sys
import tempfile
from collections.abc import Callable
from unittest import mock

from pallas_attn.inspection import fragments


@dataclasses.dataclass(frozen=True)
class Kernel:
    """A public function ``inspect`` knows: the workload kinds it runs (``benchmarks.workloads.Spec.kind``), its
    standard workload and the backends it has."""
    function: str
    kinds: tuple[str, ...]
    default_workload: str
    backends: tuple[str, ...]


KERNELS = {
    "prefill": Kernel("varlen_attention", ("prefill",), "P1", ("triton", "mosaic")),
    "decode": Kernel("paged_decode_attention", ("decode",), "D1", ("triton",)),
    "paged": Kernel("paged_attention", ("ragged", "decode"), "V1", ("triton",)),
    "sparse_mla": Kernel("sparse_mla_attention", ("sparse",), "S1", ("triton", "mosaic")),
}


@dataclasses.dataclass(frozen=True)
class Call:
    """One public call on abstract inputs: ``fn(*args)`` is what runs. ``value_cols`` is the width of the output
    accumulator ``O`` in the kernel's tiles (Triton pads heads to a power of two), which tells the ``P · V``
    product's tile from the ``Q Kᵀ`` one. ``spec``: the workload's ``Spec`` (shapes, features)."""
    kernel: str
    workload: str
    what: str
    backend: str
    fn: Callable
    args: tuple
    value_cols: int
    spec: object
    tiny: bool = False

    def describe(self) -> str:
        s = self.spec
        return (f"{self.workload}{' (tiny)' if self.tiny else ''}: {self.what}; Hq={s.num_q_heads} "
                f"Hkv={s.num_kv_heads} D={s.head_dim} {s.dtype}")


# ---------------------------------------------------------------------------------------------- the checkout
def checkout_module(name: str):
    """``name`` (a module of the repository's top-level ``benchmarks/`` folder) from the current directory or from
    the checkout this package lives in, else None. A module that exists but fails on a missing dependency raises."""
    checkout = pathlib.Path(__file__).resolve().parents[2]
    for extra in (None, checkout):
        if extra is not None and (extra / "benchmarks").is_dir() and str(extra) not in sys.path:
            sys.path.insert(0, str(extra))
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name not in (name, *[name.rsplit(".", k)[0] for k in range(1, name.count(".") + 1)]):
                raise
    return None


def workloads_module():
    found = checkout_module("benchmarks.workloads")
    if found is None:
        raise LookupError("--workload: the workloads live in the benchmarks/ folder of a source checkout, which is "
                          "not installed with the package; run from a checkout (pip install -e .)")
    return found


# --------------------------------------------------------------------------------------------------- the call
def _h200_default(kernel: str, q, k_or_rank, max_seqlen: int | None) -> str:
    """The backend ``backend=None`` picks for these inputs on an H200, also when this machine has no GPU: the
    public function's own rule, asked as if on sm_90."""
    from pallas_attn.core import backend as backend_lib
    from pallas_attn.ops import sparse_mla, varlen

    with mock.patch.object(backend_lib, "is_hopper", lambda: True):  # the rule's only device question
        if kernel == "prefill":
            return varlen.default_backend(q, k_or_rank, max_seqlen, interpret=False)
        return sparse_mla.default_backend(q, k_or_rank, interpret=False)


def build_call(kernel: str, workload: str | None = None, backend: str | None = None, *, tiny: bool = False) -> Call:
    """The public call of ``kernel`` on ``workload``'s shapes (default: the kernel's standard workload) with
    ``backend`` (default: what the H200 would pick). ValueError names the argument at fault."""
    import functools

    import jax
    import jax.numpy as jnp

    import pallas_attn

    if kernel not in KERNELS:
        raise ValueError(f"kernel {kernel!r} is not one of {sorted(KERNELS)}")
    info = KERNELS[kernel]
    wl = workloads_module()
    workload = workload or info.default_workload
    spec = wl.find_spec(workload, tiny)
    if spec is None:
        raise ValueError(f"--workload {workload!r} is not a workload id (P1, D1, ...: python -m benchmarks.run "
                         "--list)")
    if spec.kind not in info.kinds:
        fits = sorted(k for k, v in KERNELS.items() if spec.kind in v.kinds)
        raise ValueError(f"--workload {workload} is a {spec.kind} workload; kernel {kernel!r} runs "
                         f"{'/'.join(info.kinds)} workloads ({workload} is for: {', '.join(fits)})")
    if backend is not None and backend not in info.backends:
        raise ValueError(f"--backend {backend!r}: kernel {kernel!r} has {' and '.join(info.backends)}")
    host = wl.build_host(spec)
    S, dtype, i32, f32 = jax.ShapeDtypeStruct, spec.jnp_dtype, jnp.int32, jnp.float32
    T, B, Hq, Hkv, D = host.num_tokens, host.num_seqs, spec.num_q_heads, spec.num_kv_heads, spec.head_dim
    statics = {k: v for k, v in spec.feature_kwargs({}).items() if v is not None}  # window_size, softcap
    arrays = {k: S((Hq,), f32) for k in spec.features if k in ("sinks", "alibi_slopes")}
    q = S((T, Hq, D), dtype)
    value_cols = 1 << max(0, (D - 1).bit_length())
    if spec.kind == "prefill":
        kv = S((T, Hkv, D), dtype)
        max_seqlen = int(host.seq_lens.max())
        backend = backend or _h200_default(kernel, q, kv, max_seqlen)
        fn = functools.partial(pallas_attn.varlen_attention, max_seqlen=max_seqlen, causal=spec.causal,
                               interpret=False, backend=backend, **statics)
        args = (q, kv, kv, S((B + 1,), i32))
        if backend == "mosaic":
            from pallas_attn.kernels.mosaic import prefill as mosaic_prefill
            value_cols = mosaic_prefill.tile_head_dim(D)
    elif spec.kind == "sparse":
        backend = backend or _h200_default(kernel, q, spec.kv_lora_rank, None)
        fn = functools.partial(pallas_attn.sparse_mla_attention, kv_lora_rank=spec.kv_lora_rank, interpret=False,
                               backend=backend, **statics)
        args = (q, S((host.num_pages, spec.block_size, D), dtype), S(host.block_tables.shape, i32),
                S(host.topk_indices.shape, i32))
        value_cols = spec.kv_lora_rank
    else:
        backend = backend or "triton"
        cache = S((host.num_pages, spec.block_size, Hkv, D), spec.kv_jnp_dtype)  # an FP8 cache where the spec says
        if spec.kv_dtype:  # its scales: f32 scalars, or the per-(token, head) scale caches
            scale = S((), f32) if spec.kv_scale_mode == "tensor" else S((host.num_pages, spec.block_size, Hkv), f32)
            arrays.update(k_scale=scale, v_scale=scale)
        tables = S(host.block_tables.shape, i32)
        if kernel == "decode":
            fn = functools.partial(pallas_attn.paged_decode_attention, interpret=False, **statics)
            args = (q, cache, cache, tables, S((B,), i32))
        else:  # paged_attention, a decode workload included (q_len 1 each, as the harness's pallas_attn/paged)
            fn = functools.partial(pallas_attn.paged_attention, max_query_len=host.max_query_len, interpret=False,
                                   **statics)
            args = (q, cache, cache, tables, S((B,), i32), S((B + 1,), i32))
    if arrays:
        base = fn
        fn = lambda *a: base(*a[:-1], **a[-1])  # noqa: E731  the feature arrays as one trailing dict
        args = (*args, arrays)
    return Call(kernel, spec.id, spec.what, backend, fn, args, value_cols, spec, tiny)


# -------------------------------------------------------------------------------- Mosaic GPU: what is declared
@dataclasses.dataclass(frozen=True)
class Declared:
    """What a Mosaic GPU kernel's source fixes, read from its module (not from compiled code): the launch's
    threads, warpgroup roles, per-warpgroup registers (``setmaxnreg``), shared memory where the module computes
    it, the matrix instructions, and the accumulator tiles each warpgroup holds."""
    threads: int
    facts: dict[str, str]
    maps: tuple[fragments.FragmentMap, ...]
    shared: int | None = None


def mosaic_declared(call: Call) -> Declared:
    """:class:`Declared` for the Mosaic GPU kernel ``call`` runs (prefill or sparse MLA)."""
    WG = fragments.WARPGROUP_THREADS
    if call.kernel == "prefill":
        from pallas_attn.core import config as config_lib
        from pallas_attn.kernels.mosaic import prefill as mp

        q = call.args[0]
        width = mp.tile_head_dim(q.shape[-1])
        cfg = config_lib.default_mosaic_prefill_config(width)
        wgs = mp.compute_wgs(width)
        compute, memory = mp.REGISTERS[wgs]
        shared = mp.smem_bytes(cfg, width, q.dtype.itemsize, return_lse=False)
        others = ", ".join(str(g) for g in range(1, wgs))
        note = (f"warpgroups {others} hold their own items' tiles in the same layout (thread 128·g + t holds what "
                f"thread t does)")
        maps = (fragments.mosaic_wgmma_map(cfg.block_kv, "S", warpgroups=tuple(range(wgs)), note=note),
                fragments.mosaic_wgmma_map(width, "O", warpgroups=tuple(range(wgs)), note=note))
        facts = {
            "warpgroups": f"{wgs} compute (0..{wgs - 1}: one 64-row query tile × head each) + 1 memory ({wgs}: TMA "
                          "loads of K/V)",
            "registers a thread (setmaxnreg)": f"{compute} compute, {memory} memory",
            "config": repr(cfg),
            "matrix instructions a K/V step": f"S = Q Kᵀ: {width // 16} × wgmma.m64n{cfg.block_kv}k16; "
                                              f"O += P V: {cfg.block_kv // 16} × wgmma.m64n{width}k16",
            "data movement": "TMA (Q, K, V in; O out), mbarriers between the memory and compute warpgroups",
        }
        return Declared((wgs + 1) * WG, facts, maps, shared)
    import inspect

    from pallas_attn.kernels.mosaic import sparse_mla as ms

    rank = call.value_cols
    blocks = ms._value_blocks(rank, ms.SCORE_COLS)
    score, value, memory = inspect.signature(ms.sparse_mla_mosaic).parameters["registers"].default
    maps = [fragments.mosaic_wgmma_map(ms.BLOCK_N, "S", warpgroups=(0,))]
    for i, (start, width) in enumerate(blocks):
        wg = 0 if i == 0 else 1
        maps.append(fragments.mosaic_wgmma_map(width, f"O[:, {start}:{start + width}]", warpgroups=(wg,),
                                               col_offset=start, note=f"held by warpgroup {wg}"))
    facts = {
        "warpgroups": "0 score (S, softmax, O[:, :192]), 1 value (the rest of O), 2 memory (cp.async gather)",
        "registers a thread (setmaxnreg)": f"{score} score, {value} value, {memory} memory",
        "matrix instructions a K/V step": f"S = Q Kᵀ: {rank // 16 + ms.BLOCK_N // 16} × wgmma.m64n{ms.BLOCK_N}k16; "
                                          + "; ".join(f"O[:, {s}:{s + w}] += P V: {ms.BLOCK_N // 16} × "
                                                      f"wgmma.m64n{w}k16" for s, w in blocks),
        "data movement": "cp.async gather of the selected rows, TMA for q and the outputs, mbarriers",
    }
    return Declared((ms.COMPUTE_WGS + 1) * WG, facts, tuple(maps))


# ------------------------------------------------------------------------------ Mosaic GPU: the device's PTX
DUMP_ENV = {"MOSAIC_GPU_DUMP_PTX": "1"}


def dump_mosaic_ptx(call: Call, timeout: float = 600) -> list[str]:
    """The PTX of ``call``'s Mosaic GPU kernels, dumped by the CUDA plugin in a child process
    (``MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_TO=dir``): GPU only. The child compiles the call on the same shapes
    and runs it once on zeros (empty requests: every kernel exits at once), so a dump made at first run is caught
    too. Returns the PTX texts with a wgmma in them."""
    with tempfile.TemporaryDirectory() as tmp:
        request = json.dumps(dict(kernel=call.kernel, workload=call.workload, backend=call.backend, tiny=call.tiny))
        env = dict(os.environ, **DUMP_ENV, MOSAIC_GPU_DUMP_TO=tmp,
                   PYTHONPATH=os.pathsep.join([str(pathlib.Path(__file__).resolve().parents[2]),
                                               os.environ.get("PYTHONPATH", "")]))
        child = subprocess.run([sys.executable, "-c", "import sys; from pallas_attn.inspection import targets; "
                                "targets._compile_and_run(sys.argv[1])", request], env=env, capture_output=True,
                               text=True, timeout=timeout)
        if child.returncode:
            raise RuntimeError(f"the Mosaic GPU compile for the PTX dump failed:\n{child.stderr[-4000:]}")
        texts = [p.read_text() for p in sorted(pathlib.Path(tmp).rglob("*.ptx"))]
    return [t for t in texts if "wgmma" in t]


def _compile_and_run(request: str) -> None:
    """The child of :func:`dump_mosaic_ptx`: compile ``request``'s call and run it once on zeros."""
    import jax
    import jax.numpy as jnp

    call = build_call(**json.loads(request))
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), call.args)
    jax.block_until_ready(jax.jit(call.fn)(*zeros))
