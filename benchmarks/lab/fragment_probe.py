"""Which thread holds which accumulator element, observed on the GPU and compared with ``pallas-attn inspect``'s maps.

Two Pallas kernels write into every element of an accumulator-shaped output the id of the thread holding it:

* Pallas Triton: ``jnp.dot`` gives a float32 tile in the MMA layout Triton picks for it; inline PTX reading
  ``%tid.x`` (``elementwise_inline_asm``) applied to that tile runs in the same layout (an elementwise op keeps its
  operand's layout; the probe checks it in the TTGIR), so each element becomes the id of its holder, and the store
  converts to memory order. Shapes and warps as in the kernels' score tiles: the prefill's ``[128, 128]`` on 8
  warps (wgmma), decode's ``[16, 128]`` on 4 (mma.sync), and ``[64, 64]`` on 4.
* Mosaic GPU: each compute warpgroup runs a wgmma into an accumulator, then inlined Mosaic GPU code fills an array
  in the WGMMA layout with each thread's own CTA thread index; warpgroup ``g`` writes ``out[g]``. As the prefill
  kernel: three warpgroups at ``N`` 64 and 128, two at 256.

The expected maps come from inspect's own chain: Triton, the probe's TTGIR (compiled with the triton package, as
``pallas-attn inspect`` does, also on the GPU machine) → ``#ttg.nvidia_mma`` → :func:`fragments.triton_mma_map`;
Mosaic GPU, :func:`fragments.mosaic_wgmma_map` (thread ``128 g + t`` of warpgroup ``g``). Each case prints PASS or
FAIL; the observed and expected maps go to ``$OUT/fragment-probe.json``. Exit status 1 when a case fails.

    python -m benchmarks.lab.fragment_probe              # GPU: run the probes and compare
    python -m benchmarks.lab.fragment_probe --offline    # CPU: lower both, compile the Triton probes offline
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from pallas_attn.inspection import compiled, fragments

TID_ASM = "mov.u32 $0, %tid.x;"  # the holder's thread index (x: Pallas launches 1-D blocks), whatever the operand


@dataclasses.dataclass(frozen=True)
class TritonCase:
    name: str
    rows: int  # M
    cols: int  # N
    depth: int  # K
    num_warps: int


@dataclasses.dataclass(frozen=True)
class MosaicCase:
    name: str
    cols: int  # N of wgmma.m64nNk16
    warpgroups: int
    depth: int = 64  # K: one 128-byte swizzle tile of bf16


TRITON_CASES = (TritonCase("triton-prefill-S-128x128-8warps", 128, 128, 128, 8),
                TritonCase("triton-decode-S-16x128-4warps", 16, 128, 128, 4),
                TritonCase("triton-64x64-4warps", 64, 64, 64, 4))
MOSAIC_CASES = (MosaicCase("mosaic-wgmma-64x128-3wg", 128, 3), MosaicCase("mosaic-wgmma-64x64-3wg", 64, 3),
                MosaicCase("mosaic-wgmma-64x256-2wg", 256, 2))


# ---------------------------------------------------------------------------------------------- Pallas Triton
def _triton_kernel(a_ref, b_ref, out_ref):
    # inputs: a [M, K], b [K, N] (bf16); outputs: out i32[M, N]
    acc = jnp.dot(a_ref[...], b_ref[...], preferred_element_type=jnp.float32)  # [M, N] in the MMA layout
    from jax.experimental.pallas import triton as pltriton

    [tid] = pltriton.elementwise_inline_asm(TID_ASM, args=[acc], constraints="=r,f", pack=1,
                                            result_shape_dtypes=[jax.ShapeDtypeStruct(acc.shape, jnp.int32)])
    out_ref[...] = tid


def triton_probe(case: TritonCase):
    """``fn(a, b) -> i32[M, N]`` thread ids, and its abstract arguments."""
    from jax.experimental.pallas import triton as pltriton

    full = lambda shape: pl.BlockSpec(shape, lambda: (0, 0))  # noqa: E731
    fn = pl.pallas_call(
        _triton_kernel, grid=(), in_specs=[full((case.rows, case.depth)), full((case.depth, case.cols))],
        out_specs=full((case.rows, case.cols)), out_shape=jax.ShapeDtypeStruct((case.rows, case.cols), jnp.int32),
        compiler_params=pltriton.CompilerParams(num_warps=case.num_warps, num_stages=1), interpret=False,
        name=f"fragment_probe_{case.rows}x{case.cols}")
    args = (jax.ShapeDtypeStruct((case.rows, case.depth), jnp.bfloat16),
            jax.ShapeDtypeStruct((case.depth, case.cols), jnp.bfloat16))
    return fn, args


def triton_expected(case: TritonCase) -> tuple[fragments.FragmentMap, str]:
    """inspect's map of the probe's dot, from its TTGIR, and a note; AssertionError when the inline asm does not
    run in the dot's layout (then the probe would observe some other layout)."""
    import re

    fn, args = triton_probe(case)
    [launch] = compiled.lower_launches(fn, args)
    ttgir = compiled.compile_triton(launch).ttgir
    [dot] = compiled.ttgir_dots(ttgir)
    asm = re.search(r"tt\.elementwise_inline_asm .*-> tensor<[0-9x]+xi32, #(\w+)>", ttgir)
    assert asm is not None and asm[1] == dot.alias, f"the inline asm runs in #{asm[1] if asm else '?'}, " \
                                                    f"not the dot's #{dot.alias}"
    m = fragments.triton_mma_map(dot.encoding, dot.shape)
    return m, f"{dot.op} #{dot.alias} = {m.source}"


