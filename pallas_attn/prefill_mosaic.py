"""Packed varlen prefill on the Mosaic GPU backend (Hopper: wgmma, TMA, warp specialisation).

``varlen_attention(..., backend="mosaic")`` runs this kernel: the same contract as the Triton-backend one and the
seed's structure, written for the backend that reaches Hopper's own instructions from Pallas:

* grid ``(q_tiles, Hq / 2, batch)``; program ``(m, p, b)`` owns 64 query tokens of request ``b`` (tiles visited
  longest-first) and the query heads ``2p, 2p + 1`` — two heads of one KV group, so each K/V tile that lands in
  shared memory serves both (GQA sharing; the group size must be even).
* three warpgroups: two compute warpgroups (one query head each: ``S = Q Kᵀ`` and ``O += P V`` with wgmma, the
  online softmax in registers, exp2 with the scale folded) and one memory warpgroup that streams K/V tiles through
  a ring of shared-memory slots with TMA, guarded by "loaded" and "consumed" barriers.
* ``cu_seqlens`` is read inside the kernel; a tile past its request exits at once. Full tiles (■, every key before
  the tile's first query) run with no mask code, diagonal tiles (△) are masked from request-local positions,
  future tiles (·) are never loaded. Non-causal: only the last tile masks keys past the request.
* Tile-aligned staging: Mosaic GPU's TMA into tiled (8 × 64, 128-byte swizzled) shared memory needs row offsets it
  can prove are tile multiples, which packed request starts are not. The wrapper gathers q/k/v into a layout where
  request ``b`` starts at row ``64 · cu_tiles[b]`` with zero rows up to the next tile boundary, and gathers the
  output back. So whole-tile loads past a request's end read zeros or the next request's rows (masked), never a
  padding NaN, and whole-tile stores land in the request's own padding. The price is one gather pass over q/k/v/out
  (P1: about 0.4 ms of 2.52, estimated from the output gather's measured 0.18).
* LSE (natural log) goes to a per-tile buffer ``[batch, Hq, q_tiles · 64]`` (a 64-wide TMA store each) and is
  gathered to ``[T, Hq]`` outside the kernel, only when asked.

Measured on the H200 (2026-11-30, ``scripts/probe_prefill_mosaic.py``, bf16, Hq 32, Hkv 8, D 128, same run): P1
385.5 TFLOP/s against the Triton kernel's 399.2, P2 531.9 against 469.3 (+13%); outputs within 4e-5 (P1) and 2e-4
(P2) relative L2 of the Triton kernel's. The default backend stays Triton until the selection rule is measured on
more than these two workloads (see ``benchmarks/NOTES.md``).

Interpret mode (CPU): the Mosaic GPU interpreter simulates the warpgroups, barriers, TMA and wgmma. Its limits
(jax 0.11.2): wgmma's A operand must be in shared memory (P goes through a scratch buffer there), pl.run_state
with a pre-initialised accumulator does not run (each P·V is a fresh accumulator), and a barrier completion that
no thread waits for breaks the next grid point (the releases are guarded by "refill"). The tile bounds, the
online-softmax step, the two tile loops and the finalisation are the shared ones of :mod:`pallas_attn.masks` and
:mod:`pallas_attn.softmax`.
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
def _kernel(cu_ref, tiles_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, scoped, *, group: int, num_q_tiles: int,
            block_kv: int, mcs: int, causal: bool, scale2: float):
    (q_smem, o_smem, k_smem, v_smem, lse_smem, p_smem), (q_bar, k_bar, v_bar), (k_free, v_free) = scoped
    m = num_q_tiles - 1 - lax.axis_index("q_seq")  # longest-first
    pair = lax.axis_index("heads")
    b = lax.axis_index("batch")
    wg = lax.axis_index("wg")
    dtype = q_ref.dtype
    head_dim = q_ref.shape[-1]
    kv_head = lax.div(pair * COMPUTE_WGS, jnp.int32(group))
    seq_len = cu_ref[b + 1] - cu_ref[b]
    row0 = tiles_ref[b] * BLOCK_Q  # the request's first staged row: a multiple of the tile, as TMA's tiling needs
    q0 = m * BLOCK_Q  # request-local first query of the tile
    live = q0 < seq_len
    q_end = jnp.minimum(q0 + BLOCK_Q, seq_len)
    full_steps, kv_steps = masks.kv_tile_ranges(q0, q_end - 1, seq_len, block_kv, causal=causal)

    @pl.when(live & (wg < COMPUTE_WGS))
    def _compute():
        plgpu.set_max_registers(232, action="increase")
        q_head = pair * COMPUTE_WGS + wg
        plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(row0 + q0, BLOCK_Q), q_head], q_smem.at[wg], q_bar.at[wg])
        plgpu.barrier_wait(q_bar.at[wg])
        m_i = plgpu.layout_cast(jnp.full((BLOCK_Q,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        l_i = plgpu.layout_cast(jnp.full((BLOCK_Q,), 0.0, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        acc = plgpu.layout_cast(jnp.full((BLOCK_Q, head_dim), 0.0, jnp.float32), plgpu.Layout.WGMMA)

        def pv_dot(p16, v_slot):
            """``P @ V`` for softmax.online_softmax_step: a fresh accumulator, not wgmma into a pre-initialised one
            (pl.run_state), which the Mosaic GPU interpreter cannot run; one code path on CPU and GPU."""
            if p_smem is not None:  # interpret mode: the interpreter takes wgmma's A operand from shared memory only
                p_smem.at[wg][...] = p16
                plgpu.commit_smem()
                p16 = p_smem.at[wg]

            def pv(acc_ref):
                plgpu.wgmma(acc_ref, p16, v_slot)
                return acc_ref[...]

            return pl.run_scoped(pv, plgpu.ACC((BLOCK_Q, head_dim), jnp.float32))

        def step(j, state, masked: bool):
            slot = lax.rem(j, jnp.int32(mcs))
            plgpu.barrier_wait(k_bar.at[slot])

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, q_smem.at[wg], k_smem.at[slot].transpose((1, 0)))
                return acc_ref[...]

            s2 = pl.run_scoped(qk, plgpu.ACC((BLOCK_Q, block_kv), jnp.float32)) * scale2
            # Release the slot only when the memory warpgroup will refill it (it waits for exactly those steps): a
            # completion nobody waits for would leave the barrier a phase ahead.
            refill = j + mcs < kv_steps
            pl.when(refill)(lambda: plgpu.barrier_arrive(k_free.at[slot]))
            if masked:  # request-local positions, in the wgmma register layout
                rows = plgpu.broadcasted_iota(jnp.int32, (BLOCK_Q, block_kv), 0, layout=plgpu.Layout.WGMMA) + q0
                cols = plgpu.broadcasted_iota(jnp.int32, (BLOCK_Q, block_kv), 1,
                                              layout=plgpu.Layout.WGMMA) + j * block_kv
                s2 = jnp.where((cols <= rows) if causal else (cols < seq_len), s2, -jnp.inf)
            plgpu.barrier_wait(v_bar.at[slot])
            state = softmax.online_softmax_step(state, s2, v_smem.at[slot], pv_dot)
            pl.when(refill)(lambda: plgpu.barrier_arrive(v_free.at[slot]))
            return state

        state = softmax.kv_loop((acc, m_i, l_i), 0, full_steps, kv_steps, step)
        out, lse = softmax.finalize(state)
        o_smem.at[wg][...] = out.astype(dtype)
        if lse_ref is not None:
            lse_smem.at[wg][...] = lse
        plgpu.commit_smem()
        # A whole tile: rows past the request's end are its own staging padding, never a neighbour's rows.
        plgpu.copy_smem_to_gmem(o_smem.at[wg], o_ref.at[pl.ds(row0 + q0, BLOCK_Q), q_head])
        if lse_ref is not None:
            plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[b, q_head, pl.ds(q0, BLOCK_Q)])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(live & (wg == COMPUTE_WGS))
    def _memory():
        plgpu.set_max_registers(40, action="decrease")

        def load(step, slot):
            rows = (pl.ds(row0 + step * block_kv, block_kv), kv_head)
            plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[slot], k_bar.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[slot], v_bar.at[slot])

        for i in range(mcs):
            pl.when(i < kv_steps)(functools.partial(load, i, i))

        @pl.loop(0, jnp.maximum(kv_steps - mcs, 0))
        def _refill(step):
            slot = lax.rem(step, jnp.int32(mcs))
            plgpu.barrier_wait(k_free.at[slot])  # both compute warpgroups are done with the slot's K ...
            plgpu.barrier_wait(v_free.at[slot])  # ... and V
            load(step + mcs, slot)


# -------------------------------------------------------------------------------------------- pallas_call
def varlen_attention_mosaic(q, k, v, cu_seqlens, *, max_seqlen: int, causal: bool, scale: float, return_lse: bool,
                            interpret: bool, max_concurrent_steps: int = 2):
    """``out [T, Hq, D]`` (and ``lse f32[T, Hq]``); arguments validated by :func:`pallas_attn.varlen_attention`."""
    reason = supported(q, k)
    if reason is not None:
        raise ValueError(f"the Mosaic prefill does not support {reason}")
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    num_seqs = cu_seqlens.shape[0] - 1
    num_q_tiles = pl.cdiv(max(max_seqlen, 1), BLOCK_Q)
    block_kv = BLOCK_KV
    # Tile-aligned staging: Mosaic GPU's TMA into tiled shared memory needs row offsets it can prove are multiples
    # of the tile, which packed request starts are not. Request b's rows move to row BLOCK_Q * cu_tiles[b]; the rows
    # after it up to the next tile boundary are zeros, so whole-tile loads past a request's end read zeros or the
    # next request's finite rows (masked), never padding NaNs, and whole-tile stores land in its own padding.
    token = jnp.arange(num_tokens, dtype=jnp.int32)
    token_req = metadata.token_requests(cu_seqlens, num_tokens)  # -1: padding row
    valid, req = token_req >= 0, jnp.maximum(token_req, 0)
    q_lens = cu_seqlens[1:] - cu_seqlens[:-1]
    cu_tiles = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum((q_lens + BLOCK_Q - 1) // BLOCK_Q)])
    # + one tile: windows past the end; whole tiles, since TMA needs the row count a multiple of its 8-row tiling
    staged_rows = pl.cdiv(num_tokens + BLOCK_Q * num_seqs, BLOCK_Q) * BLOCK_Q + max(BLOCK_Q, block_kv)
    staged = jnp.where(valid, BLOCK_Q * cu_tiles[req] + token - cu_seqlens[req], staged_rows)
    # Staging as a gather (each staged row finds its token): XLA's scatter of 8 KB rows ran at ~250 GB/s.
    row = jnp.arange(staged_rows, dtype=jnp.int32)
    row_req = metadata.token_requests(BLOCK_Q * cu_tiles, staged_rows)  # the request whose tiles hold the row
    row_req_safe = jnp.maximum(row_req, 0)
    src = cu_seqlens[row_req_safe] + row - BLOCK_Q * cu_tiles[row_req_safe]
    live_row = (row_req >= 0) & (src < cu_seqlens[row_req_safe + 1])
    src = jnp.where(live_row, src, 0)
    stage = lambda x: jnp.where(live_row[:, None, None], x[src], jnp.zeros((), x.dtype))  # noqa: E731
    q, k, v = stage(q), stage(k), stage(v)

    tiled = dict(transforms=(plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)))
    scratch = (
        (plgpu.SMEM((COMPUTE_WGS, BLOCK_Q, head_dim), q.dtype, **tiled),  # Q, one per compute warpgroup
         plgpu.SMEM((COMPUTE_WGS, BLOCK_Q, head_dim), q.dtype),  # O: untiled, filled from registers
         plgpu.SMEM((max_concurrent_steps, block_kv, head_dim), k.dtype, **tiled),
         plgpu.SMEM((max_concurrent_steps, block_kv, head_dim), v.dtype, **tiled),
         plgpu.SMEM((COMPUTE_WGS, BLOCK_Q), jnp.float32) if return_lse else None,
         plgpu.SMEM((COMPUTE_WGS, BLOCK_Q, block_kv), q.dtype, **tiled) if interpret else None),  # P, see _kernel
        (plgpu.Barrier(num_barriers=COMPUTE_WGS), plgpu.Barrier(num_barriers=max_concurrent_steps),
         plgpu.Barrier(num_barriers=max_concurrent_steps)),
        (plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=max_concurrent_steps),) * 2,
    )
    body = functools.partial(
        _kernel, group=num_q_heads // num_kv_heads, num_q_tiles=num_q_tiles, block_kv=block_kv,
        mcs=max_concurrent_steps, causal=causal, scale2=scale * softmax.LOG2E)

    def entry(cu_ref, tiles_ref, q_ref, k_ref, v_ref, o_ref, lse_ref):
        pl.run_scoped(lambda *s: body(cu_ref, tiles_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, s), *scratch,
                      collective_axes="wg")

    out_type = [jax.ShapeDtypeStruct((staged_rows, num_q_heads, head_dim), q.dtype),
                jax.ShapeDtypeStruct((num_seqs, num_q_heads, num_q_tiles * BLOCK_Q), jnp.float32)
                if return_lse else None]
    interpret_params = None
    if interpret:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
        interpret_params = InterpretGPUParams()
    out, lse_tiles = plgpu.kernel(
        entry, out_type=out_type, grid=(num_q_tiles, num_q_heads // COMPUTE_WGS, num_seqs),
        grid_names=("q_seq", "heads", "batch"), num_threads=COMPUTE_WGS + 1, thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True), interpret=interpret_params,
    )(cu_seqlens, cu_tiles, q, k, v)
    out = jnp.where(valid[:, None, None], out[jnp.minimum(staged, staged_rows - 1)], jnp.zeros((), out.dtype))
    if not return_lse:
        return out, None
    local = token - cu_seqlens[req]
    lse = lse_tiles[req, :, jnp.clip(local, 0, num_q_tiles * BLOCK_Q - 1)]  # [T, Hq]
    return out, jnp.where(valid[:, None], lse, -jnp.inf)
