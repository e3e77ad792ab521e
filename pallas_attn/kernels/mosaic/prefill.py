"""Packed varlen prefill on the Mosaic GPU backend (Hopper: wgmma, TMA, warp specialisation).

``varlen_attention`` runs this kernel by default on sm_90 where it applies and was measured faster
(:func:`pallas_attn.ops.varlen.default_backend`), or when asked (``backend="mosaic"``, or a
:class:`pallas_attn.core.config.MosaicPrefillConfig`): the same contract and tile classes as the Triton kernel
(:mod:`pallas_attn.kernels.triton.prefill`, docs/design.md#tile-classes), written for the backend that reaches
Hopper's own instructions from Pallas (docs/design.md#backends):

* grid ``(Hkv, work)``: per request ``b`` and KV head, the items are its 64-row query tiles times the ``group``
  query heads that share the KV head (item ``i``: tile ``i // group``, head ``i % group``), and program ``(g, w)``
  takes three consecutive items of one request, one per compute warpgroup — three heads of one tile, or the last
  heads of a tile and the first of the next — so each K/V tile that lands in shared memory serves three query
  tiles (GQA sharing, any group size). The work list is built from ``cu_seqlens`` in the wrapper, heaviest
  programs first, so the short ones fill the tail; it has a static length and unused slots exit at once.
* four warpgroups: three compute warpgroups (``S = Q Kᵀ`` and ``O += P V`` with wgmma, the online softmax in
  registers, exp2 with the scale folded into its FMA) and one memory warpgroup that streams K and V tiles through a
  ring of shared-memory slots (``max_concurrent_steps`` of ``block_kv`` keys; two of 128 by default) with TMA,
  guarded by "loaded" and "consumed" barriers (K and V of a slot refilled apart). The compute warpgroups run free,
  without turns: while one runs its softmax, the tensor cores have the other two's matmuls (FA3 needs a ping-pong
  and an intra-warpgroup overlap to hide the softmax behind one other warpgroup; a third hides it plainly, at 160
  registers a thread). A step's exponentials are summed and packed to bf16 one column block of the K/V tile at a
  time (``MosaicPrefillConfig.p_chunks`` blocks, default two), which keeps less of P live in float32 at 160
  registers. A warpgroup whose item has fewer K/V steps than the program's longest (the next tile of a causal
  request has one more) releases the rest of the slots without computing.
* ``cu_seqlens`` is read inside the kernel. Full tiles (■, every key before the tile's first query) run with no
  mask code, diagonal tiles (△) are masked from request-local positions, future tiles (·) are never computed.
  Non-causal: only the last tile masks keys past the request.
* Model-family features (docs/design.md#model-family-features): with a window, a program's K/V stream starts at
  its items' earliest window tile and an item's steps at its own (the left-edge tiles masked); soft-cap, ALiBi and
  sinks are applied in registers, the scale still folded into the exponential.
* Q and O stay in the packed layout (one shared-memory buffer: a warpgroup writes its O after its last Q Kᵀ).
  TMA into tiled (8 × 64, 128-byte swizzled; head dim 96: 8 × 32, 64-byte) shared memory needs row offsets it can
  prove are multiples of 8, so request ``b``'s tiles start at ``cu_seqlens[b]`` rounded down to 8: the first tile
  may hold up to 7 rows of the previous request (their scores are masked, their outputs never stored), and every
  store is row-exact (a whole tile in one TMA, a partial one in at most six of 32, 16, …, 1 rows from the untiled O
  view). A query row of another request, even NaN, only makes its own score row garbage. When ``T`` is not a
  multiple of 8 (the tiled TMA descriptor needs whole 8-row groups), Q lands in the untiled view and is re-laid out
  through registers instead. Rows no program computes — padding past ``cu_seqlens[-1]``, rows before
  ``cu_seqlens[0]``, a request's rows past ``max_seqlen`` (it is truncated, keys included:
  docs/design.md#isolation-whatever-the-inputs) — are zeroed by at most 16 extra programs per KV head, 512 rows a
  round.
* K/V are read in place where they can be: request ``b``'s window ``j`` is its keys ``block_kv · [j, j + 1)``,
  packed rows ``cu_seqlens[b] + block_kv · j`` onwards, which a TMA into tiled shared memory can read when
  ``cu_seqlens[b]`` is a multiple of 8 and the window ends inside the request. The others are staged, zero-filled
  past the request's end, by a copy kernel that touches only them: every window of a request that starts elsewhere,
  and the last, partial window of one that does not (a whole-window ``P @ V`` past a request's end must meet zeros,
  not a neighbour's NaN: ``0 · NaN = NaN``). P1 and P2 stage nothing.
* LSE (natural log) goes to a buffer ``[work slots, Hkv, 3, 64]`` (a 64-wide TMA store per item; ∝ T) and is
  gathered to ``[T, Hq]`` outside the kernel, only when asked.
* Head widths 64, 128 and 256 (:data:`HEAD_DIMS`); any other multiple of 8 up to 256 (80, 96, 192, ...) runs
  zero-padded to the next (:func:`tile_head_dim`); 96 unpadded (64-byte swizzle) ran in the interpreter and failed
  compiled. Tiles are swizzled 128 bytes wide. At 256 a program has two compute warpgroups, not three
  (:func:`compute_wgs`): the 256-column float32 accumulator needs more than the 160 registers a thread three leave
  (ptxas: insufficient registers), and two 64-key K/V slots fit shared memory beside their Q/O
  (:func:`pallas_attn.core.config.default_mosaic_prefill_config`).

Its speed against cuDNN, JAX's attention_mgpu and the Triton kernel, and what each choice above bought:
docs/performance.md#varlen-prefill-mosaic-gpu. Triton stays faster for short requests (this path's work list and
staging launch cost 10-23 µs more a call) and for batches of short requests at unaligned starts, which the
default rule leaves to it (docs/performance.md#prefill-backend-rule).

Interpret mode (CPU): the Mosaic GPU interpreter simulates the warpgroups, barriers, TMA and wgmma. Its limits
(jax 0.11.2): wgmma's A operand must be in shared memory (P goes through a scratch buffer there), pl.run_state
with a pre-initialised accumulator does not run (each P·V is a fresh accumulator there; compiled, P·V accumulates
into the scaled accumulator), and every thread that waits on a barrier must observe each of its completions
(the releases are guarded: only steps the memory warpgroup refills). The tile bounds, the softmax update, the two
tile loops and the finalisation are the shared ones of :mod:`pallas_attn.core.masks` and
:mod:`pallas_attn.core.softmax`. Reference: :func:`pallas_attn.reference.varlen_attention`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_attn.core import config as config_lib, masks, metadata, softmax, tiles
from pallas_attn.core.backend import pallas_triton as pltriton  # the staging copy; XLA's gather without it
from pallas_attn.kernels.mosaic import columns

BLOCK_Q = 64  # query rows per compute warpgroup (one wgmma M tile)
# Items (query tile, head) per program, one per compute warpgroup: three hide each one's softmax behind the other
# two's matmuls without turns (two free-running warpgroups are slower: docs/performance.md#varlen-prefill-mosaic-gpu).
COMPUTE_WGS = 3
# Heads wider than 128 take two: a 256-column float32 accumulator is 128 of a thread's registers, more than three
# compute warpgroups leave room for (ptxas: insufficient registers), as JAX's attention_mgpu does at every width.
WIDE_COMPUTE_WGS = 2
# Registers per thread (compute, memory warpgroup) by compute warpgroups: wgs · compute + memory must stay within
# what the launch of (wgs + 1) · 128 threads gives each (65536 / 512 = 128, 65536 / 384 = 170 → 168), or the
# compute warpgroups' increase never returns. 24 is the least setmaxnreg allows; the values are multiples of 8.
REGISTERS = {3: (160, 24), 2: (232, 40)}
SMEM_BYTES = 232_448  # shared memory per block on sm_90 (227 KB)
ROW_ALIGN = 8  # TMA into (8, 64)-tiled shared memory: a tile's packed row offset must be a provable multiple of 8
PAD_ROWS_PER_SLOT = 8 * BLOCK_Q  # rows a padding program zeroes per round (rows no request computes must come out 0)
# Padding programs per KV head at most (each loops over rounds): without padding they only launch and exit, as the
# unused work slots do (P1: ~1,400 such programs)
MAX_PAD_SLOTS = 16
STORE_CHUNKS = (64, 32, 16, 8, 4, 2, 1)  # TMA stores of [lo, hi) rows: greedy, each size at most once
# The kernel's head widths. A narrower head, any multiple of 8 (80, 96, 112, ...), runs zero-padded to the next of
# them (tile_head_dim).
HEAD_DIMS = (64, 128, 256)


def supported(q, k) -> str | None:
    """None when the Mosaic kernel applies to these inputs, else the reason it does not."""
    head_dim = q.shape[-1]
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        return f"dtype {q.dtype} (bf16 / fp16 only)"
    if head_dim % 8 or head_dim > HEAD_DIMS[-1]:
        return f"head_dim={head_dim} (supported: multiples of 8 up to {HEAD_DIMS[-1]})"
    return None


def compute_wgs(width: int) -> int:
    """Compute warpgroups (items per program) at kernel width ``width``: three up to 128, else two."""
    return COMPUTE_WGS if width <= 128 else WIDE_COMPUTE_WGS


def tile_head_dim(head_dim: int) -> int:
    """The kernel width a head runs at: itself when it is one of :data:`HEAD_DIMS`, else the next one (zero
    columns: ``q·k`` and ``P·V`` are unchanged, the output's extra columns are dropped)."""
    return next(d for d in HEAD_DIMS if d >= head_dim)


def swizzle_bytes(head_dim: int, itemsize: int) -> int:
    """The widest wgmma swizzle (128, 64 or 32 bytes) a row of ``head_dim`` elements is a whole number of: the
    (8, swizzle / itemsize) tiles of Q, K, V (and P, which must match V's) in shared memory."""
    return next(sw for sw in (128, 64, 32) if head_dim * itemsize % sw == 0)


def smem_bytes(cfg: config_lib.MosaicPrefillConfig, head_dim: int, itemsize: int, return_lse: bool) -> int:
    """Shared memory of the kernel's buffers (barriers aside): Q/O of each compute warpgroup, the K/V slots, LSE."""
    wgs = compute_wgs(head_dim)
    q_and_o = wgs * BLOCK_Q * head_dim * itemsize
    kv_slots = 2 * cfg.max_concurrent_steps * cfg.block_kv * head_dim * itemsize
    return q_and_o + kv_slots + (wgs * BLOCK_Q * 4 if return_lse else 0)


# ---------------------------------------------------------------------------------------------- kernel body
def _store_rows(o_smem, o_ref, row0, lo, hi, head):
    """TMA-store rows ``[lo, hi)`` of ``o_smem [BLOCK_Q, D]`` (untiled) to packed rows ``row0 + [lo, hi)`` of
    ``o_ref[:, head]``: whole tile in one copy, a partial one in at most six, never touching a row outside."""
    cur = lo
    for size in STORE_CHUNKS:
        take = hi - cur >= size

        @pl.when(take)
        def _store(cur=cur, size=size):
            plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(cur, size)], o_ref.at[pl.ds(row0 + cur, size), head])

        cur = cur + jnp.where(take, size, 0)


