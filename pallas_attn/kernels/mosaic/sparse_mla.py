"""Top-k sparse MLA attention on the Mosaic GPU backend (Hopper: wgmma, warp specialisation, a cp.async gather).

The same contract as :func:`pallas_attn.ops.sparse_mla.sparse_mla_attention` (which selects this kernel on sm_90
where it applies), written FlashMLA-style for the backend that reaches Hopper's own instructions from Pallas:

* grid ``(num_tokens, H / 64)``: program ``(t, g)`` takes token ``t``'s heads ``64 g .. 64 g + 63`` (the M dim of
  both matmuls: every selected latent row is read once per 64 heads, not once per head). Dense MLA below 64 heads
  fills the tile's rows with several tokens of one request instead (:func:`tokens_per_block`), each row masked to
  its own token's keys: a multi-token step reads each latent tile once for all of them.
* three warpgroups. The **memory** warpgroup translates the token's top-k list a tile ahead (top-k position → its
  request's ``block_table`` → physical slot, ``-1`` for unused entries: the translation happens here, in the
  kernel) into a small ring of resolved cache rows, then gathers ``64``-row tiles of the latent cache into two
  shared-memory slots with ``cp.async`` (16 bytes a thread, written straight into the 128-byte-swizzled tile layout
  wgmma reads; unused rows are zero-filled). TMA cannot do this on sm_90: its row gather (``gather4``) is a
  Blackwell instruction, and Pallas exposes ``cp.async`` only before sm_90, so the copy is inlined Mosaic GPU code.
  A tile signals its own arrival (``cp.async.mbarrier.arrive.noinc``): the memory warpgroup never waits for a copy
  to land, only for a slot to be released, and the compute warpgroups fence the async proxy before wgmma reads it.
* the **score** warpgroup computes ``S = Q Kᵀ`` over the 576 dims, the online softmax in registers (exp2, scale
  folded) and ``O[:, :192] += P · V[:, :192]``; it hands ``P`` (bf16) and the rescale factor to the **value**
  warpgroup, which does ``O[:, 192:] += P · V[:, 192:]``. ``P [64 heads, 64 keys]`` travels through the slot's own
  rope columns (``[64, 64]``, the same swizzled layout, unread once Q Kᵀ is done): no extra shared memory, and the
  slot's next gather already waits for both warpgroups. The tensor cores do only the useful FLOPs. The score
  warpgroup holds the smaller accumulator (96 registers a thread against 160): its scores, P and softmax state
  spilled when it held half of the 512 columns.
* ``q`` is loaded once by TMA; after the last tile its shared memory holds the outputs (a ref union), stored by TMA.
* a small batch with a long top-k list (fewer programs than half the SMs) shares each list among several programs,
  grid ``(num_tokens, H / 64, splits)``, whose partial outputs and LSEs are merged by
  :func:`pallas_attn.merge_attention_states` (:func:`default_splits`).
* attention sinks (``f32[H]``): a program that sees its rows' whole list adds ``exp(sink_h)`` to the denominator
  the score warpgroup hands the value warpgroup (the LSE stays over the keys); split programs leave it to the
  merge, which applies it once.

Throughput against the Triton kernel and the matmul ceiling, and what each step above bought:
``docs/performance.md#sparse-mla``. How top-k positions reach pages:
``docs/design.md#sparse-top-k-through-the-block-table``.

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

from pallas_attn.core import backend, metadata, softmax
from pallas_attn.kernels.mosaic import paged as mosaic_paged

BLOCK_H = 64  # heads per program: one wgmma M tile
BLOCK_N = 64  # selected rows per shared-memory slot
COMPUTE_WGS = 2  # the score and the value warpgroup
# Value columns the score warpgroup accumulates (the value warpgroup takes the rest). Its chain (Q Kᵀ, softmax, its
# P · V) is the longer one, so it takes fewer columns, but at 256 its registers spill (docs/performance.md#sparse-mla).
SCORE_COLS = 192
MAX_ACC_COLS = 256  # one wgmma's N: wider value ranges are accumulated in blocks
NUM_SLOTS = 2  # q (72 KB) + two 576-wide slots (144 KB): a third slot would overflow 227 KB
RING = NUM_SLOTS + 1  # tiles of resolved rows: j + 2 is resolved while the compute warpgroups may read j and j + 1
SWIZZLE = 128  # bytes: the wgmma operand layout is (8, 64)-element tiles, 16-byte chunks xor-ed by row % 8
TILE_COLS = SWIZZLE // 2  # bf16 columns per swizzle tile
CHUNK = 16  # bytes per cp.async
THREADS_PER_ROW = SWIZZLE // CHUNK  # a row's 128-byte swizzle-tile row is 8 threads' chunks: coalesced
WG_THREADS = 128
# Splitting a token's top-k list over programs helps small batches, but the merge of the partial outputs costs tens
# of microseconds: only long lists (at least MIN_TOPK_TILES_TO_SPLIT tiles) are split, into programs of at least
# MIN_SPLIT_TILES tiles (docs/performance.md#sparse-mla).
MIN_SPLIT_TILES = 2
MIN_TOPK_TILES_TO_SPLIT = 16


def head_block(num_heads: int) -> int:
    """Heads per program: 64 (one wgmma M tile), or all of them below 64 (the tile's other rows are computed and
    never stored: dense MLA decode on a TP-8 shard has 16 heads, and the tile is read once for them)."""
    return min(num_heads, BLOCK_H)


def supported(q, kv_lora_rank: int) -> str | None:
    """None when this kernel applies to these inputs, else the reason it does not (any top-k: the memory
    warpgroup resolves it a tile at a time)."""
    num_heads, dim = q.shape[1:]
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        return f"dtype {q.dtype} (bf16 / fp16 only)"
    if num_heads % head_block(num_heads) or num_heads % 8:
        return f"{num_heads} heads (a multiple of {BLOCK_H}, or of 8 below it: whole 8-row tiles)"
    if dim - kv_lora_rank != BLOCK_N or kv_lora_rank % TILE_COLS or not SCORE_COLS < kv_lora_rank <= 512:
        return (f"dims {dim}/{kv_lora_rank} (rope dims {BLOCK_N}: they carry P; value dims a multiple of "
                f"{TILE_COLS} in ({SCORE_COLS}, 512]: the value warpgroup's accumulators fit its registers)")
    return None


# --------------------------------------------------------------------------- inlined Mosaic GPU (memory warpgroup)
def _i32(v):
    return arith.constant(ir.IntegerType.get_signless(32), v)


def _index(v):
    return arith.index_cast(ir.IndexType.get(), v)


def _resolve_slots(topk_row, table_row, num_keys, slots, *, block_size: int, num_pages: int):
    """``slots[i] = block_table[req, p // bs] * bs + p % bs`` for ``p = topk_row[i]``, ``-1`` where ``p`` is unused:
    outside ``[0, num_keys[0])`` (the token's keys, at most the table row's) or on a page id outside the pool.
    The rule of :func:`pallas_attn.core.tiles.paged_rows` (which the Triton kernel calls), written as inlined Mosaic GPU
    code: the Pallas Mosaic GPU backend has no gather from a GMEM table.
    Each of the warpgroup's 128 threads takes every 128th entry: independent loads, one latency for all."""
    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType(), plgpu.RefType(), plgpu.RefType()))
    def resolve(ctx, topk_ref, table_ref, keys_ref, slots_ref):
        del ctx
        n = ir.MemRefType(slots_ref.type).shape[0]
        tid = arith.remui(mgpu.utils.thread_idx(), _i32(WG_THREADS))
        max_pos = memref.load(keys_ref, [_index(_i32(0))])

        def one(i32):
            i = _index(i32)
            pos = memref.load(topk_ref, [i])
            valid = arith.andi(arith.cmpi(arith.CmpIPredicate.sge, pos, _i32(0)),
                               arith.cmpi(arith.CmpIPredicate.slt, pos, max_pos))
            pos = arith.select(valid, pos, _i32(0))
            page = memref.load(table_ref, [_index(arith.divui(pos, _i32(block_size)))])
            valid = arith.andi(valid, arith.andi(arith.cmpi(arith.CmpIPredicate.sge, page, _i32(0)),
                                                 arith.cmpi(arith.CmpIPredicate.slt, page, _i32(num_pages))))
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

    resolve(topk_row, table_row, num_keys, slots)


