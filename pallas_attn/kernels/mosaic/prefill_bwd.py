"""The backward pass of packed varlen attention on the Mosaic GPU backend (Hopper: wgmma, TMA, warp specialisation).

The formulas and the two-kernel split are the Triton backward's (:mod:`pallas_attn.kernels.triton.prefill_bwd`:
``P = exp(s - L)`` recomputed, ``dS = P ∘ (dP - D)``, no atomics, so gradients are bit-identical run to run),
written FlashAttention-3 style for the backend JAX keeps:

* the operands are re-packed first (one XLA gather) so that every request starts on a span of ``COMPUTE_WGS``
  64-row tiles and the rows past its end are zeros: every TMA then reads whole, aligned tiles of one request, and a
  zero row (its query gradient, probability and contribution all 0) stands wherever another request's rows, or
  padding, would otherwise meet a ``0 · NaN``. The cost: ``T + 127 · num_seqs`` rows instead of ``T``, and the
  gathers' traffic.
* **dK / dV**: grid ``(Hkv, key spans)``. Each compute warpgroup of a program holds one 64-key tile of K and V in
  shared memory (the span's ``COMPUTE_WGS`` consecutive tiles) and all of them walk every query head of the group
  over the query tiles that see the span (causal: from its first tile on; a window bounds both ends), each
  streamed tile read once for the span. Keys are the M dimension of all four wgmmas: ``Sᵀ = K Qᵀ`` and ``dPᵀ = V
  dOᵀ`` with the streamed tiles transposed as B, then ``dV += Pᵀ dO`` and ``dK += dSᵀ Q`` with ``Pᵀ`` / ``dSᵀ`` from
  registers. GQA's sum over the group happens in the float32 accumulators.
* **dQ**: grid ``(Hq, query spans)``. Each compute warpgroup holds one head's 64-row tile of Q and dO, and all of
  them walk the key tiles the span sees: ``S = Q Kᵀ``, ``dP = dO Vᵀ``, ``dQ += dS K``.
* each kernel has a memory warpgroup streaming the walked tiles by TMA through a ring of shared-memory slots
  (the query side's ``l2`` and ``D`` vectors with them), and ``COMPUTE_WGS`` compute warpgroups, each its own
  chain of wgmmas and exponentials, so that one's softmax runs beside the other's matmuls. A streamed tile that
  none of a warpgroup's rows sees (past the diagonal of a causal walk; every tile, for a warpgroup whose tile is
  past the request) is waited for and released without computing it.
* masks only where a tile needs one: the diagonal tile of a causal walk, the request's last key tile (dQ), every
  tile under a window; the other tiles run a loop without mask code. Rows past a request need none (zero rows
  with ``L = +inf``; see the kernels).
* every feature of the forward: causal or not, a window (the walk is bounded by it), soft-cap (``s'`` = scale ·
  (1 - tanh²)), ALiBi (a constant in the score: no term in ``s'``); the sinks' and a returned LSE's gradients are
  folded into ``L`` and ``D`` by the caller (:mod:`pallas_attn.ops.varlen`).

Head dims 64 and 128 (:func:`supported`: the two float32 accumulators of a dK / dV warpgroup take 128 registers a
thread at 128; 256 would not fit beside the scores), bf16 / fp16.

Interpret mode (CPU): the Mosaic GPU interpreter runs both kernels with the forward's two limits
(:mod:`pallas_attn.kernels.mosaic.prefill`): wgmma's A operand comes from shared memory (Pᵀ, dSᵀ, dS go through a
scratch tile) and each product is a fresh accumulator added to the running one.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_attn.core import masks, metadata, softmax
from pallas_attn.kernels.mosaic import prefill

BLOCK = 64  # rows of every tile: queries, keys, the wgmma M
HEAD_DIMS = (64, 128)
SLOTS = 3  # streamed tiles in flight (P2-bwd: 3 ran faster than 2: docs/performance.md#varlen-backward)
COMPUTE_WGS = 2  # tiles per program, one per compute warpgroup
SWIZZLE = 128
TILE_COLS = 64


def supported(q) -> str | None:
    """None when the Mosaic backward applies to these inputs, else the reason it does not."""
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        return f"dtype {q.dtype} (bf16 / fp16 only)"
    if q.shape[-1] not in HEAD_DIMS:
        return f"head_dim={q.shape[-1]} (supported: {', '.join(map(str, HEAD_DIMS))})"
    return None


# ---------------------------------------------------------------------------------------------- shared parts
def _scores(raw, q_pos, k_pos, *, scale: float, mods: masks.ScoreMods, slope2):
    """``(s2, ds)`` of a ``raw = q·k`` tile: base-2 scores and the derivative of the natural-log score by ``raw``.
    ``q_pos`` / ``k_pos`` (arrays of raw's shape, any orientation) are read by ALiBi only."""
    s2, ds = mods.base2_with_derivative(raw, scale)
    if mods.alibi:
        s2 = s2 + slope2 * (k_pos - q_pos).astype(jnp.float32)
    return s2, ds


def _visible(q_pos, k_pos, seq_len, *, causal: bool, mods: masks.ScoreMods):
    """The forward's mask on a tile whose element positions are ``q_pos`` / ``k_pos``."""
    visible = (k_pos < seq_len) & (q_pos < seq_len)
    if causal:
        visible &= k_pos <= q_pos
    window = mods.window(q_pos, k_pos)
    return visible if window is None else visible & window


def _walk(lo, full_lo, full_hi, hi, step, carry):
    """``step(t, carry, masked)`` over tiles ``[lo, hi)``: ``[full_lo, full_hi)`` unmasked, the rest masked (three
    loops, so the unmasked one carries no mask code: no positions, compares or selects)."""
    full_lo = jnp.clip(full_lo, lo, hi)
    full_hi = jnp.clip(full_hi, full_lo, hi)
    carry = lax.fori_loop(lo, full_lo, lambda t, c: step(t, c, True), carry)
    carry = lax.fori_loop(full_lo, full_hi, lambda t, c: step(t, c, False), carry)
    return lax.fori_loop(full_hi, hi, lambda t, c: step(t, c, True), carry)


def _release(i, slot, steps, free):
    """Step ``i``'s ``slot`` back to the memory warpgroup, if it refills it."""
    pl.when(i + SLOTS < steps)(lambda: plgpu.barrier_arrive(free.at[slot]))


def _pass_over(lo, hi, step_of, bars, free, steps):
    """Tiles ``[lo, hi)`` a warpgroup does not compute (``step_of(t)``: their steps): each load observed and its slot
    released, so every refill gets its arrivals in phase order."""
    @pl.loop(lo, hi)
    def _(t):
        i = step_of(t)
        slot = lax.rem(i, jnp.int32(SLOTS))
        plgpu.barrier_wait(bars.at[slot])
        _release(i, slot, steps, free)


def _iota(shape, dim):
    return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)


