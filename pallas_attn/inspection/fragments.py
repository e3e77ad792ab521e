"""Which thread holds which element of an accumulator tile: the PTX ISA's MMA fragment layouts, and the tile layouts
the compilers build from them (docs/threads.md).

A tensor-core instruction fixes where its result lands: ``mma.sync.m16n8k16`` spreads a ``[16, 8]`` float32 tile
over the 32 lanes of a warp, four registers ``c0..c3`` each; ``wgmma.mma_async.m64nNk16`` spreads ``[64, N]`` over
the 128 threads of a warpgroup, ``N / 2`` registers ``d0..`` each. A kernel's score tile ``S`` and output
accumulator ``O`` stay in that layout while the softmax runs on them, so a row's max and sum are reductions over
the four lanes that share the row (two shuffles), never over shared memory.

Three sources, named in every :class:`FragmentMap` (``source``):

* the PTX ISA (:func:`mma_m16n8k16_element`, :func:`wgmma_m64nNk16_element`): the documented fragment figures,
  the ground truth the other two must agree with (tests/test_inspect.py checks them against tables written from the
  document);
* Triton's ``#ttg.nvidia_mma`` encoding (:func:`triton_mma_map`): the compiler picks ``versionMajor`` (2:
  ``mma.sync``, 3: ``wgmma``), ``warpsPerCTA`` and ``instrShape``; the tile repeats the instruction's fragment
  over warps, then over registers (Triton's linear layout of that encoding);
* Mosaic GPU's declared ``WGMMA`` layout (:func:`mosaic_wgmma_map`), evaluated from the layout object the kernel
  uses (``plgpu.Layout.WGMMA``): one 64-row tile per warpgroup.

Every layout here is linear in the bits of (register, lane, warp): an element's position is the XOR of one basis
vector per set bit, Triton's linear layouts. A zero basis makes a copy: that element is held by two threads.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

WARP_SIZE = 32
WARPGROUP_WARPS = 4
WARPGROUP_THREADS = WARP_SIZE * WARPGROUP_WARPS
MMA_SYNC = "mma.sync.m16n8k16"  # the instruction name, for text and for matching PTX
WGMMA = "wgmma.m64n{n}k16"
# The documents the layouts are written from: PTX ISA (CUDA 12+), "Matrix Fragments for mma.m16n8k16 with
# floating point type" (accumulators C/D) and "Matrix Fragments for wgmma.mma_async.m64nNk16" (accumulator D,
# Figure "WGMMA .m64nNk16 register fragment layout for accumulator matrix D").
PTX_MMA_SOURCE = "https://docs.nvidia.com/cuda/parallel-thread-execution/#mma-16816-c"
PTX_WGMMA_SOURCE = "https://docs.nvidia.com/cuda/parallel-thread-execution/#wgmma-64n16-d"


# ------------------------------------------------------------------------------------- the PTX ISA's layouts
def mma_m16n8k16_element(lane: int, i: int) -> tuple[int, int]:
    """``(row, col)`` of accumulator register ``c{i}`` (``i`` in 0..3) of ``lane`` in ``mma.m16n8k16`` with a
    ``.f32`` accumulator, as the PTX ISA gives it::

        groupID = lane >> 2;  threadID_in_group = lane % 4
        row = groupID (c0, c1) or groupID + 8 (c2, c3);  col = threadID_in_group * 2 + (i & 1)
    """
    if not (0 <= lane < WARP_SIZE and 0 <= i < 4):
        raise ValueError(f"{lane=} must be in [0, 32) and {i=} in [0, 4)")
    group, in_group = lane >> 2, lane % 4
    return group + 8 * (i >> 1), in_group * 2 + (i & 1)


def wgmma_m64nNk16_element(thread: int, i: int, n: int) -> tuple[int, int]:
    """``(row, col)`` of accumulator register ``d{i}`` (``i`` in ``0..n/2-1``) of ``thread`` (0..127 in its
    warpgroup) in ``wgmma.mma_async.m64nNk16`` with a ``.f32`` accumulator, as the PTX ISA's figure draws it: warp
    ``w = thread // 32`` of the warpgroup owns rows ``16 w .. 16 w + 15``; inside them the ``m16n8`` pattern of
    :func:`mma_m16n8k16_element`, repeated over the ``n / 8`` column blocks: ``d[4 j + k]`` is ``c{k}`` of block
    ``j``."""
    if n % 8 or not 8 <= n <= 256:
        raise ValueError(f"{n=} must be a multiple of 8 in [8, 256] (wgmma's N)")
    if not (0 <= thread < WARPGROUP_THREADS and 0 <= i < n // 2):
        raise ValueError(f"{thread=} must be in [0, 128) and {i=} in [0, {n // 2})")
    warp, lane = divmod(thread, WARP_SIZE)
    row, col = mma_m16n8k16_element(lane, i % 4)
    return 16 * warp + row, 8 * (i // 4) + col


# --------------------------------------------------------------------------------------- the map of a tile
@dataclasses.dataclass(frozen=True)
class Element:
    """One element of a tile in one thread's registers: ``register`` is the thread's value index (Triton's order
    of the tensor's values, Mosaic's register array times its vector), ``fragment`` names the instruction's own
    accumulator register (``c0..c3`` of ``mma.sync``, ``d0..`` of ``wgmma``) and ``instance`` which of the
    thread's instruction tiles it belongs to (0 when one instruction tile covers the thread's part)."""
    row: int
    col: int
    register: int
    fragment: str
    instance: int


@dataclasses.dataclass(frozen=True, eq=False)
class FragmentMap:
    """Who holds each element of one accumulator tile of one program.

    ``table[t, r]`` is the ``(row, col)`` of register ``r`` of thread ``t`` (``i32[threads, registers, 2]``; thread
    ids of the program, 0-based; columns relative to ``col_offset``). ``fragment_registers`` registers make one
    instruction's fragment (4 for ``mma.sync``, ``N / 2`` for ``wgmma``). ``thread_offsets``: the same layout held
    again by other warpgroups for their own data (Mosaic GPU's compute warpgroups each hold their own item's tile),
    thread ``t + offset`` holding what thread ``t`` holds. ``source`` says where the layout comes from.
    """
    name: str
    shape: tuple[int, int]
    instruction: str
    table: np.ndarray
    fragment_registers: int
    source: str
    thread_offsets: tuple[int, ...] = (0,)
    col_offset: int = 0
    note: str = ""

    def __post_init__(self):
        rows, cols = self.shape
        t = self.table
        if t.ndim != 3 or t.shape[2] != 2:
            raise ValueError(f"table must be i32[threads, registers, 2]; got {t.shape}")
        if t.size and (t[..., 0].min() < 0 or t[..., 0].max() >= rows or t[..., 1].min() < 0
                       or t[..., 1].max() >= cols):
            raise ValueError(f"table places elements outside the {self.shape} tile")

    @property
    def num_threads(self) -> int:
        return self.table.shape[0]

    @property
    def num_registers(self) -> int:
        return self.table.shape[1]

    @property
    def threads_in_program(self) -> range:
        """Every thread id that holds part of this tile (all offsets)."""
        return range(max(self.thread_offsets) + self.num_threads)

    def holders(self) -> np.ndarray:
        """``i32[rows, cols]``: how many (thread, register) pairs hold each element (1 everywhere unless the layout
        makes copies; offsets not counted: those warpgroups hold other data)."""
        count = np.zeros(self.shape, np.int32)
        np.add.at(count, (self.table[..., 0].ravel(), self.table[..., 1].ravel()), 1)
        return count

    def owner(self) -> np.ndarray:
        """``i32[rows, cols]``: the lowest thread holding each element (-1: nobody)."""
        owner = np.full(self.shape, -1, np.int32)
        threads = np.broadcast_to(np.arange(self.num_threads)[:, None], self.table.shape[:2])
        flat = np.ravel_multi_index((self.table[..., 0].ravel(), self.table[..., 1].ravel()), self.shape)
        order = np.argsort(-threads.ravel(), kind="stable")  # highest first: the lowest thread writes last
        owner.ravel()[flat[order]] = threads.ravel()[order]
        return owner

    def base_thread(self, thread: int) -> int | None:
        """The thread of ``table`` whose registers ``thread`` mirrors, or None when it holds none of this tile."""
        for offset in self.thread_offsets:
            if 0 <= thread - offset < self.num_threads:
                return thread - offset
        return None

    def fragment_name(self, register: int) -> tuple[str, int]:
        """``(the instruction's register name, instruction tile index)`` of a thread's value ``register``."""
        prefix = "c" if self.instruction == MMA_SYNC else "d"
        return f"{prefix}{register % self.fragment_registers}", register // self.fragment_registers

    def elements_of(self, thread: int) -> list[Element]:
        """What ``thread`` holds of this tile, register by register (empty for a thread that holds none)."""
        base = self.base_thread(thread)
        if base is None:
            return []
        out = []
        for r, (row, col) in enumerate(self.table[base]):
            fragment, instance = self.fragment_name(r)
            out.append(Element(int(row), int(col) + self.col_offset, r, fragment, instance))
        return out


def _table_from_bases(reg_bases, lane_bases, warp_bases) -> np.ndarray:
    """``i32[threads, registers, 2]`` of a linear layout: the XOR of the bases of the set bits."""
    def span(bases):
        out = np.zeros((1 << len(bases), 2), np.int64)
        for bit, basis in enumerate(bases):
            out[1 << bit:2 << bit] = out[:1 << bit] ^ np.asarray(basis)
        return out

    lanes, warps, regs = span(lane_bases), span(warp_bases), span(reg_bases)
    threads = (warps[:, None, :] ^ lanes[None, :, :]).reshape(-1, 2)  # thread = warp * 32 + lane
    return (threads[:, None, :] ^ regs[None, :, :]).astype(np.int32)


def _instruction_bases(fragment_registers: int) -> tuple[list, list]:
    """``(register bases, lane bases)`` of one warp's part of an instruction tile, read off the PTX ISA formula
    at the unit vectors (the formula is linear: tests/test_inspect.py checks every lane and register)."""
    lanes = [mma_m16n8k16_element(1 << b, 0) for b in range(5)]
    if fragment_registers == 4:
        regs = [mma_m16n8k16_element(0, 1 << b) for b in range(2)]
    else:
        n = 2 * fragment_registers
        regs = [wgmma_m64nNk16_element(0, 1 << b, n) for b in range(int(math.log2(fragment_registers)))]
    return regs, lanes


# ---------------------------------------------------------------------------------- instruction-level maps
def mma_m16n8k16_map() -> FragmentMap:
    """One ``mma.m16n8k16`` accumulator ``[16, 8]`` over one warp, straight from the PTX ISA formula."""
    table = np.array([[mma_m16n8k16_element(lane, i) for i in range(4)] for lane in range(WARP_SIZE)], np.int32)
    return FragmentMap("C", (16, 8), MMA_SYNC, table, 4, f"PTX ISA ({PTX_MMA_SOURCE})")


def wgmma_m64nNk16_map(n: int) -> FragmentMap:
    """One ``wgmma.m64nNk16`` accumulator ``[64, n]`` over one warpgroup, straight from the PTX ISA figure."""
    table = np.array([[wgmma_m64nNk16_element(t, i, n) for i in range(n // 2)] for t in range(WARPGROUP_THREADS)],
                     np.int32)
    return FragmentMap("D", (64, n), WGMMA.format(n=n), table, n // 2, f"PTX ISA ({PTX_WGMMA_SOURCE})")


# ---------------------------------------------------------------------------------------------- Triton's tile
@dataclasses.dataclass(frozen=True)
class MmaEncoding:
    """Triton's ``#ttg.nvidia_mma`` attribute: ``version`` 2 (``mma.sync``) or 3 (``wgmma``), ``warps_per_cta``
    ``[warps along M, warps along N]`` and ``instr_shape`` (``[16, 8]`` or ``[16, N, 16]``: one warp's rows and
    the instruction's columns)."""
    version: int
    warps_per_cta: tuple[int, int]
    instr_shape: tuple[int, ...]

    def __post_init__(self):
        if self.version not in (2, 3):
            raise ValueError(f"versionMajor={self.version}: only 2 (mma.sync) and 3 (wgmma) are sm_90's")
        if self.version == 3 and self.warps_per_cta[0] % WARPGROUP_WARPS:
            raise ValueError(f"wgmma needs whole warpgroups along M; got warpsPerCTA={list(self.warps_per_cta)}")

    @property
    def instruction(self) -> str:
        return MMA_SYNC if self.version == 2 else WGMMA.format(n=self.instr_shape[1])

    @property
    def instr_cols(self) -> int:
        return 8 if self.version == 2 else self.instr_shape[1]


def triton_mma_map(encoding: MmaEncoding, shape: tuple[int, int], name: str = "S") -> FragmentMap:
    """The tile ``shape`` in Triton's ``#ttg.nvidia_mma`` layout (its linear layout, as Triton 3.6 builds it):

    1. one warp's part of the instruction tile, from the PTX ISA (``c0..c3`` of a ``[16, 8]`` tile, or ``d0..`` of
       the warp's 16 rows of ``[64, N]``);
    2. warps: ``mma.sync`` orders them along N first, ``wgmma`` along M first (a warpgroup's 4 warps stack their 16
       rows into the 64 of one wgmma), each warp one instruction tile further;
    3. what the warps do not cover, the registers repeat: along N first, then along M. Bases past the tile's
       extent become zero: copies (e.g. 4 warps on a 16-row tile hold it 4 times).
    """
    rows, cols = shape
    fragment_registers = 4 if encoding.version == 2 else encoding.instr_cols // 2
    reg_bases, lane_bases = _instruction_bases(fragment_registers)
    warps_m, warps_n = encoding.warps_per_cta
    along_m = [(16 << b, 0) for b in range(int(math.log2(warps_m)))]
    along_n = [(0, encoding.instr_cols << b) for b in range(int(math.log2(warps_n)))]
    warp_bases = along_n + along_m if encoding.version == 2 else along_m + along_n
    cover_m, cover_n = 16 * warps_m, encoding.instr_cols * warps_n
    reg_bases = reg_bases + [(0, cover_n << b) for b in range(max(0, int(math.log2(cols / cover_n))))]
    reg_bases = reg_bases + [(cover_m << b, 0) for b in range(max(0, int(math.log2(rows / cover_m))))]

    def clip(bases):  # a basis past the tile: a copy
        return [(r, c) if r < rows and c < cols else (0, 0) for r, c in bases]

    table = _table_from_bases(clip(reg_bases), clip(lane_bases), clip(warp_bases))
    source = (f"Triton #ttg.nvidia_mma<versionMajor={encoding.version}, warpsPerCTA={list(encoding.warps_per_cta)}, "
              f"instrShape={list(encoding.instr_shape)}> over the PTX ISA fragment")
    return FragmentMap(name, shape, encoding.instruction, table, fragment_registers, source)


# ------------------------------------------------------------------------------------------ Mosaic GPU's tile
def _apply_tiling(index: np.ndarray, tiles) -> np.ndarray:
    """``index`` (an array of logical positions) rearranged by a Mosaic GPU tiling expression: each tile splits the
    trailing dims into (count, tile) and moves the tile dims last (``fragmented_array.Tiling``)."""
    for tile in tiles:
        k = len(tile)
        lead, dims = index.shape[:-k], index.shape[-k:]
        index = index.reshape(*lead, *[x for d, t in zip(dims, tile) for x in (d // t, t)])
        n = len(lead)
        index = index.transpose(*range(n), *range(n, n + 2 * k, 2), *range(n + 1, n + 2 * k, 2))
    return index


def tiled_layout_table(layout, shape: tuple[int, int]) -> np.ndarray:
    """``i32[128, registers, 2]``: where a Mosaic GPU ``TiledLayout`` puts a ``shape`` array's elements in the
    registers of one warpgroup's threads. The register of an element is its index in the layout's register array
    (``registers_shape``, C order) times the vector length, plus its place in the vector."""
    if any(not isinstance(d, int) for d in (*layout.warp_dims, *layout.lane_dims)):
        raise ValueError(f"{layout}: replicated warp or lane dims hold copies; only plain tilings are mapped")
    tiled = _apply_tiling(np.arange(math.prod(shape)).reshape(shape), layout.tiling.tiles)
    coords = np.stack(np.unravel_index(np.arange(tiled.size), tiled.shape), axis=-1)  # [elements, tiled rank]
    rank = tiled.ndim

    def combined(dims):  # the index along ``dims`` (major to minor) of each element
        out = np.zeros(len(coords), np.int64)
        for d in dims:
            out = out * tiled.shape[d] + coords[:, rank + d]
        return out

    warp, lane = combined(layout.warp_dims), combined(layout.lane_dims)
    vector = coords[:, rank + layout.vector_dim]
    reg_coords = coords.copy()
    for d in (*layout.warp_dims, *layout.lane_dims, layout.vector_dim):
        reg_coords[:, rank + d] = 0
    reg_shape = tuple(1 if i - rank in (*layout.warp_dims, *layout.lane_dims, layout.vector_dim) else s
                      for i, s in enumerate(tiled.shape))
    vec = tiled.shape[layout.vector_dim]
    register = np.ravel_multi_index(tuple(reg_coords.T), reg_shape) * vec + vector
    thread = warp * WARP_SIZE + lane
    table = np.full((WARPGROUP_THREADS, int(register.max()) + 1, 2), -1, np.int32)
    position = tiled.ravel()
    table[thread, register] = np.stack(np.unravel_index(position, shape), axis=-1)
    if (table < 0).any():
        raise ValueError(f"{layout} leaves registers of a {shape} array empty")
    return table


def mosaic_wgmma_map(n: int, name: str, *, warpgroups: tuple[int, ...] = (0,), col_offset: int = 0,
                     note: str = "") -> FragmentMap:
    """A ``[64, n]`` float32 accumulator in Mosaic GPU's ``WGMMA`` layout (``plgpu.Layout.WGMMA``, the layout of
    ``plgpu.ACC`` and of the arrays the kernels compute on), held by each warpgroup of ``warpgroups`` for its own
    data. Evaluated from JAX's layout object, so it is what the installed Mosaic GPU declares, not a copy."""
    from jax.experimental.mosaic.gpu import fragmented_array

    table = tiled_layout_table(fragmented_array.WGMMA_LAYOUT, (64, n))
    offsets = tuple(WARPGROUP_THREADS * g for g in warpgroups)
    return FragmentMap(name, (64, n), WGMMA.format(n=n), table, n // 2,
                       "Mosaic GPU's declared WGMMA layout (jax.experimental.mosaic.gpu.fragmented_array.WGMMA_LAYOUT)",
                       thread_offsets=offsets, col_offset=col_offset, note=note)