def _gather(kv_ref, slots, dsts):
    """Issue one tile's ``cp.async`` copies: row ``r`` of ``dsts`` (``[BLOCK_N, width]`` refs in the (8, 64)-tiled,
    128-byte-swizzled layout, splitting each row's columns in order) gets ``kv_ref[slots[r]]``, zeros where
    ``slots[r] < 0``; then commit them as one group."""
    widths = [d.shape[-1] for d in dsts]
    row_bytes = sum(widths) * kv_ref.dtype.itemsize
    tiled = plgpu.RefType(transforms=(plgpu.TilingTransform((8, TILE_COLS)), plgpu.SwizzleTransform(SWIZZLE)))

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType(), *[tiled] * len(dsts)))
    def gather(ctx, kv, slots_ref, *dst_refs):
        del ctx
        i64 = ir.IntegerType.get_signless(64)
        i8 = ir.IntegerType.get_signless(8)
        tid = arith.remui(mgpu.utils.thread_idx(), _i32(WG_THREADS))
        row_in_pass = arith.divui(tid, _i32(THREADS_PER_ROW))
        lane = arith.remui(tid, _i32(THREADS_PER_ROW))  # this thread's 16-byte chunk of each 128-byte tile row
        src_base = llvm.addrspacecast(llvm.PointerType.get(address_space=1), mgpu.utils.memref_ptr(kv))
        dst_bases = [mgpu.utils.memref_ptr(d) for d in dst_refs]
        rows_per_pass = WG_THREADS // THREADS_PER_ROW
        for p in range(BLOCK_N // rows_per_pass):
            row = arith.addi(row_in_pass, _i32(p * rows_per_pass))
            slot = memref.load(slots_ref, [_index(row)])
            valid = arith.cmpi(arith.CmpIPredicate.sge, slot, _i32(0))
            src_row = arith.extui(i64, arith.select(valid, slot, _i32(0)))
            src_bytes = arith.muli(src_row, arith.constant(i64, row_bytes))
            size = arith.select(valid, _i32(CHUNK), _i32(0))  # 0: zero-fill the chunk (an unused top-k entry)
            r8 = arith.remui(row, _i32(8))
            swizzled = arith.muli(arith.xori(lane, r8), _i32(CHUNK))
            col = 0  # the row's 128-byte column tile, counted across dsts
            for dst_base, width in zip(dst_bases, widths):
                col_tiles = width // TILE_COLS
                # byte offset in the tiled layout [BLOCK_N / 8, col_tiles, 8, 64]: 1 KB per (8 x 64) tile
                tile_row = arith.addi(arith.muli(arith.divui(row, _i32(8)), _i32(col_tiles * 1024)),
                                      arith.muli(r8, _i32(SWIZZLE)))
                for c in range(col_tiles):
                    dst_off = arith.addi(arith.addi(tile_row, swizzled), _i32(c * 1024))
                    src_off = arith.addi(src_bytes, arith.extui(i64, arith.addi(arith.muli(lane, _i32(CHUNK)),
                                                                                _i32((col + c) * SWIZZLE))))
                    nvvm.cp_async_shared_global(
                        mgpu.utils.getelementptr(dst_base, [dst_off], i8),
                        mgpu.utils.getelementptr(src_base, [src_off], i8),
                        CHUNK, nvvm.LoadCacheModifierKind.CG, cp_size=size)
                col += col_tiles
        nvvm.cp_async_commit_group()

    gather(kv_ref, slots, *dsts)


# A tile's gathers complete asynchronously: each memory thread's ``cp.async.mbarrier.arrive.noinc`` arrives on the
# slot's ``loaded`` barrier once that thread's copies have landed, so the memory warpgroup never blocks on a tile
# (with ``cp.async.wait_group`` it could signal tile j + 1 only after issuing j + 2, i.e. after both compute
# warpgroups had released tile j: Q Kᵀ of j + 1 waited for the value warpgroup's P · V of j). Pallas has no such
# arrival (its barrier refs cannot enter inline Mosaic GPU code), hence this one-instruction primitive.
@functools.cache
def _cp_async_arrive_primitive():
    """The primitive, defined on first use: it rests on Pallas internals (``jax._src``), which importing
    ``pallas_attn`` must not depend on."""
    from jax._src import core as jax_core
    from jax._src.pallas.mosaic_gpu import core as gpu_core, lowering as mgpu_lowering

    prim = jax_core.Primitive("cp_async_arrive")
    prim.multiple_results = True

    @prim.def_effectful_abstract_eval
    def _abstract_eval(barriers, index):
        del barriers, index
        return (), {gpu_core._memory_effect}

    @mgpu_lowering.register_lowering_rule(prim, mgpu.LoweringSemantics.Lane)
    @mgpu_lowering.register_lowering_rule(prim, mgpu.LoweringSemantics.Warpgroup)
    def _lowering(ctx, barriers, index):
        del ctx
        barrier = barriers[mgpu_lowering._ensure_ir_value(index, jnp.int32)]
        nvvm.cp_async_mbarrier_arrive(barrier.get_ptr(), noinc=True)
        return ()

    return prim


def _arrive_when_landed(barriers, index):
    """Every thread of the warpgroup: arrive on ``barriers[index]`` when its ``cp.async`` copies so far land."""
    _cp_async_arrive_primitive().bind(barriers, index)


def _wait_gathers():
    """Wait until this thread's gathers have landed."""

    @plgpu.inline_mgpu()
    def wait(ctx):
        del ctx
        nvvm.cp_async_wait_group(0)

    wait()


# ---------------------------------------------------------------------------------------------- kernel body
def _tile_range(keys, split, *, split_tiles: int, num_splits: int, dense: bool):
    """``(first, count)``: the tiles of a token's list this program walks. Sparse: ``split_tiles`` from
    ``split · split_tiles`` (static). Dense: the tiles of the token's ``keys`` visible positions, in fixed segments
    of ``split_tiles`` (a split size) or, with ``split_tiles == 0``, shared out evenly among ``num_splits``."""
    if not dense:
        return split * split_tiles, split_tiles
    tiles = (keys + BLOCK_N - 1) // BLOCK_N
    per = split_tiles if split_tiles else (tiles + num_splits - 1) // num_splits
    first = split * per
    return first, jnp.clip(tiles - first, 0, per)


def _kernel(block_req_ref, block_token_ref, block_keys_ref, block_ntok_ref, topk_ref, table_ref, q_ref, kv_ref,
            *refs, block_size: int, num_pages: int, scale2: float, col_blocks: tuple[tuple[int, int], ...],
            registers: tuple[int, int, int], split_tiles: int, num_splits: int, dense: bool, num_heads: int,
            block_h: int, tokens_per_block: int, has_sinks: bool):
    # A query block is tokens_per_block consecutive tokens of one request (sparse: one token): its request, first
    # token, the keys its last token sees (the most) and how many tokens it has, -1 / 0 past the last request.
    # refs: [sinks f32[rows]] (with has_sinks: a sink per row of the blocks' tiles), then
    # o [splits, blocks, tokens_per_block · H, Dv], lse f32[splits, blocks, tokens_per_block · H], the scratch.
    # Dense: topk_ref is one shared row of positions 0, 1, 2, ...
    sinks_ref = refs[0] if has_sinks else None
    o_ref, lse_ref, scoped = refs[-3:]
    (qo, k_nope, k_rope, ring, stats), (q_bar, loaded, p_ready, consumed, l_ready) = scoped
    blk = lax.axis_index("block")
    g = lax.axis_index("hblk")
    split = lax.axis_index("split")  # this program's tiles of the top-k list: split_tiles from split · split_tiles
    wg = lax.axis_index("wg")
    dtype = q_ref.dtype
    kv_lora_rank = k_nope.shape[-1]
    req = block_req_ref[blk]
    keys = block_keys_ref[blk]
    first_tile, count = _tile_range(keys, split, split_tiles=split_tiles, num_splits=num_splits, dense=dense)
    num_tiles = jnp.where(req >= 0, count, 0)  # a padding block visits no tile
    # The tile's rows: tokens_per_block · block_h rows of q [T · H, D] (token-major); the rest of the 64 (fewer heads
    # than a tile) are computed and never stored.
    num_rows = tokens_per_block * block_h
    out_rows = pl.ds(g * num_rows, num_rows)
    q_smem, (o_smems, lse_smem) = qo
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    score_blocks, value_blocks = range(1), range(1, len(col_blocks))  # the score warpgroup's columns, the rest

    def zeros(blocks):
        return tuple(plgpu.layout_cast(jnp.full((BLOCK_H, col_blocks[b][1]), 0.0, jnp.float32), plgpu.Layout.WGMMA)
                     for b in blocks)

    def rescaled(accs, factor):
        return tuple(a * lax.broadcast_in_dim(factor, a.shape, [0]) for a in accs)

    def pv(accs, p, slot, blocks):  # accs[i] += P · V[:, block i]
        def mma(acc_refs):
            for acc_ref, b in zip(acc_refs, blocks):
                plgpu.wgmma(acc_ref, p, k_nope.at[slot, :, pl.ds(*col_blocks[b])])

        return pl.run_state(mma)(tuple(plgpu.ACC.init(a) for a in accs))

    def store(accs, l_i, blocks):
        for acc, b in zip(accs, blocks):
            o_smems[b][...] = softmax.normalize(acc, l_i).astype(dtype)
        plgpu.commit_smem()
        for b in blocks:
            plgpu.copy_smem_to_gmem(rows(o_smems[b]), o_ref.at[split, blk, out_rows, pl.ds(*col_blocks[b])])

    def rows(ref):  # the tile rows that hold this program's tokens and heads
        return ref if num_rows == BLOCK_H else ref.at[pl.ds(0, num_rows)]

    @pl.when(wg == 0)
    def _scores():
        plgpu.set_max_registers(registers[0], action="increase")
        plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(block_token_ref[blk] * num_heads + g * num_rows, num_rows)],
                                rows(q_smem), q_bar)
        m_i = plgpu.layout_cast(jnp.full((BLOCK_H,), -jnp.inf, jnp.float32), row_layout)
        l_i = plgpu.layout_cast(jnp.full((BLOCK_H,), 0.0, jnp.float32), row_layout)
        row_keys = None
        if tokens_per_block > 1:  # row r is the block's token r // H: its keys, the causal bound (none past the block)
            ntok = block_ntok_ref[blk]
            token = lax.div(plgpu.broadcasted_iota(jnp.int32, (BLOCK_H,), 0, layout=row_layout), jnp.int32(num_heads))
            row_keys = jnp.where(token < ntok, keys - ntok + 1 + token, 0)
        plgpu.barrier_wait(q_bar)

        def step(j, state):
            accs, m_i, l_i = state
            slot = lax.rem(j, NUM_SLOTS)
            plgpu.barrier_wait(loaded.at[slot])
            plgpu.commit_smem()  # the rows other threads' cp.async wrote become visible to this wgmma (async proxy)

            def qk(s_ref):
                plgpu.wgmma(s_ref, q_smem.at[:, pl.ds(0, kv_lora_rank)], k_nope.at[slot].transpose((1, 0)))
                plgpu.wgmma(s_ref, q_smem.at[:, pl.ds(kv_lora_rank, BLOCK_N)], k_rope.at[slot].transpose((1, 0)))
                return s_ref[...]

            s2 = pl.run_scoped(qk, plgpu.ACC((BLOCK_H, BLOCK_N), jnp.float32)) * scale2
            rows = plgpu.load(ring.at[pl.ds(lax.rem(j, RING) * BLOCK_N, BLOCK_N)], layout=plgpu.Layout.WGMMA.reduce(0))
            visible = lax.broadcast_in_dim(rows >= 0, s2.shape, [1])
            if row_keys is not None:
                limit = row_keys - (first_tile + j) * BLOCK_N  # [64]: each row's keys left in this tile
                key = plgpu.broadcasted_iota(jnp.int32, s2.shape, 1, layout=plgpu.Layout.WGMMA)
                visible = visible & (key < lax.broadcast_in_dim(limit, s2.shape, [0]))
            s2 = jnp.where(visible, s2, -jnp.inf)
            m_i, alpha, p, l_i = softmax.softmax_update(m_i, l_i, s2)
            p16 = p.astype(dtype)
            k_rope.at[slot][...] = p16  # Q Kᵀ has read the rope columns: they carry P to the value warpgroup
            stats.at[slot][...] = alpha
            plgpu.commit_smem()  # visible to the value warpgroup's wgmma (async proxy) before the arrival
            plgpu.barrier_arrive(p_ready.at[slot])
            accs = pv(rescaled(accs, alpha), p16, slot, score_blocks)
            plgpu.barrier_arrive(consumed.at[slot])
            return accs, m_i, l_i

        accs, m_i, l_i = lax.fori_loop(0, num_tiles, step, (zeros(score_blocks), m_i, l_i))
        # [64]: the heads' sinks in base 2 join the denominator both warpgroups divide by, not the LSE
        sink2 = (plgpu.load(sinks_ref.at[pl.ds(g * num_rows, BLOCK_H)], layout=row_layout, optimized=False)
                 * softmax.LOG2E
                 if has_sinks else None)  # GMEM: a plain load, 64 floats
        den = softmax.with_sink(m_i, l_i, sink2)
        stats.at[NUM_SLOTS][...] = den
        plgpu.barrier_arrive(l_ready)  # also: the last Q Kᵀ is done, q's memory may take the outputs
        lse_smem[...] = softmax.log_sum_exp(m_i, l_i)
        store(accs, den, score_blocks)
        plgpu.copy_smem_to_gmem(rows(lse_smem), lse_ref.at[split, blk, out_rows])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 1)
    def _values():
        plgpu.set_max_registers(registers[1], action="increase")

        def step(j, accs):
            slot = lax.rem(j, NUM_SLOTS)
            plgpu.barrier_wait(loaded.at[slot])
            plgpu.barrier_wait(p_ready.at[slot])
            plgpu.commit_smem()  # as in the score warpgroup: the gathered rows, for this wgmma
            alpha = plgpu.load(stats.at[slot], layout=row_layout)
            accs = pv(rescaled(accs, alpha), k_rope.at[slot], slot, value_blocks)
            plgpu.barrier_arrive(consumed.at[slot])
            return accs

        accs = lax.fori_loop(0, num_tiles, step, zeros(value_blocks))
        plgpu.barrier_wait(l_ready)
        store(accs, plgpu.load(stats.at[NUM_SLOTS], layout=row_layout), value_blocks)
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == COMPUTE_WGS)
    def _release_registers():  # always: the compute warpgroups' increase waits for these registers
        plgpu.set_max_registers(registers[2], action="decrease")

    @pl.when((wg == COMPUTE_WGS) & (num_tiles > 0))
    def _memory():
        def resolve(j, n: int):  # tiles j .. j + n - 1 into the ring (j % RING + n <= RING)
            _resolve_slots(topk_ref.at[0 if dense else blk, pl.ds((first_tile + j) * BLOCK_N, n * BLOCK_N)],
                           table_ref.at[req], block_keys_ref.at[pl.ds(blk, 1)],
                           ring.at[pl.ds(lax.rem(j, RING) * BLOCK_N, n * BLOCK_N)],
                           block_size=block_size, num_pages=num_pages)

        def issue(j):  # tile j into its slot: loaded[slot] completes when every thread's copies have landed
            slot = lax.rem(j, NUM_SLOTS)
            plgpu.barrier_arrive(loaded.at[slot])  # releases the ring's rows of tile j (the score warpgroup's mask)
            _gather(kv_ref, ring.at[pl.ds(lax.rem(j, RING) * BLOCK_N, BLOCK_N)], (k_nope.at[slot], k_rope.at[slot]))
            _arrive_when_landed(loaded, slot)

        if dense:  # the token's own number of tiles
            for j in range(NUM_SLOTS):
                @pl.when(num_tiles > j)
                def _first_tiles():
                    resolve(j, 1)
                    issue(j)

            refills = jnp.maximum(num_tiles - NUM_SLOTS, 0)
        else:  # every token walks split_tiles
            first = min(NUM_SLOTS, split_tiles)
            resolve(0, first)
            for j in range(first):
                issue(j)
            refills = max(split_tiles - NUM_SLOTS, 0)

        @pl.loop(0, refills)
        def _refill(j):
            resolve(j + NUM_SLOTS, 1)  # before the wait: the table lookups overlap tile j's compute
            plgpu.barrier_wait(consumed.at[lax.rem(j, NUM_SLOTS)])
            issue(j + NUM_SLOTS)

        _wait_gathers()  # nothing in flight when the warpgroup exits