def _dot(a, b, shape):
    """``a @ b`` (float32 ``shape``), both operands in shared memory."""
    def mma(acc_ref):
        plgpu.wgmma(acc_ref, a, b)
        return acc_ref[...]

    return pl.run_scoped(mma, plgpu.ACC(shape, jnp.float32))


def _accumulate(acc, a, b, scratch, compiled: bool):
    """``acc + a @ b`` with ``a`` a 16-bit register tile: wgmma into ``acc`` itself (compiled), or ``a`` staged in
    ``scratch`` and a fresh product added (the interpreter takes A from shared memory only and cannot run a
    pre-initialised accumulator)."""
    if compiled:
        def into(acc_ref):
            plgpu.wgmma(acc_ref, a, b)

        return pl.run_state(into)(plgpu.ACC.init(acc))
    scratch[...] = a
    plgpu.commit_smem()
    return acc + _dot(scratch, b, acc.shape)


def _stream(steps, load, free):
    """The memory warpgroup's loop of both kernels: ``load(i, slot)`` for step ``i`` of ``steps`` into ring slot
    ``i % SLOTS``, the first ``SLOTS`` at once, each later one once every compute warpgroup freed its slot."""
    for i in range(SLOTS):
        pl.when(i < steps)(functools.partial(load, jnp.int32(i), i))

    @pl.loop(0, jnp.maximum(steps - SLOTS, 0))
    def _refill(i):
        slot = lax.rem(i, jnp.int32(SLOTS))
        plgpu.barrier_wait(free.at[slot])
        load(i + SLOTS, slot)


