"""Positions of a score tile's columns, built the way a thread's registers hold them.

``base + arange(n)`` in the layout of a row of a wgmma score tile (``Layout.WGMMA.reduce(0)``) is, in each thread,
one lane-dependent first column plus a constant per register: ``8 c + e`` for register ``c`` and vector element
``e``. Written as ``broadcasted_iota(...) + base``, every element is an index of its own, derived from the thread
id; inside a K/V loop at the compute warpgroups' register budget ptxas rebuilds those indices from lane-id reads
at every step rather than hold them (docs/performance.md#model-family-features counts the instructions). Built
here as one add of ``base`` to the thread's first column and one add of an immediate per value, they cost a
step 2 + n / 4 instructions a thread, and nothing stays live across steps.

Compiled kernels only: the Mosaic GPU interpreter runs no inline Mosaic GPU code, so kernels pass
``compiled=False`` there and get the iota form, which means the same.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

# The MLIR builders inline Mosaic GPU code needs are reachable only through jax._src.
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, vector
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.pallas import mosaic_gpu as plgpu

ROW = plgpu.Layout.WGMMA.reduce(0)  # a row of a [64, n] wgmma tile: the layout of a column vector


def columns(base, n: int, dtype=jnp.int32, *, compiled: bool):
    """``base + arange(n)`` as ``dtype`` (int32 or float32) in the :data:`ROW` layout, ``base`` an int32 scalar.

    float32 is exact while ``|base| + n < 2**24``; beyond, each value is rounded twice (the first column's
    conversion, then its add), where a per-value conversion rounds once."""
    if dtype not in (jnp.int32, jnp.float32):
        raise ValueError(f"columns: dtype must be int32 or float32, got {jnp.dtype(dtype)}")
    if not compiled:
        idx = plgpu.broadcasted_iota(jnp.int32, (n,), 0, layout=ROW) + base
        return idx if dtype == jnp.int32 else idx.astype(jnp.float32)

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WG_SPLAT(()),),
                       return_type=plgpu.ShapeDtypeStruct((n,), jnp.dtype(dtype), layout=ROW))
    def build(_, base_array):
        layout = ROW.to_mgpu()
        i32 = ir.IntegerType.get_signless(32)
        # the thread's first column: the warp and lane parts of the layout's linear index (as its thread_idxs)
        tile_strides = layout.tiling.tile_strides((1,))
        dyn_strides = [mgpu.c(s, i32) for s in tile_strides[-layout.tiled_tiling_rank:]]
        first = arith.addi(mgpu.utils.dyn_dot(layout.warp_indices(), dyn_strides),
                           mgpu.utils.dyn_dot(layout.lane_indices(), dyn_strides))
        first = arith.addi(first, base_array.registers.item())
        if dtype == jnp.float32:
            elem = ir.F32Type.get()
            first = arith.sitofp(elem, first)
            add = arith.addf
        else:
            elem, add = i32, arith.addi
        registers = np.empty(layout.registers_shape((n,)), dtype=object)
        for idx in np.ndindex(registers.shape):
            offset = sum(i * s for i, s in zip(idx, tile_strides))
            values = [add(first, mgpu.c(int(offset) + e if elem == i32 else float(offset + e), elem))
                      for e in range(layout.vector_length)]
            registers[idx] = vector.from_elements(ir.VectorType.get((layout.vector_length,), elem), values)
        return mgpu.FragmentedArray(_registers=registers, _layout=layout,
                                    _is_signed=True if dtype == jnp.int32 else None)

    return build(jnp.asarray(base, jnp.int32))