# -------------------------------------------------------------------------------------------- pallas_call
def _value_blocks(kv_lora_rank: int, score_cols: int) -> tuple[tuple[int, int], ...]:
    """``(start, width)`` of each accumulator's value columns: the score warpgroup's ``[0, score_cols)`` first, then
    the value warpgroup's rest in blocks of at most one wgmma's N."""
    rest = range(score_cols, kv_lora_rank, MAX_ACC_COLS)
    return ((0, score_cols),) + tuple((c, min(MAX_ACC_COLS, kv_lora_rank - c)) for c in rest)


def default_splits(num_programs: int, num_tiles: int, num_sms: int | None = None) -> int:
    """How many programs share one (token, 64 heads)'s top-k list: 1 when the batch's ``num_programs`` fill half the
    SMs (one program an SM: shared memory) or the list is short, else the largest divisor of ``num_tiles`` that keeps
    every program on its own SM and gives each at least ``MIN_SPLIT_TILES`` tiles. A small batch is latency-bound
    otherwise (one token, 128 heads: 2 programs walk 32 tiles each while 130 SMs idle). The split count follows the
    batch, so a token's output is not bitwise the same in batches of different sizes (partials are rounded to the
    output dtype before the f32 merge)."""
    sms = num_sms or backend.num_sms()
    if 2 * num_programs >= sms or num_tiles < MIN_TOPK_TILES_TO_SPLIT:
        return 1
    return max(d for d in range(1, num_tiles + 1)
               if num_tiles % d == 0 and (d == 1 or (num_programs * d <= sms and num_tiles // d >= MIN_SPLIT_TILES)))


def sparse_mla_mosaic(q, kv_cache, block_tables, topk_indices, token_req, token_keys, sinks=None, *,
                      kv_lora_rank: int, scale: float, registers: tuple[int, int, int] = (240, 224, 40),
                      score_cols: int = SCORE_COLS, num_splits: int | None = None):
    """``(out [T, H, kv_lora_rank], lse f32[T, H])``; arguments validated by
    :func:`pallas_attn.ops.sparse_mla.sparse_mla_attention` and :func:`supported`. ``topk_indices`` padded to a
    multiple of ``BLOCK_N`` with ``-1``. ``sinks``: ``f32[H]`` or None. ``registers``: per thread, the score, value
    and memory warpgroups; they share the launch's 3 × 168, so the sum must stay <= 504 (more and the compute
    warpgroups' increase waits forever). ``num_splits``: programs per (token, 64 heads), each taking an equal share
    of the top-k tiles (a divisor of their number; None: :func:`default_splits`); their partial outputs are merged
    by :func:`pallas_attn.merge_attention_states`, which then applies the sinks."""
    num_tokens, num_heads, _ = q.shape
    topk = topk_indices.shape[1]
    reason = supported(q, kv_lora_rank)
    if reason is not None or topk % BLOCK_N:
        raise ValueError(f"the Mosaic sparse kernel does not support {reason or f'top-k {topk}'}")
    num_tiles = topk // BLOCK_N
    if num_splits is None:
        num_splits = default_splits(num_tokens * (num_heads // head_block(num_heads)), num_tiles)
    if num_tiles % num_splits:
        raise ValueError(f"num_splits={num_splits} must divide the {num_tiles} top-k tiles")
    blocks, _ = query_blocks(None, token_req, token_keys, 1)
    out, lse = _launch(q, kv_cache, block_tables, topk_indices, blocks, sinks, kv_lora_rank=kv_lora_rank, scale=scale,
                       registers=registers, score_cols=score_cols, num_splits=num_splits,
                       split_tiles=num_tiles // num_splits, dense=False)
    return softmax.merge_split_outputs(out, lse, num_splits, (num_tokens, num_heads, kv_lora_rank), q.dtype,
                                       sinks if num_splits > 1 else None)


def tokens_per_block(num_heads: int, max_query_len: int) -> int:
    """Tokens of one request a dense program takes (its query block): as many as fill the 64-row tile with all their
    heads, no more than a request can have, as the paged kernel packs a GQA group's tokens
    (:func:`pallas_attn.kernels.mosaic.paged.query_block_tokens`, the latent head's group being every head). Below
    64 heads a multi-token step's tokens then share each latent tile read (a TP-8 shard's 16 heads, 2 tokens: one
    read of the request's cache instead of two)."""
    return mosaic_paged.query_block_tokens(max_query_len, num_heads)


def query_blocks(cu_query_lens, token_req, token_keys, per_block: int):
    """The dense kernel's query blocks: ``per_block`` consecutive tokens of one request each, a request's tokens in
    ``cdiv(q_len, per_block)`` blocks, requests in order, then padding blocks.

    ``cu_query_lens``: clamped (:func:`pallas_attn.core.metadata.clamp_cu`); unused with ``per_block == 1``.
    Returns ``(blocks, token_rows)``: ``blocks`` = ``(request (-1: padding), first token, keys its last token sees
    (the most), tokens)``, each ``i32[num_blocks]`` for a static bound ``num_blocks`` on any batch of these shapes;
    ``token_rows i32[T]`` where token ``t`` sits among the blocks' ``num_blocks · per_block`` token slots (0 for a
    padding token), or None with ``per_block == 1``: block ``t`` is token ``t``."""
    num_tokens = token_req.shape[0]
    if per_block == 1:
        ntok = (token_req >= 0).astype(jnp.int32)
        return (token_req, jnp.arange(num_tokens, dtype=jnp.int32), token_keys, ntok), None
    q_lens = cu_query_lens[1:] - cu_query_lens[:-1]
    num_blocks = mosaic_paged.num_query_blocks(num_tokens, q_lens.shape[0], per_block)
    block_req, first, cu_blocks = metadata.segment_items((q_lens + per_block - 1) // per_block, num_blocks)
    owned, req = block_req >= 0, jnp.maximum(block_req, 0)
    token0 = cu_query_lens[req] + first * per_block
    ntok = jnp.where(owned, jnp.clip(q_lens[req] - first * per_block, 0, per_block), 0)
    last_keys = token_keys[jnp.clip(token0 + ntok - 1, 0, num_tokens - 1)]
    blocks = (block_req, jnp.where(owned, token0, 0), jnp.where(owned, last_keys, 0), ntok)
    # one latent head whose group is a token's heads, a block's rows padded to nothing: token t's slot
    rows, _ = mosaic_paged.token_rows(cu_query_lens, cu_blocks, num_tokens, 1, 1, per_block, per_block)
    return blocks, rows[:, 0]


def dense_mla_mosaic(q, kv_cache, block_tables, cu_query_lens, token_req, token_keys, sinks=None, *,
                     kv_lora_rank: int, scale: float, num_splits: int, split_size: int | None, max_query_len: int,
                     registers: tuple[int, int, int] = (240, 224, 40), score_cols: int = SCORE_COLS):
    """Dense MLA (:func:`pallas_attn.mla_attention`) on this kernel: token ``t`` sees its request's positions
    ``[0, token_keys[t])`` (the causal bound of a multi-token step included), so its list is every position, one
    row ``0, 1, 2, ...`` shared by all tokens (read from L2, never per token), and it walks only its own tiles.
    A program takes :func:`tokens_per_block` consecutive tokens of one request (``cu_query_lens``, clamped; below 64
    heads and with ``max_query_len > 1`` several, each row masked to its token's keys).
    ``num_splits`` segments per block, of ``split_size`` keys (a multiple of ``BLOCK_N``) or, with None, an even
    share of the block's tiles. ``(out [T, H, kv_lora_rank], lse f32[T, H])``; ``token_req`` -1 for padding
    tokens (zeros, -inf)."""
    reason = supported(q, kv_lora_rank)
    if reason is not None:
        raise ValueError(f"the Mosaic MLA kernel does not support {reason}")
    if split_size is not None and split_size % BLOCK_N:
        raise ValueError(f"{split_size=} must be a multiple of the Mosaic MLA kernel's {BLOCK_N}-key tiles")
    num_tokens, num_heads, _ = q.shape
    num_blocks, block_size, _ = kv_cache.shape
    capacity = pl.cdiv(block_tables.shape[1] * block_size, BLOCK_N) * BLOCK_N
    positions = jnp.arange(capacity, dtype=jnp.int32)[None, :]  # masked past each token's keys by the resolve
    per_block = tokens_per_block(num_heads, max_query_len)
    blocks, token_rows = query_blocks(cu_query_lens, token_req, token_keys, per_block)
    out, lse = _launch(q, kv_cache, block_tables, positions, blocks, sinks, kv_lora_rank=kv_lora_rank, scale=scale,
                       registers=registers, score_cols=score_cols, num_splits=num_splits,
                       split_tiles=split_size // BLOCK_N if split_size else 0, dense=True,
                       tokens_per_block=per_block)
    if token_rows is not None:
        owned = token_req >= 0
        out = jnp.where(owned[None, :, None, None], out.reshape(num_splits, -1, num_heads, kv_lora_rank)[:, token_rows],
                        jnp.zeros((), out.dtype))
        lse = jnp.where(owned[None, :, None], lse.reshape(num_splits, -1, num_heads)[:, token_rows], -jnp.inf)
    return softmax.merge_split_outputs(out, lse, num_splits, (num_tokens, num_heads, kv_lora_rank), q.dtype,
                                       sinks if num_splits > 1 else None)


def _launch(q, kv_cache, block_tables, positions, blocks, sinks, *, kv_lora_rank: int, scale: float,
            registers: tuple[int, int, int], score_cols: int, num_splits: int, split_tiles: int, dense: bool,
            tokens_per_block: int = 1):
    """The kernel over ``(query block, head block, split)`` programs: ``(out [splits, blocks, tokens_per_block · H,
    kv_lora_rank], lse f32[splits, blocks, tokens_per_block · H])``, unmerged. ``positions``: each token's top-k
    list (sparse), or the one shared row of positions (dense); ``blocks``: ``(request, first token, keys of its last
    token, tokens)``, each ``i32[num_blocks]`` (:func:`_kernel`); ``split_tiles`` as :func:`_tile_range`."""
    num_tokens, num_heads, dim = q.shape
    num_blocks, block_size, _ = kv_cache.shape
    num_query_blocks = blocks[0].shape[0]
    block_h = head_block(num_heads)
    block_rows = tokens_per_block * num_heads  # output rows a query block owns
    col_blocks = _value_blocks(kv_lora_rank, score_cols)
    tiled = dict(transforms=(plgpu.TilingTransform((8, TILE_COLS)), plgpu.SwizzleTransform(SWIZZLE)))
    scratch = (
        (plgpu.RefUnion(plgpu.SMEM((BLOCK_H, dim), q.dtype, **tiled),  # q, then (after the last tile) the outputs
                        (tuple(plgpu.SMEM((BLOCK_H, w), q.dtype) for _, w in col_blocks),
                         plgpu.SMEM((BLOCK_H,), jnp.float32))),
         plgpu.SMEM((NUM_SLOTS, BLOCK_N, kv_lora_rank), kv_cache.dtype, **tiled),  # the slots' value columns
         plgpu.SMEM((NUM_SLOTS, BLOCK_N, dim - kv_lora_rank), kv_cache.dtype, **tiled),  # rope columns, then P
         plgpu.SMEM((RING * BLOCK_N,), jnp.int32),  # resolved cache rows of the tiles in flight
         plgpu.SMEM((NUM_SLOTS + 1, BLOCK_H), jnp.float32)),  # each slot's rescale factor, then the row sums
        # loaded: the memory warpgroup's arrival after resolving the tile, then one per thread as its copies land
        (plgpu.Barrier(), plgpu.Barrier(num_arrivals=2, num_barriers=NUM_SLOTS), plgpu.Barrier(num_barriers=NUM_SLOTS),
         plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=NUM_SLOTS), plgpu.Barrier()),
    )
    # an unsplit program sees its rows' whole list and applies the sink; split partials leave it to the merge.
    # One sink per row of a block (its tokens' heads), padded to a whole 64-row tile: the score warpgroup loads one
    # per tile row.
    in_kernel_sinks = []
    if sinks is not None and num_splits == 1:
        row_sinks = jnp.tile(sinks.astype(jnp.float32), tokens_per_block)
        in_kernel_sinks = [jnp.pad(row_sinks, (0, max(0, BLOCK_H - block_rows)))]
    # q [T · H, D], token-major: a block's rows are contiguous. The last blocks' tiles may reach past the last token.
    q_rows = q.reshape(num_tokens * num_heads, dim)
    if tokens_per_block > 1:
        q_rows = jnp.pad(q_rows, ((0, (tokens_per_block - 1) * num_heads), (0, 0)))
    body = functools.partial(_kernel, block_size=block_size, num_pages=num_blocks, scale2=scale * softmax.LOG2E,
                             col_blocks=col_blocks, registers=registers, split_tiles=split_tiles,
                             num_splits=num_splits, dense=dense, num_heads=num_heads, block_h=block_h,
                             tokens_per_block=tokens_per_block, has_sinks=bool(in_kernel_sinks))

    def mla_kernel(*refs):
        pl.run_scoped(lambda *s: body(*refs, s), *scratch, collective_axes="wg")

    mla_kernel.__name__ = "dense_mla_kernel" if dense else "sparse_mla_kernel"
    return plgpu.kernel(
        mla_kernel,
        out_type=[jax.ShapeDtypeStruct((num_splits, num_query_blocks, block_rows, kv_lora_rank), q.dtype),
                  jax.ShapeDtypeStruct((num_splits, num_query_blocks, block_rows), jnp.float32)],
        grid=(num_query_blocks, num_heads // block_h, num_splits), grid_names=("block", "hblk", "split"),
        num_threads=COMPUTE_WGS + 1, thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )(*blocks, positions, block_tables, q_rows, kv_cache.reshape(num_blocks * block_size, dim), *in_kernel_sinks)
