"""Packed varlen prefill on the Mosaic GPU backend (Hopper: wgmma, TMA, warp specialisation).

``varlen_attention`` runs this kernel by default on sm_90 where it applies and was measured faster (head_dim 128,
``max_seqlen >= 1024``; :func:`pallas_attn.prefill.default_backend`), or when asked (``backend="mosaic"``): the
same contract as the Triton-backend one and the seed's structure, written for the backend that reaches Hopper's
own instructions from Pallas:

* grid ``(Hq / 2, work)``: work item ``w`` is one 64-row query tile ``m`` of request ``b`` (a list built from
  ``cu_seqlens`` in the wrapper, heaviest tiles first, so the short ones fill the tail), program ``(p, w)`` takes
  its query heads ``2p, 2p + 1`` — two heads of one KV group, so each K/V tile that lands in shared memory serves
  both (GQA sharing; the group size must be even). The head pairs of one tile launch together and share its K/V
  in L2. The list has a static length (``cdiv(T, 64) + 2 · num_seqs``); unused items exit at once.
* three warpgroups: two compute warpgroups (one query head each: ``S = Q Kᵀ`` and ``O += P V`` with wgmma, the
  online softmax in registers, exp2 with the scale folded into its FMA) and one memory warpgroup that streams K
  and V tiles through a ring of shared-memory slots with TMA, guarded by "loaded" and "consumed" barriers (K and V
  of a slot refilled apart). Compiled, the schedule is FA3's: the compute warpgroups pass a turn between them
  (ping-pong), and in its turn a warpgroup issues Q K_jᵀ and P_{j-1} V_{j-1} back to back, then runs step j's
  softmax under them and the other warpgroup's two matmuls (intra-warpgroup overlap; ``overlap=False``: the plain
  ping-pong, one matmul a turn). Interpreted, the plain loop without turns.
* ``cu_seqlens`` is read inside the kernel. Full tiles (■, every key before the tile's first query) run with no
  mask code, diagonal tiles (△) are masked from request-local positions, future tiles (·) are never loaded.
  Non-causal: only the last tile masks keys past the request.
* Q and O stay in the packed layout. TMA into tiled (8 × 64, 128-byte swizzled) shared memory needs row offsets
  it can prove are multiples of 8, so request ``b``'s tiles start at ``cu_seqlens[b]`` rounded down to 8: the
  first tile may hold up to 7 rows of the previous request (their scores are masked, their outputs never stored),
  and every store is row-exact (a whole tile in one TMA, a partial one in at most six of 32, 16, …, 1 rows from
  the untiled O buffer). A query row of another request, even NaN, only makes its own score row garbage. When
  ``T`` is not a multiple of 8 (the tiled TMA descriptor needs whole 8-row groups), Q lands in the untiled O
  buffer and is re-laid out through registers instead. Padding rows (past ``cu_seqlens[-1]``) are zeroed by
  extra work items, 512 rows each.
* K/V are staged: a whole-window ``P @ V`` past a request's end must meet zeros, not a neighbour's NaN
  (``0 · NaN = NaN``). The wrapper gathers them so request ``b``'s keys start at row ``128 · kv_tiles[b]`` with
  zeros up to the next 128-key window (P1: one gather pass over K and V, ~0.3 GB of traffic).
* LSE (natural log) goes to a buffer ``[work items, Hq, 64]`` (a 64-wide TMA store per tile and head; ∝ T) and
  is gathered to ``[T, Hq]`` outside the kernel, only when asked.

Measured on the H200 (2026-12-01, bf16, Hq 32, Hkv 8, D 128; the ninth session's harness run,
``benchmarks/results/…-session9-harness.json``): P1 510.7 TFLOP/s (Triton kernel 405.7, cuDNN packed 525.9,
JAX's attention_mgpu 502.7 in six dense calls), P2 614.0 (Triton 462.6, attention_mgpu 589.3, cuDNN 566.6); a
probe earlier in the same call gave 538.8 / 627.8. The board is at its 700 W power cap on P2 (1,680–1,695 MHz of
1,980). Triton is faster for short requests (256 × 128 tokens: 0.504 vs 0.841 ms) and head_dim 64 (P1: 364.3 vs
350.6 TFLOP/s), which the default rule leaves to it.

Interpret mode (CPU): the Mosaic GPU interpreter simulates the warpgroups, barriers, TMA and wgmma. Its limits
(jax 0.11.2): wgmma's A operand must be in shared memory (P goes through a scratch buffer there), pl.run_state
with a pre-initialised accumulator does not run (each P·V is a fresh accumulator there; compiled, P·V accumulates
into the scaled accumulator), and a barrier completion that no thread waits for breaks the next grid point (the
releases are guarded: only steps the memory warpgroup refills). The tile bounds, the softmax update, the two
tile loops and the finalisation are the shared ones of :mod:`pallas_attn.masks` and :mod:`pallas_attn.softmax`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_attn import masks, metadata, softmax

BLOCK_Q = 64  # query rows per compute warpgroup (one wgmma M tile)
COMPUTE_WGS = 2  # two query heads of one KV group per program
BLOCK_KV = 128  # keys per K/V slot; a third slot (max_concurrent_steps=3) overflows shared memory at D 128
ROW_ALIGN = 8  # TMA into (8, 64)-tiled shared memory: a tile's packed row offset must be a provable multiple of 8
PAD_ROWS_PER_SLOT = 8 * BLOCK_Q  # padding rows one program zeroes (rows past cu_seqlens[-1] must come out 0)
STORE_CHUNKS = (64, 32, 16, 8, 4, 2, 1)  # TMA stores of [lo, hi) rows: greedy, each size at most once


def supported(q, k) -> str | None:
    """None when the Mosaic kernel applies to these inputs, else the reason it does not."""
    num_q_heads, head_dim = q.shape[1:]
    group = num_q_heads // k.shape[1]
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        return f"dtype {q.dtype} (bf16 / fp16 only)"
    if head_dim not in (64, 128):  # 256: Q, O and two K/V slots outgrow the 227 KB of shared memory
        return f"head_dim {head_dim} (64 or 128)"
    if group % COMPUTE_WGS:
        return f"GQA group {group} (the two compute warpgroups take two heads of one group: even groups only)"
    return None


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


def _kernel(cu_ref, kv_tiles_ref, work_req_ref, work_tile_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, scoped, *,
            group: int, num_tile_slots: int, block_kv: int, mcs: int, causal: bool, scale2: float,
            compiled: bool, q_tiled_tma: bool, registers: tuple[int, int], overlap: bool):
    (q_smem, o_smem, k_smem, v_smem, lse_smem, p_smem), (q_bar, k_bar, v_bar), (k_free, v_free), schedule, turns = \
        scoped
    pair = lax.axis_index("heads")
    w = lax.axis_index("work")
    wg = lax.axis_index("wg")
    dtype = q_ref.dtype
    head_dim = q_ref.shape[-1]
    q_head = pair * COMPUTE_WGS + wg
    kv_head = lax.div(pair * COMPUTE_WGS, jnp.int32(group))
    is_tile = w < num_tile_slots
    b_raw = work_req_ref[jnp.minimum(w, num_tile_slots - 1)]
    live = is_tile & (b_raw >= 0)
    b = jnp.maximum(b_raw, 0)
    m = work_tile_ref[jnp.minimum(w, num_tile_slots - 1)]
    start = cu_ref[b]
    seq_len = cu_ref[b + 1] - start
    # The tile's rows sit at packed rows row0 + [0, 64): row0 is start rounded down to ROW_ALIGN (+ 64 m), so the
    # Q load is a plain TMA of the packed layout; rows before the request (r < lo) or after it (r >= hi) are loaded,
    # masked or ignored, and never stored.
    base = lax.div(start, jnp.int32(ROW_ALIGN)) * ROW_ALIGN
    row0 = base + m * BLOCK_Q
    q0 = row0 - start  # request-local position of the tile's row 0 (negative: the previous request's rows)
    lo = jnp.maximum(-q0, 0)
    hi = jnp.minimum(seq_len - q0, BLOCK_Q)
    full_steps, kv_steps = masks.kv_tile_ranges(q0 + lo, q0 + hi - 1, seq_len, block_kv, causal=causal)
    kv_row0 = kv_tiles_ref[b] * block_kv  # K/V are staged: request b from this multiple of the window, zeros after

    # FA3's ping-pong: the two compute warpgroups take turns on the tensor cores. Compiled only: the Mosaic GPU
    # interpreter (jax 0.11.2) intermittently deadlocked in a barrier wait with it (2 of ~15 runs of the tests).
    def schedule_arrive():
        if compiled:
            plgpu.barrier_arrive(schedule)

    def schedule_wait():
        if compiled:
            plgpu.barrier_wait(schedule)

    def schedule_turn():
        schedule_arrive()
        schedule_wait()

    @pl.when(live & (wg < COMPUTE_WGS))
    def _compute():
        plgpu.set_max_registers(registers[0], action="increase")
        q_rows = q_ref.at[pl.ds(row0, BLOCK_Q), q_head]
        if q_tiled_tma:
            plgpu.copy_gmem_to_smem(q_rows, q_smem.at[wg], q_bar.at[wg])
            plgpu.barrier_wait(q_bar.at[wg])
        else:  # a TMA into tiled smem needs T in whole 8-row groups: land in (untiled) O, re-lay out through registers
            plgpu.copy_gmem_to_smem(q_rows, o_smem.at[wg], q_bar.at[wg])
            plgpu.barrier_wait(q_bar.at[wg])
            q_smem.at[wg][...] = plgpu.load(o_smem.at[wg], layout=plgpu.Layout.WGMMA)
            plgpu.commit_smem()
        m_i = plgpu.layout_cast(jnp.full((BLOCK_Q,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        l_i = plgpu.layout_cast(jnp.full((BLOCK_Q,), 0.0, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        acc = plgpu.layout_cast(jnp.full((BLOCK_Q, head_dim), 0.0, jnp.float32), plgpu.Layout.WGMMA)

        def mask(j, s):  # request-local positions, in the wgmma register layout
            rows = plgpu.broadcasted_iota(jnp.int32, (BLOCK_Q, block_kv), 0, layout=plgpu.Layout.WGMMA) + q0
            cols = plgpu.broadcasted_iota(jnp.int32, (BLOCK_Q, block_kv), 1, layout=plgpu.Layout.WGMMA) + j * block_kv
            return jnp.where((cols <= rows) if causal else (cols < seq_len), s, -jnp.inf)

        def release(free, j):  # only steps the memory warpgroup refills (it waits for exactly those)
            pl.when(j + mcs < kv_steps)(lambda: plgpu.barrier_arrive(free.at[lax.rem(j, jnp.int32(mcs))]))

        def wait_k(j):
            pl.when(j < kv_steps)(lambda: plgpu.barrier_wait(k_bar.at[lax.rem(j, jnp.int32(mcs))]))

        def softmax_of(j, s, m_i, l_i, masked):
            """Step j's softmax on its raw scores ``s`` (scale2 folded into the exponent), K's slot released first."""
            # Release the slot only when the memory warpgroup will refill it (it waits for exactly those steps): a
            # completion nobody waits for would leave the barrier a phase ahead.
            release(k_free, j)
            if masked:
                s = mask(j, s)
            return softmax.softmax_update(m_i, l_i, s, scale=scale2)

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
                schedule_turn()  # the other warpgroup's P @ V goes next, while this one's Q Kᵀ finishes
                return acc_ref[...]

            s = pl.run_scoped(qk, plgpu.ACC((BLOCK_Q, block_kv), jnp.float32))
            m_i, alpha, p, l_i = softmax_of(j, s, m_i, l_i, masked)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            p16 = p.astype(dtype)
            # Keep the softmax ahead of the barriers (as JAX's attention_mgpu does): the scheduler must not sink it
            # into the other warpgroup's turn.
            acc, m_i, l_i, p16 = lax.optimization_barrier((acc, m_i, l_i, p16))
            schedule_arrive()
            plgpu.barrier_wait(v_bar.at[slot])
            schedule_wait()
            acc = pv_dot(j, p16, acc)
            release(v_free, j)
            return acc, m_i, l_i

        def overlapped(o_acc, s_acc):
            """FA3's schedule: intra-warpgroup overlap inside a ping-pong. Step j issues Q K_jᵀ and P_{j-1} V_{j-1}
            in this warpgroup's turn (a token passed between the two through ``turns``), then runs step j's softmax
            while P_{j-1} V_{j-1} and the other warpgroup's two matmuls are on the tensor cores."""
            def turn_wait():
                plgpu.barrier_wait(turns.at[wg])

            def turn_pass():
                plgpu.barrier_arrive(turns.at[1 - wg])

            def scores(j):
                s_acc[...] = plgpu.layout_cast(jnp.zeros((BLOCK_Q, block_kv), jnp.float32), plgpu.Layout.WGMMA)
                plgpu.wgmma(s_acc, q_smem.at[wg], k_smem.at[lax.rem(j, jnp.int32(mcs))].transpose((1, 0)))

            def step(j, carry, masked: bool):
                p16, m_i, l_i = carry
                prev = lax.rem(j - 1, jnp.int32(mcs))
                wait_k(j)
                turn_wait()
                scores(j)
                plgpu.barrier_wait(v_bar.at[prev])
                plgpu.wgmma(o_acc, p16, v_smem.at[prev])
                turn_pass()
                s = plgpu.wgmma_accumulator_load(s_acc, wait_n=1)  # Q K_jᵀ done, P V may still run
                m_i, alpha, p, l_i = softmax_of(j, s, m_i, l_i, masked)
                # The softmax ahead of the wait for P V in the PTX (LLVM sank it past the wait). P is converted
                # after the wait: its bf16 registers are the next P V's operand, and defining a wgmma operand while
                # a wgmma is in flight makes ptxas serialise every wgmma (C7513). ptxas (CUDA 13.0) still puts the
                # wait at the softmax's start: it gives P_{j-1}'s registers to the softmax's temporaries, and it
                # waits for every wgmma before the scores are overwritten in place. Keeping both out of its way
                # measured slower (benchmarks/NOTES.md, eighth and ninth sessions).
                m_i, alpha, p, l_i = lax.optimization_barrier((m_i, alpha, p, l_i))
                o = plgpu.wgmma_accumulator_load(o_acc, wait_n=0)
                release(v_free, j - 1)
                o_acc[...] = o * lax.broadcast_in_dim(alpha, o.shape, [0])
                return p.astype(dtype), m_i, l_i

            pl.when(wg == 1)(turn_pass)  # warpgroup 0 takes the first turn
            wait_k(jnp.int32(0))
            turn_wait()
            scores(jnp.int32(0))
            turn_pass()
            s = plgpu.wgmma_accumulator_load(s_acc, wait_n=0)
            m0, _, p, l0 = softmax_of(jnp.int32(0), s, m_i, l_i, masked=True)  # a full tile's mask is all true
            o_acc[...] = acc
            p16, m_n, l_n = softmax.kv_loop((p.astype(dtype), m0, l0), 1, jnp.maximum(full_steps, 1), kv_steps,
                                            step)
            last = lax.rem(kv_steps - 1, jnp.int32(mcs))
            turn_wait()
            plgpu.barrier_wait(v_bar.at[last])
            plgpu.wgmma(o_acc, p16, v_smem.at[last])
            pl.when(wg == 0)(turn_pass)  # warpgroup 1's last pass would have no taker (it passed first)
            return plgpu.wgmma_accumulator_load(o_acc, wait_n=0), m_n, l_n

        if compiled and overlap:
            state = pl.run_scoped(overlapped, plgpu.ACC((BLOCK_Q, head_dim), jnp.float32),
                                  plgpu.ACC((BLOCK_Q, block_kv), jnp.float32))
        else:
            wait_k(jnp.int32(0))
            pl.when(wg == 1)(schedule_turn)  # warpgroup 1 starts half a step behind warpgroup 0
            state = softmax.kv_loop((acc, m_i, l_i), 0, full_steps, kv_steps, step)
            pl.when(wg == 0)(schedule_turn)
        out, lse = softmax.finalize(state)
        o_smem.at[wg][...] = out.astype(dtype)
        if lse_ref is not None:
            lse_smem.at[wg][...] = lse
        plgpu.commit_smem()
        _store_rows(o_smem.at[wg], o_ref, row0, lo, hi, q_head)
        if lse_ref is not None:
            plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[w, q_head])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(live & (wg == COMPUTE_WGS))
    def _memory():
        plgpu.set_max_registers(registers[1], action="decrease")

        def load(step, slot, k_ready=lambda: None, v_ready=lambda: None):
            """K/V tile ``step`` into ``slot``; K and V each after its own release (a refill)."""
            rows = (pl.ds(kv_row0 + step * block_kv, block_kv), kv_head)
            k_ready()
            plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[slot], k_bar.at[slot])
            v_ready()
            plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[slot], v_bar.at[slot])

        for i in range(mcs):
            pl.when(i < kv_steps)(functools.partial(load, i, i))

        @pl.loop(0, jnp.maximum(kv_steps - mcs, 0))
        def _refill(step):
            slot = lax.rem(step, jnp.int32(mcs))
            # K and V of a slot are refilled apart: both compute warpgroups release K a matmul before V (a step
            # before it in the overlapped schedule, whose V is only released after the next Q Kᵀ)
            load(step + mcs, slot, k_ready=lambda: plgpu.barrier_wait(k_free.at[slot]),
                 v_ready=lambda: plgpu.barrier_wait(v_free.at[slot]))

    @pl.when(jnp.logical_not(is_tile) & (wg < COMPUTE_WGS))
    def _zero_padding():  # rows past cu_seqlens[-1]: PAD_ROWS_PER_SLOT of them per program, this warpgroup's head
        num_rows = o_ref.shape[0]
        first = cu_ref[cu_ref.shape[0] - 1] + (w - num_tile_slots) * PAD_ROWS_PER_SLOT

        @pl.when(first < num_rows)
        def _zero():
            o_smem.at[wg][...] = jnp.zeros((BLOCK_Q, head_dim), dtype)
            plgpu.commit_smem()
            for c in range(PAD_ROWS_PER_SLOT // BLOCK_Q):
                row = first + c * BLOCK_Q
                _store_rows(o_smem.at[wg], o_ref, row, 0, jnp.clip(num_rows - row, 0, BLOCK_Q), q_head)
            plgpu.wait_smem_to_gmem(0)


# -------------------------------------------------------------------------------------------- pallas_call
def _work_list(cu_seqlens, num_slots: int, causal: bool, tiles_per_seq: int):
    """Query tiles, heaviest first: ``(request i32[num_slots], tile i32[num_slots], slot i32[num_slots],
    cu_tiles i32[num_seqs + 1])``; request -1 for unused slots. Tile ``m`` of request ``b`` is work item
    ``slot[cu_tiles[b] + m]``.

    Request ``b`` has ``cdiv(len_b + cu_seqlens[b] % 8, 64)`` tiles (its rows from ``cu_seqlens[b]`` rounded down to
    8). Sorting by the keys each tile visits (longest first) gives the tail of the grid the short tiles, wherever
    their request sits in the batch."""
    starts, q_lens = cu_seqlens[:-1], cu_seqlens[1:] - cu_seqlens[:-1]
    shift = starts % ROW_ALIGN
    # at most tiles_per_seq each: a request longer than max_seqlen (a broken contract) is truncated, and cannot push
    # other requests' tiles out of the static list
    n_tiles = jnp.where(q_lens > 0, jnp.minimum((q_lens + shift + BLOCK_Q - 1) // BLOCK_Q, tiles_per_seq), 0)
    req, tile, cu_tiles = metadata.segment_items(n_tiles, num_slots)
    safe = jnp.maximum(req, 0)
    keys = jnp.minimum((tile + 1) * BLOCK_Q - shift[safe], q_lens[safe]) if causal else q_lens[safe]
    order = jnp.argsort(jnp.where(req >= 0, -keys, 1), stable=True)
    slot = jnp.zeros((num_slots,), jnp.int32).at[order].set(jnp.arange(num_slots, dtype=jnp.int32))
    return req[order], tile[order], slot, cu_tiles


def varlen_attention_mosaic(q, k, v, cu_seqlens, *, max_seqlen: int, causal: bool, scale: float, return_lse: bool,
                            interpret: bool, block_kv: int = BLOCK_KV, max_concurrent_steps: int = 2,
                            registers: tuple[int, int] = (232, 40), overlap: bool = True):
    """``out [T, Hq, D]`` (and ``lse f32[T, Hq]``); arguments validated by :func:`pallas_attn.varlen_attention`.

    ``block_kv`` (keys per K/V slot), ``max_concurrent_steps`` (slots), ``registers`` (per thread: compute,
    memory warpgroup; 2 · compute + memory ≤ 504 = 3 × 168, the launch's share, or the compute warpgroups' increase
    never returns) and ``overlap`` (compiled schedule: FA3's intra-warpgroup overlap, or the plain ping-pong) are
    tuning knobs for the probe, not public API."""
    reason = supported(q, k)
    if reason is not None:
        raise ValueError(f"the Mosaic prefill does not support {reason}")
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    num_seqs = cu_seqlens.shape[0] - 1
    tiles_per_seq = pl.cdiv(max(max_seqlen, 1) + ROW_ALIGN - 1, BLOCK_Q)
    num_tile_slots = min(pl.cdiv(num_tokens, BLOCK_Q) + 2 * num_seqs, num_seqs * tiles_per_seq)
    num_pad_slots = pl.cdiv(num_tokens, PAD_ROWS_PER_SLOT)
    work_req, work_tile, work_slot, cu_q_tiles = _work_list(cu_seqlens, num_tile_slots, causal, tiles_per_seq)

    # K/V staging: a whole-window P @ V past a request's end must meet zeros, not a neighbour's (or padding's) NaN
    # (0 · NaN = NaN), and TMA into tiled shared memory needs tile-aligned rows. Request b's keys move to row
    # block_kv * kv_tiles[b], zeros after it up to the next window. Q and O stay in the packed layout (4x the bytes
    # at GQA 4): a Q row of another request only makes its own score row garbage, and stores are row-exact.
    q_lens = cu_seqlens[1:] - cu_seqlens[:-1]
    staged_rows = pl.cdiv(num_tokens + block_kv * num_seqs, block_kv) * block_kv
    row_req, local, cu_staged = metadata.segment_items(pl.cdiv(q_lens, block_kv) * block_kv, staged_rows)
    kv_tiles = cu_staged // block_kv  # request b's first window
    live_row = (row_req >= 0) & (local < q_lens[jnp.maximum(row_req, 0)])
    src = jnp.where(live_row, cu_seqlens[jnp.maximum(row_req, 0)] + local, 0)
    # A gather (each staged row finds its token): XLA's scatter of 8 KB rows ran at ~250 GB/s.
    stage = lambda x: jnp.where(live_row[:, None, None], x[src], jnp.zeros((), x.dtype))  # noqa: E731
    k, v = stage(k), stage(v)

    tiled = dict(transforms=(plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)))
    scratch = (
        (plgpu.SMEM((COMPUTE_WGS, BLOCK_Q, head_dim), q.dtype, **tiled),  # Q, one per compute warpgroup
         plgpu.SMEM((COMPUTE_WGS, BLOCK_Q, head_dim), q.dtype),  # O: untiled, so any row range can be stored
         plgpu.SMEM((max_concurrent_steps, block_kv, head_dim), k.dtype, **tiled),
         plgpu.SMEM((max_concurrent_steps, block_kv, head_dim), v.dtype, **tiled),
         plgpu.SMEM((COMPUTE_WGS, BLOCK_Q), jnp.float32) if return_lse else None,
         plgpu.SMEM((COMPUTE_WGS, BLOCK_Q, block_kv), q.dtype, **tiled) if interpret else None),  # P, see pv_dot
        (plgpu.Barrier(num_barriers=COMPUTE_WGS), plgpu.Barrier(num_barriers=max_concurrent_steps),
         plgpu.Barrier(num_barriers=max_concurrent_steps)),
        (plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=max_concurrent_steps),) * 2,
        plgpu.Barrier(num_arrivals=COMPUTE_WGS),
        plgpu.Barrier(num_arrivals=1, num_barriers=COMPUTE_WGS),  # the overlapped schedule's turn tokens
    )
    body = functools.partial(
        _kernel, group=num_q_heads // num_kv_heads, num_tile_slots=num_tile_slots, block_kv=block_kv,
        mcs=max_concurrent_steps, causal=causal, scale2=scale * softmax.LOG2E, compiled=not interpret,
        q_tiled_tma=num_tokens % ROW_ALIGN == 0, registers=registers, overlap=overlap)

    def entry(cu_ref, kv_tiles_ref, work_req_ref, work_tile_ref, q_ref, k_ref, v_ref, o_ref, lse_ref):
        pl.run_scoped(lambda *s: body(cu_ref, kv_tiles_ref, work_req_ref, work_tile_ref, q_ref, k_ref, v_ref, o_ref,
                                      lse_ref, s), *scratch, collective_axes="wg")

    out_type = [jax.ShapeDtypeStruct((num_tokens, num_q_heads, head_dim), q.dtype),
                jax.ShapeDtypeStruct((num_tile_slots, num_q_heads, BLOCK_Q), jnp.float32)  # per work item: ∝ T
                if return_lse else None]
    interpret_params = None
    if interpret:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
        interpret_params = InterpretGPUParams()
    # The head pairs of one tile launch together (grid x): the two pairs of a KV group read its K/V at once (L2).
    out, lse_tiles = plgpu.kernel(
        entry, out_type=out_type, grid=(num_q_heads // COMPUTE_WGS, num_tile_slots + num_pad_slots),
        grid_names=("heads", "work"), num_threads=COMPUTE_WGS + 1, thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True), interpret=interpret_params,
    )(cu_seqlens, kv_tiles, work_req, work_tile, q, k, v)
    if not return_lse:
        return out, None
    token_req = metadata.token_requests(cu_seqlens, num_tokens)  # -1: padding row
    valid, req = token_req >= 0, jnp.maximum(token_req, 0)
    # LSE rows are in the kernel's tile coordinates: tile row = request-local position + cu_seqlens[b] % 8
    local = jnp.arange(num_tokens, dtype=jnp.int32) - cu_seqlens[req] + cu_seqlens[req] % ROW_ALIGN
    item = work_slot[jnp.minimum(cu_q_tiles[req] + local // BLOCK_Q, num_tile_slots - 1)]
    lse = lse_tiles[item, :, local % BLOCK_Q]  # [T, Hq]
    return out, jnp.where(valid[:, None], lse, -jnp.inf)