# ------------------------------------------------------------------------------------------------- Mosaic GPU
def mosaic_probe(case: MosaicCase):
    """``fn(a, b) -> i32[warpgroups, 64, N]`` thread ids, and its abstract arguments."""
    from jax.experimental.mosaic import gpu as mgpu
    from jax.experimental.pallas import mosaic_gpu as plgpu

    n, k, wgs = case.cols, case.depth, case.warpgroups

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA,),
                       return_type=plgpu.ShapeDtypeStruct((64, n), jnp.int32, plgpu.Layout.WGMMA))
    def thread_ids(ctx, acc):
        del ctx, acc  # the accumulator only fixes where the array lives: each thread splats its own index
        return mgpu.FragmentedArray.splat(mgpu.utils.thread_idx(), (64, n), mgpu.WGMMA_LAYOUT, is_signed=True)

    tiled = dict(transforms=(plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)))
    scratch = ((plgpu.SMEM((wgs, 64, k), jnp.bfloat16, **tiled), plgpu.SMEM((wgs, k, n), jnp.bfloat16, **tiled),
                plgpu.SMEM((wgs, 64, n), jnp.int32)),
               (plgpu.Barrier(num_barriers=wgs), plgpu.Barrier(num_barriers=wgs)))

    def body(a_ref, b_ref, out_ref, scoped):
        # inputs: a [64, K], b [K, N] (bf16); outputs: out i32[warpgroups, 64, N]
        (a_smem, b_smem, o_smem), (a_bar, b_bar) = scoped
        wg = lax.axis_index("wg")
        plgpu.copy_gmem_to_smem(a_ref, a_smem.at[wg], a_bar.at[wg])
        plgpu.copy_gmem_to_smem(b_ref, b_smem.at[wg], b_bar.at[wg])
        plgpu.barrier_wait(a_bar.at[wg])
        plgpu.barrier_wait(b_bar.at[wg])

        def mma(acc_ref):
            plgpu.wgmma(acc_ref, a_smem.at[wg], b_smem.at[wg])
            return acc_ref[...]

        acc = pl.run_scoped(mma, plgpu.ACC((64, n), jnp.float32))  # [64, N] in the WGMMA layout
        o_smem.at[wg][...] = thread_ids(acc)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem.at[wg], out_ref.at[wg])
        plgpu.wait_smem_to_gmem(0)

    def entry(*refs):
        pl.run_scoped(lambda *s: body(*refs, s), *scratch, collective_axes="wg")

    fn = plgpu.kernel(entry, out_type=jax.ShapeDtypeStruct((wgs, 64, n), jnp.int32), grid=(1,), grid_names=("x",),
                      num_threads=wgs, thread_name="wg")
    return fn, (jax.ShapeDtypeStruct((64, k), jnp.bfloat16), jax.ShapeDtypeStruct((k, n), jnp.bfloat16))


def mosaic_expected(case: MosaicCase) -> fragments.FragmentMap:
    return fragments.mosaic_wgmma_map(case.cols, "acc", warpgroups=tuple(range(case.warpgroups)))


