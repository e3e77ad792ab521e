"""Tile classes and in-register masks shared by every kernel (docs/design.md#tile-classes).

A query tile whose rows sit at absolute positions ``[q_first, q_last]`` of a request with ``kv_len`` keys meets the
key tiles ``[j * block_n, (j + 1) * block_n)`` in three ways (causal)::

    key tiles →   0   1   2   3
    q tile 0      △   ·   ·   ·      ■ full: every key <= q_first, nothing to mask
    q tile 1      ■   △   ·   ·      △ diagonal: some keys > some rows, element-wise mask
    q tile 2      ■   ■   △   ·      · future: every key > q_last, never loaded
    q tile 3      ■   ■   ■   △

Multi-token verification and chunked prefill are the same picture shifted right by ``context_len``: a query at
local row ``i`` sits at ``context_len + i`` (a full rectangle, then a bottom-right triangle). Non-causal attention
has no diagonal: every tile but a ragged last one is full.

The kernels loop ``[kv_start, full_end)`` with no mask code at all and ``[full_end, kv_end)`` with the mask;
:func:`kv_tile_ranges` computes those bounds (traced scalars inside kernels, Python ints in notebooks).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from pallas_attn.core import softmax

FULL, DIAGONAL, FUTURE = "■", "△", "·"


def _cdiv(a, b):
    return (a + b - 1) // b


def kv_tile_ranges(q_first, q_last, kv_len, block_n: int, *, causal: bool = True, tile_start=0, tile_end=None):
    """Key-tile bounds ``(full_end, kv_end)`` for a query tile; tiles ``[tile_start, full_end)`` need no mask.

    Args:
      q_first: absolute position of the tile's first valid query row.
      q_last: absolute position of its last valid query row (``q_first - 1`` when the tile has none).
      kv_len: keys of the request (positions ``[0, kv_len)``).
      block_n: keys per tile.
      causal: mask ``key_pos <= query_pos``; otherwise only ``key_pos < kv_len``.
      tile_start, tile_end: the slice of key tiles this program owns (split-KV); default all of them.

    Returns:
      ``(full_end, kv_end)``, both clamped to ``[tile_start, tile_end]`` with ``full_end <= kv_end``: tiles
      ``[tile_start, full_end)`` are full (■), ``[full_end, kv_end)`` need the element-wise mask (△ or the ragged
      last tile), tiles from ``kv_end`` on are never visited (·).
    """
    visible = jnp.minimum(q_last + 1, kv_len) if causal else kv_len  # keys any row may see: [0, visible)
    unmasked = jnp.minimum(q_first + 1, kv_len) if causal else kv_len  # keys every row sees
    kv_end = _cdiv(visible, block_n)
    full_end = unmasked // block_n
    if tile_end is not None:
        kv_end = jnp.minimum(kv_end, tile_end)
    full_end = jnp.minimum(full_end, kv_end)
    full_end = jnp.maximum(full_end, tile_start)
    kv_end = jnp.maximum(kv_end, full_end)
    return full_end, kv_end


def causal_mask(q_pos, k_pos, kv_len):
    """``[M, N]`` bool: key visible to query (``k_pos <= q_pos`` and inside the request). Built in registers."""
    return (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] < kv_len)


@dataclasses.dataclass(frozen=True)
class ScoreMods:
    """The static model-family features of one call (docs/design.md#model-family-features): a window
    ``(left, right)`` (-1: unbounded), a soft-cap (0: off), and whether ALiBi slopes and attention sinks (arrays,
    one per query head) are given. Hashable: one compiled kernel per distinct layer kind."""
    window_left: int = -1
    window_right: int = -1
    softcap: float = 0.0
    alibi: bool = False
    sinks: bool = False

    @property
    def windowed(self) -> bool:
        return self.window_left >= 0 or self.window_right >= 0

    def scores(self, raw, scale: float, q_pos, k_pos, slope2=None):
        """``[M, N]`` base-2 scores from the raw ``q·k``: soft-cap on the scaled score, then ALiBi
        (``slope2 [M]``: the rows' slopes times log2 e) on absolute positions. No mask here."""
        if self.softcap > 0:
            s2 = jnp.tanh(raw * (scale / self.softcap)) * (self.softcap * softmax.LOG2E)
        else:
            s2 = raw * (scale * softmax.LOG2E)
        if self.alibi:
            s2 = s2 + slope2[:, None] * (k_pos[None, :] - q_pos[:, None]).astype(jnp.float32)
        return s2

    def window_mask(self, q_pos, k_pos):
        """``[M, N]`` bool, or None without a window: ``q - left <= k <= q + right``."""
        return self.window(q_pos[:, None], k_pos[None, :])

    def window(self, q_pos, k_pos):
        """:meth:`window_mask` on positions already laid out as the scores are (broadcastable arrays: the Mosaic GPU
        kernels' iotas in the wgmma register layout), or None without a window."""
        mask = None
        if self.window_left >= 0:
            mask = k_pos >= q_pos - self.window_left
        if self.window_right >= 0:
            right = k_pos <= q_pos + self.window_right
            mask = right if mask is None else mask & right
        return mask

    def base2_with_derivative(self, raw, scale: float):
        """``(s2, ds)`` for the backward passes: the base-2 scores of raw ``q·k`` before ALiBi (soft-capped as
        :meth:`scores` does) and ``ds``, the derivative of the natural-log score by the raw product (a scalar
        without a soft-cap). ALiBi adds a constant: no term in ``ds``."""
        if self.softcap > 0:
            t = jnp.tanh(raw * (scale / self.softcap))
            return t * (self.softcap * softmax.LOG2E), scale * (1.0 - t * t)
        return raw * (scale * softmax.LOG2E), scale


NO_MODS = ScoreMods()  # plain attention: every feature off


def window_tile_ranges(q_first, q_last, kv_len, block_n: int, window: tuple[int, int], *, causal: bool = True,
                       tile_start=0, tile_end=None):
    """:func:`kv_tile_ranges` under a window ``(left, right)``: ``(start, full_start, full_end, kv_end)``.

    Tiles ``[start, full_start)`` hold keys some rows see and others have left behind (masked), ``[full_start,
    full_end)`` keys every row sees (no mask), ``[full_end, kv_end)`` the diagonal, the window's right edge or the
    ragged end (masked). Tiles before ``start`` and from ``kv_end`` on are never loaded: the cost follows the
    window, not the context."""
    left, right = window
    visible = jnp.minimum(q_last + 1, kv_len) if causal else kv_len  # keys any row may see: below this
    unmasked = jnp.minimum(q_first + 1, kv_len) if causal else kv_len  # keys every row sees: below this...
    if right >= 0:
        visible = jnp.minimum(visible, q_last + right + 1)
        unmasked = jnp.minimum(unmasked, q_first + right + 1)
    first_key = jnp.maximum(q_first - left, 0) if left >= 0 else 0  # ...and from here
    every_key = jnp.maximum(q_last - left, 0) if left >= 0 else 0
    kv_end = _cdiv(visible, block_n)
    if tile_end is not None:
        kv_end = jnp.minimum(kv_end, tile_end)
    start = jnp.maximum(first_key // block_n, tile_start)
    kv_end = jnp.maximum(kv_end, start)
    full_start = jnp.clip(_cdiv(every_key, block_n), start, kv_end)
    full_end = jnp.clip(unmasked // block_n, full_start, kv_end)
    return start, full_start, full_end, kv_end


def length_mask(q_pos, k_pos, kv_len):
    """``[M, N]`` bool for non-causal tiles: only the request's own keys."""
    del q_pos
    return (k_pos < kv_len)[None, :]


def tile_map(q_len: int, kv_len: int, block_m: int, block_n: int, *, causal: bool = True) -> np.ndarray:
    """The ■/△/· map of one request, from the same bounds the kernels use (for notebooks and docs).

    Returns a ``[cdiv(q_len, block_m), cdiv(kv_len, block_n)]`` array of the symbols above. Queries are the last
    ``q_len`` of ``kv_len`` positions (prefill: ``q_len == kv_len``).
    """
    context = kv_len - q_len
    rows = []
    for m in range(_cdiv(q_len, block_m)):
        q_first = context + m * block_m
        q_last = context + min(q_len, (m + 1) * block_m) - 1
        full_end, kv_end = (int(x) for x in kv_tile_ranges(q_first, q_last, kv_len, block_n, causal=causal))
        rows.append([FULL if j < full_end else DIAGONAL if j < kv_end else FUTURE
                     for j in range(_cdiv(kv_len, block_n))])
    return np.array(rows, dtype=object).reshape(len(rows), _cdiv(kv_len, block_n))