def _kernel(cu_ref, zero_ref, kv_stage_ref, q_tiles_ref, work_req_ref, work_item_ref, q_ref, k_ref, v_ref,
            k_staged_ref, v_staged_ref, *refs, group: int, num_work_slots: int, num_pad_slots: int,
            max_seqlen: int, block_kv: int, mcs: int, causal: bool, scale: float, mods: masks.ScoreMods,
            compiled: bool, q_tiled_tma: bool, p_chunks: int, wgs: int):
    # refs: [alibi_slopes f32[Hq]], [sinks f32[Hq]] (as mods says), o, lse, the scratch
    refs = list(refs)
    slopes_ref = refs.pop(0) if mods.alibi else None
    sinks_ref = refs.pop(0) if mods.sinks else None
    o_ref, lse_ref, scoped = refs
    (q_and_o, k_smem, v_smem, lse_smem, p_smem), (q_bar, k_bar, v_bar), (k_free, v_free) = scoped
    q_smem, o_smem = q_and_o  # one buffer: a warpgroup's O is written after its last Q Kᵀ
    kv_head = lax.axis_index("heads")
    w = lax.axis_index("work")
    wg = lax.axis_index("wg")
    dtype = q_ref.dtype
    head_dim = q_ref.shape[-1]
    is_tile = w < num_work_slots
    b_raw = work_req_ref[jnp.minimum(w, num_work_slots - 1)]
    live = is_tile & (b_raw >= 0)
    b = jnp.maximum(b_raw, 0)
    first_item = work_item_ref[jnp.minimum(w, num_work_slots - 1)]
    start = cu_ref[b]
    seq_len = jnp.minimum(cu_ref[b + 1] - start, max_seqlen)  # a longer request is truncated (zero_ref: the rest)
    num_items = q_tiles_ref[b] * group
    # A tile's rows sit at packed rows row0 + [0, 64): row0 is start rounded down to ROW_ALIGN (+ 64 m), so the Q
    # load is a plain TMA of the packed layout; rows before the request (r < lo) or after it (r >= hi) are loaded,
    # masked or ignored, and never stored.
    base = lax.div(start, jnp.int32(ROW_ALIGN)) * ROW_ALIGN

    def item_of(i):
        """Warpgroup ``i``'s item ``first_item + i`` of (request b, this KV head): query tile ``m`` (item // group)
        of head ``kv_head · group + item % group``. Returns (has one, q_head, row0, q0, lo, hi, (first step, first
        unmasked step, end of the unmasked steps, kv steps)); steps [0, 0) without an item. Without a window the
        first two are 0: every step from 0 is unmasked up to the diagonal."""
        item = first_item + i
        has = live & (item < num_items)
        m = lax.div(item, jnp.int32(group))
        q_head = kv_head * group + lax.rem(item, jnp.int32(group))
        row0 = base + m * BLOCK_Q
        q0 = row0 - start  # request-local position of the tile's row 0 (negative: the previous request's rows)
        lo = jnp.maximum(-q0, 0)
        hi = jnp.minimum(seq_len - q0, BLOCK_Q)
        if mods.windowed:
            steps = masks.window_tile_ranges(q0 + lo, q0 + hi - 1, seq_len, block_kv,
                                             (mods.window_left, mods.window_right), causal=causal)
        else:
            steps = (0, 0, *masks.kv_tile_ranges(q0 + lo, q0 + hi - 1, seq_len, block_kv, causal=causal))
        first, full_first, full_steps, kv_steps = (jnp.int32(x) for x in steps)
        return has, q_head, row0, q0, lo, hi, (jnp.where(has, first, 0), full_first, full_steps,
                                               jnp.where(has, kv_steps, 0))

    has_item, q_head, row0, q0, lo, hi, (first_step, full_first, full_steps, kv_steps) = item_of(wg)
    # The memory warpgroup streams the K/V tiles from the earliest item's first (a window's) to the longest item's
    # last; a slot is refilled once every compute warpgroup released it (those whose steps start later or end
    # sooner release those slots without computing: see _release_head and _release_rest).
    items = [item_of(i) for i in range(wgs)]
    cta_steps = functools.reduce(jnp.maximum, [it[-1][-1] for it in items])
    cta_first = jnp.int32(0)
    if mods.window_left >= 0:
        cta_first = functools.reduce(jnp.minimum, [jnp.where(it[0], it[-1][0], cta_steps) for it in items])

    def release(free, j):  # only steps the memory warpgroup refills (it waits for exactly those)
        pl.when(j + mcs < cta_steps)(lambda: plgpu.barrier_arrive(free.at[lax.rem(j, jnp.int32(mcs))]))

    def pass_over(start, end):
        """Steps ``[start, end)`` this warpgroup does not compute: wait for each load and release the slot, so that
        every refill gets its ``wgs`` arrivals in phase order (and every completion is observed: the
        interpreter checks)."""
        @pl.loop(start, end)
        def _(j):
            slot = lax.rem(j, jnp.int32(mcs))
            plgpu.barrier_wait(k_bar.at[slot])
            release(k_free, j)
            plgpu.barrier_wait(v_bar.at[slot])
            release(v_free, j)

    @pl.when(has_item & (wg < wgs))
    def _compute():
        plgpu.set_max_registers(REGISTERS[wgs][0], action="increase")
        q_rows = q_ref.at[pl.ds(row0, BLOCK_Q), q_head]
        if q_tiled_tma:
            plgpu.copy_gmem_to_smem(q_rows, q_smem.at[wg], q_bar.at[wg])
            plgpu.barrier_wait(q_bar.at[wg])
        else:  # a TMA into tiled smem needs T in whole 8-row groups: land in (untiled) O, re-lay out through registers
            plgpu.copy_gmem_to_smem(q_rows, o_smem.at[wg], q_bar.at[wg])
            plgpu.barrier_wait(q_bar.at[wg])
            q_rows_in_regs = plgpu.load(o_smem.at[wg], layout=plgpu.Layout.WGMMA)
            plgpu.commit_smem()  # (a warpgroup barrier) every thread has read O's view before Q's is written over it
            q_smem.at[wg][...] = q_rows_in_regs
            plgpu.commit_smem()
        m_i = plgpu.layout_cast(jnp.full((BLOCK_Q,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        l_i = plgpu.layout_cast(jnp.full((BLOCK_Q,), 0.0, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        acc = plgpu.layout_cast(jnp.full((BLOCK_Q, head_dim), 0.0, jnp.float32), plgpu.Layout.WGMMA)

        def positions(j):  # request-local positions of the rows and columns, in the wgmma register layout
            rows = plgpu.broadcasted_iota(jnp.int32, (BLOCK_Q, block_kv), 0, layout=plgpu.Layout.WGMMA) + q0
            cols = plgpu.broadcasted_iota(jnp.int32, (BLOCK_Q, block_kv), 1, layout=plgpu.Layout.WGMMA) + j * block_kv
            return rows, cols

        def mask(j, s):
            rows, cols = positions(j)
            visible = (cols <= rows) if causal else (cols < seq_len)
            if mods.window_left >= 0:
                visible &= cols >= rows - mods.window_left
            if mods.window_right >= 0:
                visible &= cols <= rows + mods.window_right
            return jnp.where(visible, s, -jnp.inf)

        # The scale stays folded into the exponential's FMA (softmax_update_packed), so soft-cap and ALiBi are
        # written in the units of the scores they leave: the raw score, or with soft-cap tanh(s · scale / cap),
        # whose cap joins the scale. ALiBi adds slope_h · (key - query) in those units, split as
        # slope_h · (key - q0) - slope_h · (query - q0) around the tile's first row q0: the loop adds only the first
        # term, one value per column of a step (a score costs one add, not a distance of its own), and the second,
        # a constant per row, leaves the softmax unchanged: it comes off the running max after the loop, so the
        # LSE and the sink see the true scores. Near the diagonal, where the weights are, key - q0 stays small.
        exp_scale = (mods.softcap if mods.softcap > 0 else scale) * softmax.LOG2E
        slope = slopes_ref[q_head] * (softmax.LOG2E / exp_scale) if mods.alibi else None

        def alibi_columns(j):  # [block_kv] slope_h · (key - q0), in the layout of a score row
            # float distances built by one conversion a step and an add of an immediate a value (columns.py):
            # exact while |key - q0| < 2^24 (a tile's rows start at most 7 before its request), rounded beyond
            return slope * columns.columns(j * block_kv - q0, block_kv, jnp.float32, compiled=compiled)

        def scores(j, s):
            if mods.softcap > 0:  # tanh.approx.f32 (approx_math; docs/performance.md#model-family-features)
                s = jnp.tanh(s * (scale / mods.softcap))
            if mods.alibi:
                s = s + lax.broadcast_in_dim(alibi_columns(j), s.shape, [1])
            return s

        def wait_k(j):
            pl.when(j < kv_steps)(lambda: plgpu.barrier_wait(k_bar.at[lax.rem(j, jnp.int32(mcs))]))

        def pv_dot(j, p16, acc):
            """``acc + P @ V``, waiting for the next K tile while the wgmma runs."""
            v_slot = v_smem.at[lax.rem(j, jnp.int32(mcs))]
            if compiled:  # wgmma into the scaled accumulator itself

                def pv(acc_ref):
                    plgpu.wgmma(acc_ref, p16, v_slot)
                    wait_k(j + 1)

                return pl.run_state(pv)(plgpu.ACC.init(acc))
            # Interpret mode: the interpreter takes wgmma's A operand from shared memory only and cannot run
            # pl.run_state with a pre-initialised accumulator, so P goes through smem into a fresh accumulator.
            p_smem.at[wg][...] = p16
            plgpu.commit_smem()

            def pv_fresh(acc_ref):
                plgpu.wgmma(acc_ref, p_smem.at[wg], v_slot)
                wait_k(j + 1)
                return acc_ref[...]

            return acc + pl.run_scoped(pv_fresh, plgpu.ACC((BLOCK_Q, head_dim), jnp.float32))

        def step(j, state, masked: bool):
            acc, m_i, l_i = state
            slot = lax.rem(j, jnp.int32(mcs))

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, q_smem.at[wg], k_smem.at[slot].transpose((1, 0)))
                return acc_ref[...]

            s = scores(j, pl.run_scoped(qk, plgpu.ACC((BLOCK_Q, block_kv), jnp.float32)))
            release(k_free, j)
            if masked:
                s = mask(j, s)
            # exponentials summed and packed a column block at a time: fewer live float32 registers
            m_i, alpha, p, l_i = softmax.softmax_update_packed(m_i, l_i, s, dtype, p_chunks, scale=exp_scale)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            # The softmax and the rescale ahead of the wait for V (as JAX's attention_mgpu keeps them ahead of its
            # ping-pong's barriers). ptxas follows the program order: each block of P is packed as its exponentials
            # finish, which leaves nothing to spill (docs/performance.md#varlen-prefill-mosaic-gpu).
            acc, m_i, l_i, p16 = lax.optimization_barrier((acc, m_i, l_i, p.astype(dtype)))
            plgpu.barrier_wait(v_bar.at[slot])
            acc = pv_dot(j, p16, acc)
            release(v_free, j)
            return acc, m_i, l_i

        pass_over(cta_first, first_step)  # steps before this item's window: other items' keys
        wait_k(first_step)
        state = softmax.kv_loop((acc, m_i, l_i), first_step, full_steps, kv_steps, step,
                                full_first if mods.windowed else None)
        if mods.alibi:  # the rows' term of ALiBi, slope_h · (query - q0) in base 2, off the running max
            # (the rows' offsets reduced from the score layout's iota: Mosaic GPU infers that layout at once)
            query = jnp.max(positions(0)[0], axis=1) - q0
            acc, m_i, l_i = state
            state = acc, m_i - slopes_ref[q_head] * softmax.LOG2E * query.astype(jnp.float32), l_i
        sink2 = None
        if mods.sinks:  # the head's sink in base 2 joins the denominator, not the LSE
            sink2 = plgpu.layout_cast(jnp.full((BLOCK_Q,), sinks_ref[q_head] * softmax.LOG2E, jnp.float32),
                                      plgpu.Layout.WGMMA.reduce(1))
        out, lse = softmax.finalize(state, sink2)
        o_smem.at[wg][...] = out.astype(dtype)
        if lse_ref is not None:
            lse_smem.at[wg][...] = lse
        plgpu.commit_smem()
        _store_rows(o_smem.at[wg], o_ref, row0, lo, hi, q_head)
        if lse_ref is not None:
            plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[w, kv_head, wg])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(live & (wg < wgs))
    def _release_rest():
        """The longest item's steps past this warpgroup's own (adjacent tiles of a causal request differ by one
        step; no item: all of them)."""
        pass_over(jnp.where(has_item, kv_steps, cta_first), cta_steps)

    @pl.when(live & (wg == wgs))
    def _memory():
        plgpu.set_max_registers(REGISTERS[wgs][1], action="decrease")

        # windows from first_staged on are staged windows staged0, staged0 + 1, ... (see _stage_kv); read once
        first_staged, staged0 = kv_stage_ref[2 * b], kv_stage_ref[2 * b + 1]

        def load(step, slot, k_ready=lambda: None, v_ready=lambda: None):
            """K/V window ``step`` into ``slot``, in place or staged; K and V each after its own release (a
            refill)."""
            staged = step >= first_staged

            def copy(packed, staged_ref, dst, bar):
                @pl.when(jnp.logical_not(staged))
                def _in_place():  # base == start here: its provable multiple of 8 is what the TMA needs
                    plgpu.copy_gmem_to_smem(packed.at[pl.ds(base + step * block_kv, block_kv), kv_head], dst, bar)

                @pl.when(staged)
                def _staged():
                    rows = pl.ds((staged0 + step - first_staged) * block_kv, block_kv)
                    plgpu.copy_gmem_to_smem(staged_ref.at[rows, kv_head], dst, bar)

            k_ready()
            copy(k_ref, k_staged_ref, k_smem.at[slot], k_bar.at[slot])
            v_ready()
            copy(v_ref, v_staged_ref, v_smem.at[slot], v_bar.at[slot])

        for i in range(mcs):
            step = cta_first + i
            pl.when(step < cta_steps)(functools.partial(load, step, lax.rem(step, jnp.int32(mcs))))

        @pl.loop(cta_first, jnp.maximum(cta_steps - mcs, cta_first))
        def _refill(step):
            slot = lax.rem(step, jnp.int32(mcs))
            # K and V of a slot are refilled apart: the compute warpgroups release K a softmax before V
            load(step + mcs, slot, k_ready=lambda: plgpu.barrier_wait(k_free.at[slot]),
                 v_ready=lambda: plgpu.barrier_wait(v_free.at[slot]))

    @pl.when(jnp.logical_not(is_tile) & (wg < wgs) & (zero_ref[0] > 0))
    def _zero_rows():  # the row ranges no program computes (_zero_ranges), for this KV head's heads
        o_smem.at[wg][...] = jnp.zeros((BLOCK_Q, head_dim), dtype)
        plgpu.commit_smem()
        stride = num_pad_slots * PAD_ROWS_PER_SLOT

        @pl.loop(0, zero_ref[0])
        def _range(i):  # PAD_ROWS_PER_SLOT rows per program a round, strided over the padding programs
            first = zero_ref[1 + 2 * i] + (w - num_work_slots) * PAD_ROWS_PER_SLOT
            end = zero_ref[2 + 2 * i]

            @pl.loop(0, lax.div(jnp.maximum(end - first, 0) + stride - 1, jnp.int32(stride)))
            def _round(r):
                for h in range(group):  # warpgroup wg zeroes heads wg, wg + wgs, ... of the group
                    @pl.when(wg == h % wgs)
                    def _head(h=h):
                        for c in range(PAD_ROWS_PER_SLOT // BLOCK_Q):
                            row = first + r * stride + c * BLOCK_Q
                            _store_rows(o_smem.at[wg], o_ref, row, 0, jnp.clip(end - row, 0, BLOCK_Q),
                                        kv_head * group + h)

        plgpu.wait_smem_to_gmem(0)


# -------------------------------------------------------------------------------------------- pallas_call
def _tiles_per_seq(max_seqlen: int) -> int:
    """Query tiles of one request at most: its rows start at ``cu_seqlens[b]`` rounded down to 8."""
    return pl.cdiv(max(max_seqlen, 1) + ROW_ALIGN - 1, BLOCK_Q)


def _work_list(cu_seqlens, num_slots: int, causal: bool, max_seqlen: int, group: int,
               wgs: int = COMPUTE_WGS):
    """Programs' items, heaviest first: ``(request i32[num_slots], first item i32[num_slots], slot i32[num_slots],
    cu_programs i32[num_seqs + 1], tiles i32[num_seqs])``; request -1 for unused slots.

    Request ``b`` has ``tiles[b] = cdiv(len_b + cu_seqlens[b] % 8, 64)`` query tiles (its rows from ``cu_seqlens[b]``
    rounded down to 8) and, per KV head, ``tiles[b] · group`` items (tile ``item // group``, head ``item % group`` of
    the group). Its programs take ``wgs`` consecutive items each (one per compute warpgroup): program ``c``
    of request ``b`` is work slot ``slot[cu_programs[b] + c]``. Sorting by the keys a program visits (longest first)
    gives the tail of the grid the short programs, wherever their request sits in the batch."""
    # a request longer than max_seqlen (a broken contract) is truncated to its first max_seqlen rows, so it cannot
    # push other requests' tiles out of the static list
    starts, q_lens = cu_seqlens[:-1], jnp.minimum(cu_seqlens[1:] - cu_seqlens[:-1], max_seqlen)
    shift = starts % ROW_ALIGN
    n_tiles = jnp.where(q_lens > 0, (q_lens + shift + BLOCK_Q - 1) // BLOCK_Q, 0)
    n_programs = (n_tiles * group + wgs - 1) // wgs
    req, program, cu_programs = metadata.segment_items(n_programs, num_slots)
    safe = jnp.maximum(req, 0)
    first = program * wgs
    end_tile = (jnp.minimum(first + wgs, n_tiles[safe] * group) - 1) // group + 1  # past its last item's
    keys = jnp.minimum(end_tile * BLOCK_Q - shift[safe], q_lens[safe]) if causal else q_lens[safe]
    order = jnp.argsort(jnp.where(req >= 0, -keys, 1), stable=True)
    slot = jnp.zeros((num_slots,), jnp.int32).at[order].set(jnp.arange(num_slots, dtype=jnp.int32))
    return req[order], first[order], slot, cu_programs, n_tiles


def num_work_slots(num_tokens: int, num_seqs: int, max_seqlen: int, group: int, wgs: int = COMPUTE_WGS) -> int:
    """A static bound on the programs ``_work_list`` hands out: Σ_b cdiv(tiles_b · group, wgs), with
    ``tiles_b = cdiv(len_b + shift_b, 64) ≤ (len_b + 7 + 63) / 64`` and ``tiles_b ≤ _tiles_per_seq(max_seqlen)``.
    A slot past the last program still launches (and exits): the bound is kept tight."""
    tiles = (num_tokens + (BLOCK_Q - 1 + ROW_ALIGN - 1) * num_seqs) // BLOCK_Q
    rounding = 0 if group % wgs == 0 else num_seqs  # a request's last program may be part-filled
    return min(pl.cdiv(tiles * group, wgs) + rounding,
               num_seqs * pl.cdiv(_tiles_per_seq(max_seqlen) * group, wgs))


def _stage_kernel(src_ref, end_ref, k_ref, v_ref, k_staged_ref, v_staged_ref, *, block_kv: int, num_kv_heads: int,
                  head_dim: int):
    """Program ``(w, h)``: staged window ``w`` of KV head ``h`` ← packed rows ``src[w] + [0, block_kv)``, zeros from
    ``end[w]`` on; nothing when ``src[w] < 0`` (an unused window: left unwritten, never read)."""
    w, h = pl.program_id(0), pl.program_id(1)
    src = src_ref[w]

    @pl.when(src >= 0)
    def _copy():
        tok = src + jnp.arange(block_kv)
        cols = tiles.Cols(head_dim, config_lib.next_pow2(head_dim))  # Triton tiles: a power of two wide (96: 128)
        dst = (w * block_kv + jnp.arange(block_kv)) * num_kv_heads + h
        for x_ref, staged_ref in ((k_ref, k_staged_ref), (v_ref, v_staged_ref)):
            tiles.store_rows(staged_ref, dst, cols, tiles.load_rows(x_ref, tok * num_kv_heads + h, cols,
                                                                    tok < end_ref[w]))


def _stage_kv(k, v, cu_seqlens, block_kv: int, max_seqlen: int, interpret: bool):
    """The K/V windows the kernel cannot read in place, copied: ``(k_staged, v_staged [S · block_kv, Hkv, D],
    kv_stage i32[2 · num_seqs])``; request ``b``'s windows from ``kv_stage[2 b]`` on are staged windows
    ``kv_stage[2 b + 1]``, ``kv_stage[2 b + 1] + 1``, ...

    Request ``b``'s window ``j`` (its keys ``block_kv · [j, j + 1)``) is read in place when the request starts on a
    multiple of 8 (TMA into tiled shared memory) and the window ends inside it; else staged, zeros past the
    request's end (a whole-window P @ V must not meet a neighbour's NaN). So a request starting on a multiple of 8
    stages at most its last window, and P1 nothing. A copy kernel, not an XLA gather: the static bound on staged
    windows is all of K/V, and the gather would write all of it (zeros where unused) on every call. A request
    longer than ``max_seqlen`` ends after its first ``max_seqlen`` keys, as in the kernel."""
    num_tokens, num_kv_heads, head_dim = k.shape
    num_seqs = cu_seqlens.shape[0] - 1
    starts = cu_seqlens[:-1]
    q_lens = jnp.minimum(cu_seqlens[1:] - starts, max_seqlen)
    ends = starts + q_lens
    num_windows = (q_lens + block_kv - 1) // block_kv
    first_staged = jnp.where(starts % ROW_ALIGN == 0, num_windows - (q_lens % block_kv != 0), 0)
    num_staged = pl.cdiv(num_tokens, block_kv) + num_seqs  # Σ_b cdiv(len_b, block_kv) at most
    owner, index, cu_staged = metadata.segment_items(num_windows - first_staged, num_staged)
    req = jnp.maximum(owner, 0)
    src = jnp.where(owner >= 0, starts[req] + (first_staged[req] + index) * block_kv, -1)
    if pltriton is None:  # no Pallas Triton backend: the same windows by XLA, which writes every staged row
        tok = src[:, None] + jnp.arange(block_kv)  # [num_staged, block_kv]
        keep = ((src >= 0)[:, None] & (tok < ends[req][:, None]))[..., None, None]
        rows = jnp.clip(tok, 0, num_tokens - 1).reshape(-1)
        k_staged, v_staged = (jnp.where(keep, x[rows].reshape(num_staged, block_kv, num_kv_heads, head_dim), 0)
                              .reshape(-1, num_kv_heads, head_dim) for x in (k, v))
        kv_stage = jnp.stack([first_staged, cu_staged[:-1]], axis=1).reshape(-1)
        return k_staged, v_staged, kv_stage
    flat = lambda x: x.reshape(-1, head_dim)  # noqa: E731  row = token · Hkv + head
    padded = config_lib.next_pow2(head_dim)
    full = lambda n: pl.BlockSpec((n, padded), lambda *_: (0, 0))  # noqa: E731  whole array; rows indexed inside
    vector = pl.BlockSpec((num_staged,), lambda *_: (0,))
    k_staged, v_staged = pl.pallas_call(
        functools.partial(_stage_kernel, block_kv=block_kv, num_kv_heads=num_kv_heads, head_dim=head_dim),
        grid=(num_staged, num_kv_heads),
        in_specs=[vector, vector, full(num_tokens * num_kv_heads), full(num_tokens * num_kv_heads)],
        out_specs=[full(num_staged * block_kv * num_kv_heads)] * 2,
        out_shape=[jax.ShapeDtypeStruct((num_staged * block_kv * num_kv_heads, head_dim), k.dtype)] * 2,
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret, name="stage_kv_windows",
    )(src, ends[req], flat(k), flat(v))
    kv_stage = jnp.stack([first_staged, cu_staged[:-1]], axis=1).reshape(-1)
    return (k_staged.reshape(-1, num_kv_heads, head_dim), v_staged.reshape(-1, num_kv_heads, head_dim), kv_stage)


def _zero_ranges(cu_seqlens, num_tokens: int, max_seqlen: int):
    """``i32[1 + 2 (num_seqs + 2)]``: the count ``n``, then ``n`` row ranges ``[start, end)`` that no program
    computes — rows before ``cu_seqlens[0]``, each request's rows past its first ``max_seqlen``, rows from
    ``cu_seqlens[-1]`` on — whose outputs must come out zero. Empty ranges are left out, so a well-formed batch
    with padding has one, and the padding programs read three scalars."""
    starts, ends = cu_seqlens[:-1], cu_seqlens[1:]
    lo = jnp.concatenate([jnp.zeros((1,), jnp.int32), starts + jnp.minimum(ends - starts, max_seqlen),
                          cu_seqlens[-1:]])
    hi = jnp.concatenate([cu_seqlens[:1], ends, jnp.full((1,), num_tokens, jnp.int32)])
    nonempty = hi > lo
    index = jnp.where(nonempty, jnp.cumsum(nonempty) - 1, lo.shape[0])  # past the end: dropped
    ranges = jnp.zeros((lo.shape[0], 2), jnp.int32).at[index].set(jnp.stack([lo, hi], 1), mode="drop")
    return jnp.concatenate([jnp.sum(nonempty, dtype=jnp.int32)[None], ranges.reshape(-1)])


def _call_kernel(q, k, v, k_staged, v_staged, cu_seqlens, kv_stage, q_tiles, work_req, work_item, features=(), *,
                 num_slots: int, max_seqlen: int, causal: bool, scale: float, return_lse: bool, interpret: bool,
                 cfg: config_lib.MosaicPrefillConfig, mods: masks.ScoreMods = masks.NO_MODS):
    """The kernel on K/V (rows in whole 8-row groups), their staged windows and a work list: ``out [T, Hq, D]``,
    ``lse_tiles f32[num_slots, Hkv, W, 64]``."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    block_kv, max_concurrent_steps = cfg.block_kv, cfg.max_concurrent_steps
    wgs = compute_wgs(head_dim)
    swizzle = swizzle_bytes(head_dim, q.dtype.itemsize)
    tiled = dict(transforms=(plgpu.TilingTransform((8, swizzle // q.dtype.itemsize)),
                             plgpu.SwizzleTransform(swizzle)))
    scratch = (
        (plgpu.RefUnion(plgpu.SMEM((wgs, BLOCK_Q, head_dim), q.dtype, **tiled),  # Q, one per warpgroup
                        plgpu.SMEM((wgs, BLOCK_Q, head_dim), q.dtype)),  # O: untiled (any row range stored)
         plgpu.SMEM((max_concurrent_steps, block_kv, head_dim), k.dtype, **tiled),
         plgpu.SMEM((max_concurrent_steps, block_kv, head_dim), v.dtype, **tiled),
         plgpu.SMEM((wgs, BLOCK_Q), jnp.float32) if return_lse else None,
         plgpu.SMEM((wgs, BLOCK_Q, block_kv), q.dtype, **tiled) if interpret else None),  # P, see pv_dot
        (plgpu.Barrier(num_barriers=wgs), plgpu.Barrier(num_barriers=max_concurrent_steps),
         plgpu.Barrier(num_barriers=max_concurrent_steps)),
        (plgpu.Barrier(num_arrivals=wgs, num_barriers=max_concurrent_steps),) * 2,
    )
    num_pad_slots = min(pl.cdiv(num_tokens, PAD_ROWS_PER_SLOT), MAX_PAD_SLOTS)
    body = functools.partial(
        _kernel, group=num_q_heads // num_kv_heads, num_work_slots=num_slots, num_pad_slots=num_pad_slots,
        max_seqlen=max_seqlen,
        block_kv=block_kv, mcs=max_concurrent_steps, causal=causal, scale=scale, mods=mods,
        compiled=not interpret, q_tiled_tma=num_tokens % ROW_ALIGN == 0, p_chunks=cfg.p_chunks, wgs=wgs)

    def entry(*refs):
        pl.run_scoped(lambda *s: body(*refs, s), *scratch, collective_axes="wg")

    out_type = [jax.ShapeDtypeStruct((num_tokens, num_q_heads, head_dim), q.dtype),
                jax.ShapeDtypeStruct((num_slots, num_kv_heads, wgs, BLOCK_Q), jnp.float32)  # ∝ T
                if return_lse else None]
    interpret_params = None
    if interpret:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
        interpret_params = InterpretGPUParams()
    # Consecutive work slots of one KV head launch together (grid x: Pallas puts the last grid axis there), the
    # heaviest first; a request's programs, which read the same K/V windows, sit close in that order (L2).
    # reduction_scratch_bytes=0: the softmax's row max and sum reduce within a warp (the WGMMA layout keeps a row in
    # one warp), so Mosaic GPU's cross-warp scratch (2 KiB by default; a reduction that needed it would fail to
    # lower) would only take shared memory that head dim 256 needs.
    return plgpu.kernel(
        entry, out_type=out_type, grid=(num_kv_heads, num_slots + num_pad_slots),
        grid_names=("heads", "work"), num_threads=wgs + 1, thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0), interpret=interpret_params,
    )(cu_seqlens, _zero_ranges(cu_seqlens, num_tokens, max_seqlen), kv_stage, q_tiles, work_req, work_item, q, k, v,
      k_staged, v_staged, *features)


def varlen_attention_mosaic(q, k, v, cu_seqlens, alibi_slopes=None, sinks=None, *, max_seqlen: int, causal: bool,
                            scale: float, return_lse: bool, interpret: bool, cfg: config_lib.MosaicPrefillConfig,
                            mods: masks.ScoreMods = masks.NO_MODS):
    """``out [T, Hq, D]`` (and ``lse f32[T, Hq]``); arguments validated by :func:`pallas_attn.varlen_attention`,
    tuned by ``cfg`` (:class:`pallas_attn.core.config.MosaicPrefillConfig`); ``alibi_slopes`` / ``sinks``
    ``f32[Hq]`` exactly when ``mods`` says."""
    reason = supported(q, k)
    if reason is not None:
        raise ValueError(f"the Mosaic prefill does not support {reason}")
    head_dim = q.shape[-1]
    width = tile_head_dim(head_dim)
    need = smem_bytes(cfg, width, q.dtype.itemsize, return_lse)
    if need > SMEM_BYTES:
        raise ValueError(f"config={cfg} needs {need} bytes of shared memory at {head_dim=}, more than the "
                         f"{SMEM_BYTES} of sm_90: fewer max_concurrent_steps or a smaller block_kv")
    if width != head_dim:
        pad_cols = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, width - head_dim)))  # noqa: E731
        q, k, v = pad_cols(q), pad_cols(k), pad_cols(v)
    num_tokens, num_q_heads, _ = q.shape
    cu_seqlens = metadata.clamp_cu(cu_seqlens, num_tokens)  # whatever it holds, requests stay disjoint and inside T
    group = num_q_heads // k.shape[1]
    num_seqs = cu_seqlens.shape[0] - 1
    wgs = compute_wgs(width)
    num_slots = num_work_slots(num_tokens, num_seqs, max_seqlen, group, wgs)
    work_req, work_item, work_slot, cu_programs, q_tiles = _work_list(cu_seqlens, num_slots, causal, max_seqlen,
                                                                      group, wgs)
    k_staged, v_staged, kv_stage = _stage_kv(k, v, cu_seqlens, cfg.block_kv, max_seqlen, interpret)
    pad_rows = lambda x: jnp.pad(x, ((0, -num_tokens % ROW_ALIGN), (0, 0), (0, 0)))  # noqa: E731
    q_in = q
    if num_tokens % ROW_ALIGN:  # a TMA into tiled shared memory reads whole 8-row groups of K/V
        k, v = pad_rows(k), pad_rows(v)
        if width > 128:
            # Q too (the output is sliced back): at head dim 256, re-laying Q out through registers (the kernel's way
            # at 64 and 128) takes Mosaic GPU's layout inference many minutes to compile.
            q_in = pad_rows(q)
    out, lse_tiles = _call_kernel(
        q_in, k, v, k_staged, v_staged, cu_seqlens, kv_stage, q_tiles, work_req, work_item,
        [x.astype(jnp.float32) for x in (alibi_slopes, sinks) if x is not None], num_slots=num_slots,
        max_seqlen=max_seqlen, causal=causal, scale=scale, return_lse=return_lse, interpret=interpret, cfg=cfg,
        mods=mods)
    out = out[:num_tokens, :, :head_dim]
    if not return_lse:
        return out, None
    token_req = metadata.token_requests(cu_seqlens, num_tokens)  # -1: padding row
    req = jnp.maximum(token_req, 0)
    position = jnp.arange(num_tokens, dtype=jnp.int32) - cu_seqlens[req]
    valid = (token_req >= 0) & (position < max_seqlen)  # a longer request's rows past max_seqlen: -inf, as padding
    # LSE rows are in the kernel's tile coordinates: tile row = request-local position + cu_seqlens[b] % 8
    local = position + cu_seqlens[req] % ROW_ALIGN
    head = jnp.arange(num_q_heads, dtype=jnp.int32)
    item = (local // BLOCK_Q)[:, None] * group + head % group  # [T, Hq]: the item within (request, KV head)
    slot = work_slot[jnp.minimum(cu_programs[req][:, None] + item // wgs, num_slots - 1)]
    lse = lse_tiles[slot, head // group, item % wgs, (local % BLOCK_Q)[:, None]]  # [T, Hq]
    return out, jnp.where(valid[:, None], lse, -jnp.inf)
