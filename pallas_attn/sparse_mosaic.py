"""Top-k sparse MLA attention on the Mosaic GPU backend (Hopper: wgmma, warp specialisation, a cp.async gather).

The same contract as :func:`pallas_attn.sparse.sparse_mla_attention` (which selects this kernel on sm_90 where it
applies), written FlashMLA-style for the backend that reaches Hopper's own instructions from Pallas:

* grid ``(num_tokens, H / 64)``: program ``(t, g)`` takes token ``t``'s heads ``64 g .. 64 g + 63`` (the M dim of
  both matmuls: every selected latent row is read once per 64 heads, not once per head).
* three warpgroups. The memory warpgroup first resolves the token's whole top-k list into cache rows in shared
  memory (top-k position → its request's ``block_table`` → physical slot, ``-1`` for unused entries: the
  translation happens here, in the kernel), then gathers ``64``-row tiles of the latent cache into a ring of two
  shared-memory slots with ``cp.async`` (16 bytes a thread, written straight into the 128-byte-swizzled tile layout
  wgmma reads; unused rows are zero-filled). TMA cannot do this on sm_90: its row gather (``gather4``) is a
  Blackwell instruction, and Pallas exposes ``cp.async`` only before sm_90, so the copy is inlined Mosaic GPU code.
* two compute warpgroups, one per half of the value dims (``[64, 256]`` f32 accumulator each: 128 registers a
  thread). Both compute the full ``S = Q Kᵀ`` over the 576 dims (duplicate tensor work, +53%, instead of a
  shared-memory exchange of partial scores), the online softmax in registers (exp2, scale folded), and
  ``O[:, half] += P · V[:, half]`` with ``V`` the first ``kv_lora_rank`` columns of the same gathered rows.
* ``q`` is loaded once by TMA; after the last tile its shared memory holds the outputs (a ref union), stored by TMA.

Measured on the H200 (2026-11-30, S1: 64 tokens x 128 heads, top-k 2048 of 32k, block size 64;
``benchmarks/results/2026-11-30-nvidia-h200-session5-*.json``): 314 TFLOP/s (1,300 GB/s of gathered rows), the
Triton kernel 177, a jitted jnp gather + dense attention 99; matmul ceiling of that run 704. Counting the duplicate
Q Kᵀ the tensor cores do 1.53x the useful FLOPs (~480 TFLOP/s). What is left for the 400 target is in
``benchmarks/NOTES.md``.

Compiled only: the Mosaic GPU interpreter cannot run inlined Mosaic GPU code, so CPU tests check this kernel's
lowering and the Triton-backend kernel covers interpret mode.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, llvm, memref, nvvm

from pallas_attn import softmax

BLOCK_H = 64  # heads per program: one wgmma M tile
BLOCK_N = 64  # selected rows per shared-memory slot
COMPUTE_WGS = 2  # one per half of the value dims
NUM_SLOTS = 2  # q (72 KB) + two 576-wide slots (144 KB) + the slot list: a third slot would overflow 227 KB
SWIZZLE = 128  # bytes: the wgmma operand layout is (8, 64)-element tiles, 16-byte chunks xor-ed by row % 8
TILE_COLS = SWIZZLE // 2  # bf16 columns per swizzle tile
CHUNK = 16  # bytes per cp.async
THREADS_PER_ROW = SWIZZLE // CHUNK  # a row's 128-byte swizzle-tile row is 8 threads' chunks: coalesced
WG_THREADS = 128
SMEM_BYTES = 227 * 1024
MAX_TOPK = 2048  # the slot list (4 bytes an entry) takes what q and the two slots leave: 8 KB at 576 dims


def supported(q, kv_lora_rank: int, topk_padded: int) -> str | None:
    """None when this kernel applies to these inputs, else the reason it does not."""
    num_heads, dim = q.shape[1:]
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        return f"dtype {q.dtype} (bf16 / fp16 only)"
    if num_heads % BLOCK_H:
        return f"{num_heads} heads (a multiple of {BLOCK_H})"
    if dim % TILE_COLS or kv_lora_rank % (COMPUTE_WGS * TILE_COLS) or kv_lora_rank // COMPUTE_WGS > 256:
        return f"dims {dim}/{kv_lora_rank} (multiples of {TILE_COLS}; value half <= 256)"
    smem = (BLOCK_H + NUM_SLOTS * BLOCK_N) * dim * q.dtype.itemsize + 4 * topk_padded
    if topk_padded > MAX_TOPK or smem > SMEM_BYTES - 2048:
        return f"top-k {topk_padded} at {dim} dims (shared memory: at most {MAX_TOPK} at 576)"
    return None


# --------------------------------------------------------------------------- inlined Mosaic GPU (memory warpgroup)
def _i32(v):
    return arith.constant(ir.IntegerType.get_signless(32), v)


def _index(v):
    return arith.index_cast(ir.IndexType.get(), v)


def _resolve_slots(topk_row, table_row, slots, *, block_size: int, num_pages: int, max_blocks: int):
    """``slots[i] = block_table[req, p // bs] * bs + p % bs`` for ``p = topk_row[i]``, ``-1`` where ``p`` is unused
    (``-1``) or past the table row; page numbers clamped into the pool (a bad index reads a wrong row, never faults).
    The rule of :func:`pallas_attn.tiles.paged_rows` (which the Triton kernel calls), written as inlined Mosaic GPU
    code: the Pallas Mosaic GPU backend has no gather from a GMEM table.
    Each of the warpgroup's 128 threads takes every 128th entry: independent loads, one latency for all."""
    max_pos = max_blocks * block_size

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType(), plgpu.RefType()))
    def resolve(ctx, topk_ref, table_ref, slots_ref):
        del ctx
        n = ir.MemRefType(slots_ref.type).shape[0]
        tid = arith.remui(mgpu.utils.thread_idx(), _i32(WG_THREADS))

        def one(i32):
            i = _index(i32)
            pos = memref.load(topk_ref, [i])
            valid = arith.andi(arith.cmpi(arith.CmpIPredicate.sge, pos, _i32(0)),
                               arith.cmpi(arith.CmpIPredicate.slt, pos, _i32(max_pos)))
            pos = arith.select(valid, pos, _i32(0))
            page = memref.load(table_ref, [_index(arith.divui(pos, _i32(block_size)))])
            page = arith.maxsi(arith.minsi(page, _i32(num_pages - 1)), _i32(0))
            slot = arith.addi(arith.muli(page, _i32(block_size)), arith.remui(pos, _i32(block_size)))
            memref.store(arith.select(valid, slot, _i32(-1)), slots_ref, [i])

        for k in range(-(-n // WG_THREADS)):
            i32 = arith.addi(tid, _i32(k * WG_THREADS))
            if (k + 1) * WG_THREADS <= n:
                one(i32)
            else:  # a partial last round (top-k 64: half the threads)
                with mgpu.utils.when(arith.cmpi(arith.CmpIPredicate.ult, i32, _i32(n))):
                    one(i32)
        # Every thread gathers rows whose slots other threads resolved: all stores land before any gather reads.
        mgpu.utils.warpgroup_barrier()

    resolve(topk_row, table_row, slots)


def _gather(kv_ref, slots, dst, *, dim: int, itemsize: int):
    """Issue one tile's ``cp.async`` copies: ``dst[r] = kv_ref[slots[r]]`` (zeros where ``slots[r] < 0``) into the
    (8, 64)-tiled, 128-byte-swizzled ``dst [BLOCK_N, dim]``, then commit them as one group."""
    col_tiles = dim // TILE_COLS
    row_bytes = dim * itemsize
    tiled = plgpu.RefType(transforms=(plgpu.TilingTransform((8, TILE_COLS)), plgpu.SwizzleTransform(SWIZZLE)))

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType(), tiled))
    def gather(ctx, kv, slots_ref, dst_ref):
        del ctx
        i64 = ir.IntegerType.get_signless(64)
        i8 = ir.IntegerType.get_signless(8)
        tid = arith.remui(mgpu.utils.thread_idx(), _i32(WG_THREADS))
        row_in_pass = arith.divui(tid, _i32(THREADS_PER_ROW))
        lane = arith.remui(tid, _i32(THREADS_PER_ROW))  # this thread's 16-byte chunk of each 128-byte tile row
        src_base = llvm.addrspacecast(llvm.PointerType.get(address_space=1), mgpu.utils.memref_ptr(kv))
        dst_base = mgpu.utils.memref_ptr(dst_ref)
        rows_per_pass = WG_THREADS // THREADS_PER_ROW
        for p in range(BLOCK_N // rows_per_pass):
            row = arith.addi(row_in_pass, _i32(p * rows_per_pass))
            slot = memref.load(slots_ref, [_index(row)])
            valid = arith.cmpi(arith.CmpIPredicate.sge, slot, _i32(0))
            src_row = arith.extui(i64, arith.select(valid, slot, _i32(0)))
            src_bytes = arith.muli(src_row, arith.constant(i64, row_bytes))
            size = arith.select(valid, _i32(CHUNK), _i32(0))  # 0: zero-fill the chunk (an unused top-k entry)
            r8 = arith.remui(row, _i32(8))
            # byte offset in the tiled layout [BLOCK_N / 8, col_tiles, 8, 64]: 1 KB per (8 rows x 64 cols) tile
            tile_row = arith.addi(arith.muli(arith.divui(row, _i32(8)), _i32(col_tiles * 1024)),
                                  arith.muli(r8, _i32(SWIZZLE)))
            swizzled = arith.muli(arith.xori(lane, r8), _i32(CHUNK))
            for c in range(col_tiles):
                dst_off = arith.addi(arith.addi(tile_row, swizzled), _i32(c * 1024))
                src_off = arith.addi(src_bytes, arith.extui(i64, arith.addi(arith.muli(lane, _i32(CHUNK)),
                                                                            _i32(c * SWIZZLE))))
                nvvm.cp_async_shared_global(
                    mgpu.utils.getelementptr(dst_base, [dst_off], i8),
                    mgpu.utils.getelementptr(src_base, [src_off], i8),
                    CHUNK, nvvm.LoadCacheModifierKind.CG, cp_size=size)
        nvvm.cp_async_commit_group()

    gather(kv_ref, slots, dst)


def _wait_gathers(pending: int):
    """Wait until at most ``pending`` of this thread's gather groups are in flight."""

    @plgpu.inline_mgpu()
    def wait(ctx):
        del ctx
        nvvm.cp_async_wait_group(pending)

    wait()


# ---------------------------------------------------------------------------------------------- kernel body
def _kernel(token_req_ref, topk_ref, table_ref, q_ref, kv_ref, o_ref, lse_ref, scoped, *, block_size: int,
            num_pages: int, kv_lora_rank: int, scale2: float, registers: tuple[int, int]):
    (qo, kv_smem, slots_smem), (q_bar, loaded, consumed, q_done) = scoped
    t = lax.axis_index("token")
    g = lax.axis_index("hblk")
    wg = lax.axis_index("wg")
    dtype = q_ref.dtype
    dim = q_ref.shape[-1]
    half = kv_lora_rank // COMPUTE_WGS
    req = token_req_ref[t]
    num_tiles = jnp.where(req >= 0, topk_ref.shape[1] // BLOCK_N, 0)  # a padding token visits no tile
    heads = pl.ds(g * BLOCK_H, BLOCK_H)

    def compute(h: int):
        q_smem, (o_smem, lse_smem) = qo
        plgpu.set_max_registers(registers[0], action="increase")

        if h == 0:
            plgpu.copy_gmem_to_smem(q_ref.at[t, heads], q_smem, q_bar)

        plgpu.barrier_wait(q_bar)
        m_i = plgpu.layout_cast(jnp.full((BLOCK_H,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        l_i = plgpu.layout_cast(jnp.full((BLOCK_H,), 0.0, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        acc = plgpu.layout_cast(jnp.full((BLOCK_H, half), 0.0, jnp.float32), plgpu.Layout.WGMMA)

        def step(j, state):
            acc, m_i, l_i = state
            slot = lax.rem(j, NUM_SLOTS)
            plgpu.barrier_wait(loaded.at[slot])
            kv = kv_smem.at[slot]

            def qk(s_ref):
                plgpu.wgmma(s_ref, q_smem, kv.transpose((1, 0)))
                return s_ref[...]

            s2 = pl.run_scoped(qk, plgpu.ACC((BLOCK_H, BLOCK_N), jnp.float32)) * scale2
            rows = plgpu.load(slots_smem.at[pl.ds(j * BLOCK_N, BLOCK_N)], (),
                              layout=plgpu.Layout.WGMMA.reduce(0))
            s2 = jnp.where(lax.broadcast_in_dim(rows >= 0, s2.shape, [1]), s2, -jnp.inf)
            m_i, alpha, p, l_i = softmax.softmax_update(m_i, l_i, s2)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            p16 = p.astype(dtype)

            def pv(acc_ref):
                plgpu.wgmma(acc_ref, p16, kv.at[:, pl.ds(h * half, half)])

            acc = pl.run_state(pv)(plgpu.ACC.init(acc))
            plgpu.barrier_arrive(consumed.at[slot])
            return acc, m_i, l_i

        state = lax.fori_loop(0, num_tiles, step, (acc, m_i, l_i))
        out, lse = softmax.finalize(state)
        plgpu.barrier_arrive(q_done)  # both warpgroups are past their last Q Kᵀ: q's memory becomes the output
        plgpu.barrier_wait(q_done)
        o_smem.at[h][...] = out.astype(dtype)
        if h == 0:
            lse_smem[...] = lse
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem.at[h], o_ref.at[t, heads, pl.ds(h * half, half)])
        if h == 0:
            plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[t, heads])
        plgpu.wait_smem_to_gmem(0)

    for h in range(COMPUTE_WGS):
        pl.when(wg == h)(functools.partial(compute, h))

    @pl.when(wg == COMPUTE_WGS)
    def _release_registers():  # always: the compute warpgroups' increase waits for these registers
        plgpu.set_max_registers(registers[1], action="decrease")

    @pl.when((wg == COMPUTE_WGS) & (num_tiles > 0))
    def _memory():
        _resolve_slots(topk_ref.at[t], table_ref.at[req], slots_smem, block_size=block_size, num_pages=num_pages,
                       max_blocks=table_ref.shape[1])
        gather = functools.partial(_gather, kv_ref, dim=dim, itemsize=kv_ref.dtype.itemsize)

        def issue(j):
            gather(slots_smem.at[pl.ds(j * BLOCK_N, BLOCK_N)], kv_smem.at[lax.rem(j, NUM_SLOTS)])

        for j in range(min(NUM_SLOTS, topk_ref.shape[1] // BLOCK_N)):
            pl.when(j < num_tiles)(functools.partial(issue, j))

        @pl.loop(0, num_tiles)
        def _tile(j):
            @pl.when(j + 1 < num_tiles)
            def _():
                _wait_gathers(1)  # tile j landed; j + 1 may still be in flight

            @pl.when(j + 1 >= num_tiles)
            def _():
                _wait_gathers(0)

            plgpu.commit_smem()  # the copies become visible to wgmma (async proxy) in every thread ...
            plgpu.barrier_arrive(loaded.at[lax.rem(j, NUM_SLOTS)])  # ... before the one arrival

            @pl.when(j + NUM_SLOTS < num_tiles)
            def _refill():
                plgpu.barrier_wait(consumed.at[lax.rem(j, NUM_SLOTS)])
                issue(j + NUM_SLOTS)


# -------------------------------------------------------------------------------------------- pallas_call
def sparse_mla_mosaic(q, kv_cache, block_tables, topk_indices, token_req, *, kv_lora_rank: int, scale: float,
                      registers: tuple[int, int] = (232, 40)):
    """``(out [T, H, kv_lora_rank], lse f32[T, H])``; arguments validated by
    :func:`pallas_attn.sparse.sparse_mla_attention` and :func:`supported`. ``topk_indices`` padded to a multiple of
    ``BLOCK_N`` with ``-1``. ``registers``: per thread, compute and memory warpgroups; the three share the launch's
    3 × 168, so ``2 · compute + memory <= 504`` (more and the compute warpgroups' increase waits forever)."""
    num_tokens, num_heads, dim = q.shape
    num_blocks, block_size, _ = kv_cache.shape
    topk = topk_indices.shape[1]
    reason = supported(q, kv_lora_rank, topk)
    if reason is not None or topk % BLOCK_N:
        raise ValueError(f"the Mosaic sparse kernel does not support {reason or f'top-k {topk}'}")
    half = kv_lora_rank // COMPUTE_WGS
    tiled = dict(transforms=(plgpu.TilingTransform((8, TILE_COLS)), plgpu.SwizzleTransform(SWIZZLE)))
    scratch = (
        (plgpu.RefUnion(plgpu.SMEM((BLOCK_H, dim), q.dtype, **tiled),  # q, then (after the last tile) the outputs
                        (plgpu.SMEM((COMPUTE_WGS, BLOCK_H, half), q.dtype), plgpu.SMEM((BLOCK_H,), jnp.float32))),
         plgpu.SMEM((NUM_SLOTS, BLOCK_N, dim), kv_cache.dtype, **tiled),
         plgpu.SMEM((topk,), jnp.int32)),  # the token's resolved cache rows
        (plgpu.Barrier(), plgpu.Barrier(num_barriers=NUM_SLOTS),
         plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=NUM_SLOTS), plgpu.Barrier(num_arrivals=COMPUTE_WGS)),
    )
    body = functools.partial(_kernel, block_size=block_size, num_pages=num_blocks, kv_lora_rank=kv_lora_rank,
                             scale2=scale * softmax.LOG2E, registers=registers)

    def sparse_mla_kernel(*refs):
        pl.run_scoped(lambda *s: body(*refs, s), *scratch, collective_axes="wg")

    return plgpu.kernel(
        sparse_mla_kernel,
        out_type=[jax.ShapeDtypeStruct((num_tokens, num_heads, kv_lora_rank), q.dtype),
                  jax.ShapeDtypeStruct((num_tokens, num_heads), jnp.float32)],
        grid=(num_tokens, num_heads // BLOCK_H), grid_names=("token", "hblk"),
        num_threads=COMPUTE_WGS + 1, thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )(token_req, topk_indices, block_tables, q, kv_cache.reshape(num_blocks * block_size, dim))