# ---------------------------------------------------------------------------------------------- dK / dV kernel
def _span(tile_req_ref, tile_local_ref, req_tile_ref, seq_len_ref, wgs: int):
    """The program's span of ``wgs`` tiles of one request: ``(live, request, its first re-packed row, its length,
    the span's first tile within the request)``."""
    first_tile = lax.axis_index("tile") * wgs
    b = tile_req_ref[first_tile]
    live = b >= 0
    b = jnp.maximum(b, 0)
    return live, b, req_tile_ref[b] * BLOCK, seq_len_ref[b], tile_local_ref[first_tile]


def _set_registers(wgs: int, compute: bool):
    if wgs > 1:  # the launch gives every thread 65,536 / ((wgs + 1) · 128) registers: the forward's split of them
        compute_regs, memory_regs = prefill.REGISTERS[wgs]
        plgpu.set_max_registers(compute_regs if compute else memory_regs, action="increase" if compute else "decrease")


def _dkdv_kernel(tile_req_ref, tile_local_ref, req_tile_ref, seq_len_ref, q_ref, k_ref, v_ref, do_ref, l2_ref,
                 delta_ref, *refs, group: int, causal: bool, scale: float, mods: masks.ScoreMods, compiled: bool,
                 wgs: int):
    refs = list(refs)
    slopes_ref = refs.pop(0) if mods.alibi else None
    dk_ref, dv_ref, scoped = refs
    (k_smem, v_smem, q_smem, do_smem, l2_smem, delta_smem, a_smem), (kv_bar, bars), free = scoped
    kv_head, wg = lax.axis_index("heads"), lax.axis_index("wg")
    dtype = q_ref.dtype
    head_dim = q_ref.shape[-1]
    live, b, first_row, seq_len, n = _span(tile_req_ref, tile_local_ref, req_tile_ref, seq_len_ref, wgs)
    k0 = n * BLOCK  # the span's first key
    # The query tiles that may see a key of the span: causal from its first tile on, a right window (non-causal)
    # from its first key - right on, a left window up to its last key + left.
    m_lo = n if causal else jnp.int32(0)
    if mods.window_right >= 0 and not causal:
        m_lo = jnp.maximum(k0 - mods.window_right, 0) // BLOCK
    m_hi = (seq_len + BLOCK - 1) // BLOCK
    if mods.window_left >= 0:
        m_hi = jnp.minimum(m_hi, (k0 + wgs * BLOCK - 1 + mods.window_left) // BLOCK + 1)
    num_m = jnp.maximum(m_hi - m_lo, 0)
    steps = jnp.where(live & (k0 < seq_len), group * num_m, 0)

    def walked(i):  # step i: query head g of the group, query tile m
        g = lax.div(i, jnp.maximum(num_m, 1))
        return g, m_lo + lax.rem(i, jnp.maximum(num_m, 1))

    @pl.when(live & (wg < wgs))
    def _compute():
        _set_registers(wgs, compute=True)
        kc = k0 + wg * BLOCK  # this warpgroup's key tile
        k_tile, v_tile, a_tile = k_smem.at[wg], v_smem.at[wg], a_smem.at[wg] if a_smem is not None else None
        plgpu.barrier_wait(kv_bar.at[wg])
        zeros = plgpu.layout_cast(jnp.zeros((BLOCK, head_dim), jnp.float32), plgpu.Layout.WGMMA)
        col_layout = plgpu.Layout.WGMMA.reduce(0)

        def step(g, m, carry, masked: bool):
            dk, dv = carry
            i = g * num_m + m - m_lo
            slot = lax.rem(i, jnp.int32(SLOTS))
            plgpu.barrier_wait(bars.at[slot])
            shape = (BLOCK, BLOCK)  # [keys, queries]
            st = _dot(k_tile, q_smem.at[slot].transpose((1, 0)), shape)
            k_pos = q_pos = slope2 = None
            if masked or mods.alibi:
                k_pos = _iota(shape, 0) + kc
                q_pos = _iota(shape, 1) + m * BLOCK
            if mods.alibi:
                slope2 = slopes_ref[kv_head * group + g] * softmax.LOG2E
            s2, ds = _scores(st, q_pos, k_pos, scale=scale, mods=mods, slope2=slope2)
            l2 = lax.broadcast_in_dim(plgpu.load(l2_smem.at[slot], layout=col_layout), shape, [1])
            delta = lax.broadcast_in_dim(plgpu.load(delta_smem.at[slot], layout=col_layout), shape, [1])
            pt = jnp.exp2(s2 - l2)  # Pᵀ [keys, queries]
            if masked:
                pt = jnp.where(_visible(q_pos, k_pos, seq_len, causal=causal, mods=mods), pt, 0.0)
            dv = _accumulate(dv, pt.astype(dtype), do_smem.at[slot], a_tile, compiled)
            dpt = _dot(v_tile, do_smem.at[slot].transpose((1, 0)), shape)
            dst = pt * (dpt - delta) * ds
            dk = _accumulate(dk, dst.astype(dtype), q_smem.at[slot], a_tile, compiled)
            _release(i, slot, steps, free)
            return dk, dv

        # The walk's tiles by what they need. Unmasked: every query sees every key. A query row past the request
        # needs no mask: re-packed, it is a zero row with l2 = +inf (P = 0, so dS = 0), and its neighbours are the
        # request's rows or more zero rows; nor a key row past it, whose dK / dV row is never stored. Causal: the
        # tiles before the key tile's diagonal see none of its keys (a warpgroup's tile past the request: none at
        # all), the diagonal tile is masked, the rest are whole. A window masks every tile.
        own = kc < seq_len
        first_seen = jnp.clip(kc // BLOCK if causal else m_lo, m_lo, m_hi)
        first_seen = jnp.where(own, first_seen, m_hi)
        if mods.windowed:
            full_lo = full_hi = m_hi
        else:
            full_lo, full_hi = (kc // BLOCK + 1 if causal else m_lo), m_hi

        def head(g, carry):  # the tiles before first_seen: none of this warpgroup's keys is seen
            _pass_over(m_lo, first_seen, lambda m: g * num_m + m - m_lo, bars, free, steps)
            return _walk(first_seen, full_lo, full_hi, m_hi, functools.partial(step, g), carry)

        dk, dv = lax.fori_loop(0, jnp.where(steps > 0, group, 0), head, (zeros, zeros))
        k_tile[...] = dk.astype(dtype)  # K and V are read for the last time above
        v_tile[...] = dv.astype(dtype)
        plgpu.commit_smem()
        rows = pl.ds(first_row + kc, BLOCK)
        plgpu.copy_smem_to_gmem(k_tile, dk_ref.at[rows, kv_head])
        plgpu.copy_smem_to_gmem(v_tile, dv_ref.at[rows, kv_head])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(live & (wg == wgs))
    def _memory():
        _set_registers(wgs, compute=False)
        for c in range(wgs):
            rows = pl.ds(first_row + k0 + c * BLOCK, BLOCK)
            plgpu.copy_gmem_to_smem(k_ref.at[rows, kv_head], k_smem.at[c], kv_bar.at[c])
            plgpu.copy_gmem_to_smem(v_ref.at[rows, kv_head], v_smem.at[c], kv_bar.at[c])

        def load(i, slot):
            g, m = walked(i)
            head = kv_head * group + g
            q_rows = pl.ds(first_row + m * BLOCK, BLOCK)
            plgpu.copy_gmem_to_smem(q_ref.at[q_rows, head], q_smem.at[slot], bars.at[slot])
            plgpu.copy_gmem_to_smem(do_ref.at[q_rows, head], do_smem.at[slot], bars.at[slot])
            plgpu.copy_gmem_to_smem(l2_ref.at[head, q_rows], l2_smem.at[slot], bars.at[slot])
            plgpu.copy_gmem_to_smem(delta_ref.at[head, q_rows], delta_smem.at[slot], bars.at[slot])

        _stream(steps, load, free)


# ---------------------------------------------------------------------------------------------- dQ kernel
def _dq_kernel(tile_req_ref, tile_local_ref, req_tile_ref, seq_len_ref, q_ref, k_ref, v_ref, do_ref, l2_ref,
               delta_ref, *refs, group: int, causal: bool, scale: float, mods: masks.ScoreMods, compiled: bool,
               wgs: int):
    refs = list(refs)
    slopes_ref = refs.pop(0) if mods.alibi else None
    dq_ref, scoped = refs
    (q_smem, do_smem, l2_smem, delta_smem, k_smem, v_smem, a_smem), (q_bar, bars), free = scoped
    head, wg = lax.axis_index("heads"), lax.axis_index("wg")
    kv_head = lax.div(head, jnp.int32(group))
    dtype = q_ref.dtype
    head_dim = q_ref.shape[-1]
    live, b, first_row, seq_len, m = _span(tile_req_ref, tile_local_ref, req_tile_ref, seq_len_ref, wgs)
    q0 = m * BLOCK  # the span's first query
    # The key tiles the span's queries see: causal up to its last tile, a right window (non-causal) up to its last
    # query + right, a left window from its first query - left on.
    n_hi = (seq_len + BLOCK - 1) // BLOCK
    if causal:
        n_hi = jnp.minimum(n_hi, m + wgs)
    elif mods.window_right >= 0:
        n_hi = jnp.minimum(n_hi, (q0 + wgs * BLOCK - 1 + mods.window_right) // BLOCK + 1)
    n_lo = jnp.int32(0)
    if mods.window_left >= 0:
        n_lo = jnp.maximum(q0 - mods.window_left, 0) // BLOCK
    steps = jnp.where(live & (q0 < seq_len), jnp.maximum(n_hi - n_lo, 0), 0)

    @pl.when(live & (wg < wgs))
    def _compute():
        _set_registers(wgs, compute=True)
        qc = q0 + wg * BLOCK  # this warpgroup's query tile
        q_tile, do_tile, a_tile = q_smem.at[wg], do_smem.at[wg], a_smem.at[wg] if a_smem is not None else None
        q_rows = pl.ds(first_row + qc, BLOCK)
        bar = q_bar.at[wg]
        plgpu.copy_gmem_to_smem(q_ref.at[q_rows, head], q_tile, bar)
        plgpu.copy_gmem_to_smem(do_ref.at[q_rows, head], do_tile, bar)
        plgpu.copy_gmem_to_smem(l2_ref.at[head, q_rows], l2_smem.at[wg], bar)
        plgpu.copy_gmem_to_smem(delta_ref.at[head, q_rows], delta_smem.at[wg], bar)
        plgpu.barrier_wait(bar)
        row_layout = plgpu.Layout.WGMMA.reduce(1)
        shape = (BLOCK, BLOCK)  # [queries, keys]
        l2 = lax.broadcast_in_dim(plgpu.load(l2_smem.at[wg], layout=row_layout), shape, [0])
        delta = lax.broadcast_in_dim(plgpu.load(delta_smem.at[wg], layout=row_layout), shape, [0])
        slope2 = slopes_ref[head] * softmax.LOG2E if mods.alibi else None

        def step(n, dq, masked: bool):
            j = n - n_lo
            slot = lax.rem(j, jnp.int32(SLOTS))
            plgpu.barrier_wait(bars.at[slot])
            s = _dot(q_tile, k_smem.at[slot].transpose((1, 0)), shape)
            q_pos = k_pos = None
            if masked or mods.alibi:
                q_pos = _iota(shape, 0) + qc
                k_pos = _iota(shape, 1) + n * BLOCK
            s2, ds = _scores(s, q_pos, k_pos, scale=scale, mods=mods, slope2=slope2)
            p = jnp.exp2(s2 - l2)
            if masked:
                p = jnp.where(_visible(q_pos, k_pos, seq_len, causal=causal, mods=mods), p, 0.0)
            dp = _dot(do_tile, v_smem.at[slot].transpose((1, 0)), shape)
            dsc = p * (dp - delta) * ds
            dq = _accumulate(dq, dsc.astype(dtype), k_smem.at[slot], a_tile, compiled)
            _release(j, slot, steps, free)
            return dq

        # The walk's key tiles by what they need. Unmasked: every query of the tile sees every key, and every key
        # is the request's (a key row past it is a zero row, but its P need not be 0: masked, so that an overflowed
        # P meets no 0 · inf). Query rows past the request need no mask (zero rows, l2 = +inf: P = 0). Causal: the
        # tiles before the diagonal are whole, the diagonal is masked, the tiles after it see nothing from this
        # warpgroup's queries (a warpgroup's tile past the request: nothing at all). A window masks every tile.
        n_end = n_lo + steps
        last_seen = jnp.clip(qc // BLOCK + 1 if causal else n_end, n_lo, n_end)
        last_seen = jnp.where(qc < seq_len, last_seen, n_lo)
        if mods.windowed:
            full_lo = full_hi = n_lo
        else:
            full_lo, full_hi = n_lo, jnp.minimum(qc // BLOCK if causal else n_end, seq_len // BLOCK)
        zeros = plgpu.layout_cast(jnp.zeros((BLOCK, head_dim), jnp.float32), plgpu.Layout.WGMMA)
        dq = _walk(n_lo, full_lo, full_hi, last_seen, step, zeros)
        _pass_over(last_seen, n_end, lambda n: n - n_lo, bars, free, steps)  # tiles past the diagonal
        q_tile[...] = dq.astype(q_tile.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_tile, dq_ref.at[q_rows, head])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(live & (wg == wgs))
    def _memory():
        _set_registers(wgs, compute=False)

        def load(j, slot):
            rows = pl.ds(first_row + (n_lo + j) * BLOCK, BLOCK)
            plgpu.copy_gmem_to_smem(k_ref.at[rows, kv_head], k_smem.at[slot], bars.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[rows, kv_head], v_smem.at[slot], bars.at[slot])

        _stream(steps, load, free)


# -------------------------------------------------------------------------------------------- the calls
def _repack(cu_seqlens, num_tokens: int, max_seqlen: int, span: int = COMPUTE_WGS):
    """Where each request's rows go so that it starts on a span of ``span`` 64-row tiles and fills whole spans:
    ``(src i32[T'], tile_req i32[T' / 64], tile_local i32[T' / 64], req_tile i32[S], seq_len i32[S], dst i32[T])``
    with ``T' = T + (64 · span - 1) · S`` rounded up to a span. ``src[r]``: the packed row re-packed row ``r`` holds
    (-1: a zero row); ``dst[t]``: the re-packed row of packed row ``t`` (-1: a row no request computes: padding, or
    past ``max_seqlen``)."""
    num_seqs = cu_seqlens.shape[0] - 1
    span_rows = BLOCK * span
    total = -(-(num_tokens + (span_rows - 1) * num_seqs) // span_rows) * span_rows
    cu = metadata.clamp_cu(cu_seqlens, num_tokens)
    seq_len = jnp.minimum(cu[1:] - cu[:-1], max_seqlen)  # a longer request is truncated, as the forward reads it
    req_tiles = (seq_len + span_rows - 1) // span_rows * span
    tile_req, tile_local, cu_tiles = metadata.segment_items(req_tiles, total // BLOCK)
    rows = jnp.arange(total, dtype=jnp.int32)
    row_req = tile_req[rows // BLOCK]
    local = rows - cu_tiles[jnp.maximum(row_req, 0)] * BLOCK
    src = jnp.where((row_req >= 0) & (local < seq_len[jnp.maximum(row_req, 0)]),
                    cu[jnp.maximum(row_req, 0)] + local, -1)
    req = metadata.token_requests(cu, num_tokens)
    t_local = jnp.arange(num_tokens, dtype=jnp.int32) - cu[jnp.maximum(req, 0)]
    owned = (req >= 0) & (t_local < max_seqlen)
    dst = jnp.where(owned, cu_tiles[jnp.maximum(req, 0)] * BLOCK + t_local, -1)
    return src, tile_req, tile_local, cu_tiles[:-1], seq_len, dst


def _gather_rows(x, src, fill=0.0):
    """``x`` re-packed along its row axis 0: ``x[src]``, ``fill`` where ``src < 0``."""
    picked = x[jnp.maximum(src, 0)]
    return jnp.where((src >= 0).reshape(-1, *[1] * (x.ndim - 1)), picked, jnp.asarray(fill, x.dtype))


def varlen_attention_bwd_mosaic(q, k, v, cu_seqlens, do, l2, delta, alibi_slopes=None, *, max_seqlen: int,
                                causal: bool, scale: float, interpret: bool, mods: masks.ScoreMods = masks.NO_MODS,
                                wgs: int = COMPUTE_WGS):
    """``(dq [T, Hq, D], dk [T, Hkv, D], dv [T, Hkv, D])`` in float32 for the rows the kernels own; the contract of
    :func:`pallas_attn.kernels.triton.prefill_bwd.varlen_attention_bwd_triton` (other rows are zeros here).
    ``wgs``: compute warpgroups (tiles) a program, 1 or 2."""
    reason = supported(q)
    if reason is not None:
        raise ValueError(f"the Mosaic varlen backward does not support {reason}")
    if wgs not in (1, 2):
        raise ValueError(f"wgs={wgs} must be 1 or 2 (compute warpgroups of the Mosaic backward)")
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_q_heads // num_kv_heads
    src, tile_req, tile_local, req_tile, seq_len, dst = _repack(cu_seqlens, num_tokens, max_seqlen, wgs)
    num_spans = tile_req.shape[0] // wgs
    qp, kp, vp, dop = (_gather_rows(x, src) for x in (q, k, v, do))
    l2p = _gather_rows(l2, src, jnp.inf).T  # [Hq, T']: a query tile's 64 values are one contiguous TMA
    deltap = _gather_rows(delta, src).T
    features = [alibi_slopes.astype(jnp.float32)] if alibi_slopes is not None else []
    args = (tile_req, tile_local, req_tile, seq_len, qp, kp, vp, dop, l2p, deltap, *features)
    tiled = dict(transforms=(plgpu.TilingTransform((8, TILE_COLS)), plgpu.SwizzleTransform(SWIZZLE)))
    tiles = plgpu.SMEM((wgs, BLOCK, head_dim), q.dtype, **tiled)  # one per compute warpgroup
    ring = plgpu.SMEM((SLOTS, BLOCK, head_dim), q.dtype, **tiled)
    a_tiles = plgpu.SMEM((wgs, BLOCK, BLOCK), q.dtype, **tiled) if interpret else None  # the interpreter's A operands
    common = dict(group=group, causal=causal, scale=scale, mods=mods, compiled=not interpret, wgs=wgs)
    interpret_params = None
    if interpret:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
        interpret_params = InterpretGPUParams()
    kernel = functools.partial(plgpu.kernel, num_threads=wgs + 1, thread_name="wg", interpret=interpret_params,
                               compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0))

    dkdv_scratch = ((tiles, tiles, ring, ring, plgpu.SMEM((SLOTS, BLOCK), jnp.float32),
                     plgpu.SMEM((SLOTS, BLOCK), jnp.float32), a_tiles),
                    (plgpu.Barrier(num_arrivals=2, num_barriers=wgs),
                     plgpu.Barrier(num_arrivals=4, num_barriers=SLOTS)),
                    plgpu.Barrier(num_arrivals=wgs, num_barriers=SLOTS))
    dkdv_body = functools.partial(_dkdv_kernel, **common)

    def dkdv_kernel(*refs):
        pl.run_scoped(lambda *s: dkdv_body(*refs, s), *dkdv_scratch, collective_axes="wg")

    kv_rows = jax.ShapeDtypeStruct(kp.shape, q.dtype)
    dk, dv = kernel(dkdv_kernel, out_type=[kv_rows, kv_rows], grid=(num_kv_heads, num_spans),
                    grid_names=("heads", "tile"))(*args)

    dq_scratch = ((tiles, tiles, plgpu.SMEM((wgs, BLOCK), jnp.float32), plgpu.SMEM((wgs, BLOCK), jnp.float32), ring,
                   ring, a_tiles),
                  (plgpu.Barrier(num_arrivals=4, num_barriers=wgs), plgpu.Barrier(num_arrivals=2, num_barriers=SLOTS)),
                  plgpu.Barrier(num_arrivals=wgs, num_barriers=SLOTS))
    dq_body = functools.partial(_dq_kernel, **common)

    def dq_kernel(*refs):
        pl.run_scoped(lambda *s: dq_body(*refs, s), *dq_scratch, collective_axes="wg")

    dq = kernel(dq_kernel, out_type=jax.ShapeDtypeStruct(qp.shape, q.dtype), grid=(num_q_heads, num_spans),
                grid_names=("heads", "tile"))(*args)
    back = lambda x: _gather_rows(x, dst).astype(jnp.float32)  # noqa: E731  re-packed rows → packed rows
    return back(dq), back(dk), back(dv)