# --------------------------------------------------------------------------------------------------- compare
def expected_threads(m: fragments.FragmentMap, offset: int = 0) -> list[list[list[int]]]:
    """``[row][col]`` → the sorted thread ids holding that element (more than one: copies)."""
    holders = [[[] for _ in range(m.shape[1])] for _ in range(m.shape[0])]
    for t in range(m.num_threads):
        for r, c in m.table[t]:
            holders[r][c].append(t + offset)
    return [[sorted(h) for h in row] for row in holders]


def compare(observed: np.ndarray, expected: list[list[list[int]]]) -> list[str]:
    """The elements whose observed thread is not one of the expected holders (at most 8, as text)."""
    bad = [f"({r}, {c}): thread {int(observed[r, c])}, expected {expected[r][c]}"
           for r in range(observed.shape[0]) for c in range(observed.shape[1]) if observed[r, c] not in expected[r][c]]
    return bad[:8] + ([f"... {len(bad) - 8} more"] if len(bad) > 8 else [])


def _inputs(args, key: int = 0):
    keys = jax.random.split(jax.random.key(key), len(args))
    return [jax.random.normal(k, a.shape, jnp.float32).astype(a.dtype) for k, a in zip(keys, args)]


def observe(case: TritonCase | MosaicCase) -> dict:
    """Run ``case``'s probe (on a GPU) and compare what each element's holder wrote with the inspected map: a dict
    with ``verdict`` "PASS" / "FAIL", the first ``mismatches``, and the ``observed`` / ``expected`` thread ids."""
    if isinstance(case, TritonCase):
        m, note = triton_expected(case)
        fn, args = triton_probe(case)
        observed = np.asarray(jax.jit(fn)(*_inputs(args)))
        expected = expected_threads(m)
        bad = compare(observed, expected)
    else:
        m = mosaic_expected(case)
        note = m.source
        fn, args = mosaic_probe(case)
        observed = np.asarray(jax.jit(fn)(*_inputs(args)))  # [warpgroups, 64, N]
        bad, expected = [], []
        for g in range(case.warpgroups):
            expected.append(expected_threads(m, offset=fragments.WARPGROUP_THREADS * g))
            bad += [f"warpgroup {g} {x}" for x in compare(observed[g], expected[-1])]
    return dict(case=case.name, layout=note, instruction=m.instruction, verdict="PASS" if not bad else "FAIL",
                mismatches=bad[:8], observed=observed.tolist(), expected=expected)


def run_on_gpu() -> int:
    from benchmarks.lab import common

    rows = [observe(case) for case in (*TRITON_CASES, *MOSAIC_CASES)]
    failed = 0
    for row in rows:
        failed += row["verdict"] == "FAIL"
        print(f"{row['verdict']}  {row['case']:36s} {row['instruction']:20s} {row['layout']}")
        for line in row["mismatches"]:
            print(f"      {line}")
    common.write_json("fragment-probe.json", dict(cases=rows))
    return 1 if failed else 0


def check_offline() -> int:
    """CPU: both probes lower for sm_90; with the triton package, the Triton probes compile and their inline asm
    runs in the dot's MMA layout (the map they would observe is printed by owning warp)."""
    for case in MOSAIC_CASES:
        fn, args = mosaic_probe(case)
        with jax.sharding.use_abstract_mesh(compiled.abstract_h200()):
            text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert compiled.MOSAIC_CUSTOM_CALL in text
        print(f"lowers    {case.name}")
    have_triton = compiled.triton_version() is not None
    for case in TRITON_CASES:
        fn, args = triton_probe(case)
        [launch] = compiled.lower_launches(fn, args)
        if not have_triton:
            print(f"lowers    {case.name} (no triton package: not compiled)")
            continue
        m, note = triton_expected(case)
        warps = sorted({int(w) for w in np.unique(m.owner() // fragments.WARP_SIZE)})
        print(f"compiles  {case.name}: {launch.name}, {m.instruction}, warps {warps}; {note}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--offline", action="store_true", help="CPU: lower and compile only, nothing runs")
    args = ap.parse_args(argv)
    from pallas_attn.core import backend

    if args.offline or not backend.on_gpu():
        if not args.offline:
            print("no GPU: checking that the probes lower and compile (--offline)")
        return check_offline()
    return run_on_gpu()


if __name__ == "__main__":
    sys.exit(main())
