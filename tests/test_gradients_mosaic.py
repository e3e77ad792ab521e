"""varlen_attention(backward_backend="mosaic"): the Hopper backward kernels against autodiff of the dense reference.

On CPU the Mosaic GPU interpreter runs them (5-10 s a case). Inputs are bf16 / fp16 (the kernels' dtypes), the
reference float32 on the same rounded inputs: within 2e-2 relative L2. Padding rows hold NaN; each case has a hard
time limit (an interpreted deadlock fails instead of stalling the suite).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_attn import PrefillConfig, reference, varlen_attention
from pallas_attn.core import masks
from pallas_attn.testing import assert_attention_close, random_packed

BF16 = jnp.bfloat16
MOSAIC = dict(backward_backend="mosaic")
pytestmark = pytest.mark.timeout(300, method="thread")


def _inputs(rng, lens, hq, hkv, d, dtype, pad=3):
    t = sum(lens) + pad
    q, cu = random_packed(rng, lens, hq, d, jnp.float32, pad_to=t)  # padding rows NaN
    k, _ = random_packed(rng, lens, hkv, d, jnp.float32, pad_to=t)
    v, _ = random_packed(rng, lens, hkv, d, jnp.float32, pad_to=t)
    w_out = jnp.asarray(rng.standard_normal((t, hq, d)), jnp.float32)
    w_lse = jnp.asarray(rng.standard_normal((t, hq)), jnp.float32)
    return q.astype(dtype), k.astype(dtype), v.astype(dtype), cu, w_out, w_lse


def _loss(fn, cu, w_out, w_lse, max_seqlen, **kw):
    def loss(q, k, v, sinks=None):
        out, lse = fn(q, k, v, cu, max_seqlen=max_seqlen, sinks=sinks, return_lse=True, **kw)
        return jnp.sum(out.astype(jnp.float32) * w_out) + jnp.sum(jnp.where(jnp.isfinite(lse), lse * w_lse, 0.0))
    return loss


# name: (lengths, Hq, Hkv, head_dim, keyword arguments). Tiles are 64 rows and keys.
SCENARIOS = {
    "causal_tile_edges": ([0, 1, 63, 65, 129], 4, 1, 64, {}),
    "bidirectional_gqa4_d128": ([130, 64, 1], 8, 2, 128, dict(causal=False)),
    "window_left": ([150, 20], 4, 2, 64, dict(window_size=(40, 0))),
    "window_both_sides": ([100, 30], 2, 1, 64, dict(causal=False, window_size=(20, 33))),
    "softcap_alibi_sinks": ([90, 17], 4, 2, 64, dict(softcap=20.0, alibi=True, sinks=True)),
    "truncated_past_max_seqlen": ([100, 10], 2, 1, 64, dict(max_seqlen=70)),
    "mha_fp16": ([70, 5], 2, 2, 64, dict(dtype=jnp.float16)),
}


@pytest.mark.parametrize("name", SCENARIOS)
def test_matches_dense_reference(name, rng):
    lens, hq, hkv, d, kw = SCENARIOS[name]
    kw = dict(kw)
    dtype = kw.pop("dtype", BF16)
    max_seqlen = kw.pop("max_seqlen", max(lens))
    if kw.pop("alibi", False):
        kw["alibi_slopes"] = jnp.asarray(np.geomspace(0.5, 0.02, hq), jnp.float32)
    sinks = jnp.asarray(rng.standard_normal(hq), jnp.float32) if kw.pop("sinks", False) else None
    q, k, v, cu, w_out, w_lse = _inputs(rng, lens, hq, hkv, d, dtype)
    argnums = (0, 1, 2, 3) if sinks is not None else (0, 1, 2)
    ours = jax.grad(_loss(varlen_attention, cu, w_out, w_lse, max_seqlen, **kw, **MOSAIC), argnums=argnums)(
        q, k, v, sinks)
    ref = jax.grad(_loss(reference.varlen_attention_dense, cu, w_out, w_lse, max_seqlen, **kw), argnums=argnums)(
        *(x.astype(jnp.float32) for x in (q, k, v)), sinks)
    assert ours[0].dtype == dtype
    _assert_grads_close(ours, ref, sum(lens))


def _assert_grads_close(ours, ref, valid: int):
    """dq, dk, dv (and dsinks) against the dense reference's: finite, within bf16 tolerance on the ``valid`` rows,
    zero on the padding rows."""
    for name, a, b in zip(("dq", "dk", "dv", "dsinks"), ours, ref):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.isfinite(a).all(), f"{name} is not finite"
        if name == "dsinks":
            assert_attention_close(a[None, None], b[None, None], rtol=2e-2)
            continue
        assert_attention_close(a, b, rtol=2e-2, valid_rows=valid)
        assert not np.any(a[valid:]), f"{name}: a padding row has a gradient"


@pytest.mark.gpu
def test_head_dim_256_default_forward_compiled(rng):
    """Head dim 256, requests long enough for the Mosaic forward by default and the Triton backward (the Mosaic one
    runs 64 and 128): the residuals are the public output and LSE, whichever kernel made them."""
    from pallas_attn.ops import varlen as ops
    lens, hq, hkv, d = [1500, 700, 37], 4, 2, 256
    q, k, v, cu, w_out, w_lse = _inputs(rng, lens, hq, hkv, d, BF16)
    assert ops.default_backend(q, k, max(lens), False) == "mosaic"
    assert ops.backward_backend_for(q, None, None) == "triton"
    ours = jax.grad(_loss(varlen_attention, cu, w_out, w_lse, max(lens)), argnums=(0, 1, 2))(q, k, v)
    ref = jax.grad(_loss(reference.varlen_attention_dense, cu, w_out, w_lse, max(lens)), argnums=(0, 1, 2))(
        *(x.astype(jnp.float32) for x in (q, k, v)))
    _assert_grads_close(ours, ref, sum(lens))


def test_no_gradient_crosses_a_document_boundary(rng):
    """One document's loss: zero gradient on every other document's rows, and NaN in those rows leaves its own
    gradients bit-identical; the same gradients run to run."""
    lens = [70, 40, 9]
    q, k, v, cu, w_out, _ = _inputs(rng, lens, 4, 2, 64, BF16)
    doc = np.zeros(q.shape[0], bool)
    doc[70:110] = True
    w_doc = jnp.where(jnp.asarray(doc)[:, None, None], w_out, 0.0)
    grad = jax.jit(jax.grad(lambda q, k, v: jnp.sum(
        varlen_attention(q, k, v, cu, max_seqlen=70, **MOSAIC).astype(jnp.float32) * w_doc), argnums=(0, 1, 2)))
    clean = grad(q, k, v)
    for g in clean:
        g = np.asarray(g, np.float32)
        assert np.all(g[~doc] == 0) and np.isfinite(g).all() and np.any(g[doc])
    poisoned = grad(*(jnp.where(jnp.asarray(~doc)[:, None, None], jnp.nan, x).astype(BF16) for x in (q, k, v)))
    again = grad(q, k, v)
    for g, c, a in zip(poisoned, clean, again):
        np.testing.assert_array_equal(np.asarray(g, np.float32)[doc], np.asarray(c, np.float32)[doc])
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(c, np.float32))


@pytest.mark.parametrize("change, error, match", [
    (dict(head_dim=96), ValueError, r"backward_backend='mosaic' does not support head_dim=96"),
    (dict(dtype=jnp.float32), ValueError, r"does not support dtype float32"),
    (dict(backward_config=PrefillConfig(block_m=16, block_n=16)), ValueError, r"backward_config= tunes the Triton"),
    (dict(backward_backend="cuda"), ValueError, r"backward_backend must be one of"),
])
def test_bad_backward_backend_raises(change, error, match, rng):
    d, dtype = change.pop("head_dim", 64), change.pop("dtype", BF16)
    q, k, v, cu, _, _ = _inputs(rng, [5], 2, 1, d, dtype, pad=0)
    kw = {**MOSAIC, **change}
    with pytest.raises(error, match=match):
        varlen_attention(q, k, v, cu, max_seqlen=5, **kw)


@pytest.mark.parametrize("span", [1, 2])
def test_repack_puts_every_request_on_a_span(span):
    """The re-packed layout: each request from a boundary of ``span`` 64-row tiles (one per compute warpgroup),
    filling whole spans, rows past its end (and past max_seqlen) zero, and the way back to packed rows only for the
    rows a request computes."""
    from pallas_attn.kernels.mosaic import prefill_bwd

    cu = jnp.asarray([0, 70, 70, 75, 200], jnp.int32)
    src, tile_req, tile_local, req_tile, seq_len, dst = prefill_bwd._repack(cu, 203, max_seqlen=100, span=span)
    np.testing.assert_array_equal(np.asarray(seq_len), [70, 0, 5, 100])
    starts = [0, 2, 2, 3] if span == 1 else [0, 2, 2, 4]  # in tiles: requests of 70, 0, 5 and 100 rows
    np.testing.assert_array_equal(np.asarray(req_tile), starts)
    assert src.shape[0] % (64 * span) == 0 and src.shape[0] >= 203 + (64 * span - 1) * 4
    src, dst = np.asarray(src), np.asarray(dst)
    r2, r3 = 64 * starts[2], 64 * starts[3]
    np.testing.assert_array_equal(src[:70], np.arange(70))
    assert np.all(src[70:r2] == -1) and np.all(src[r2:r2 + 5] == np.arange(70, 75)) and np.all(src[r2 + 5:r3] == -1)
    np.testing.assert_array_equal(src[r3:r3 + 100], np.arange(75, 175))
    assert np.all(src[r3 + 100:] == -1)
    np.testing.assert_array_equal(dst[:75], np.r_[np.arange(70), np.arange(r2, r2 + 5)])
    assert np.all(dst[175:] == -1)  # past max_seqlen, and padding
    tiles = [0, 0, 2, 3, 3] if span == 1 else [0, 0, 2, 2, 3, 3]
    np.testing.assert_array_equal(np.asarray(tile_req)[:len(tiles)], tiles)
    np.testing.assert_array_equal(np.asarray(tile_local)[:len(tiles)], [0, 1, 0, 0, 1] if span == 1 else [0, 1] * 3)
    assert np.all(np.asarray(tile_req)[len(tiles):] == -1)


@pytest.mark.parametrize("causal, mods", [(True, masks.ScoreMods(window_left=70)),
                                          (False, masks.ScoreMods(window_left=20, window_right=90, softcap=5.0))])
def test_one_and_two_compute_warpgroups_agree(causal, mods, rng):
    """The backward with one compute warpgroup a program and with two (each its own tile of a span, the walk the
    span's): the same gradients, bit for bit where no sum is reordered (each tile's own walk order is kept)."""
    from pallas_attn.kernels.mosaic import prefill_bwd

    q, k, v, cu, w_out, _ = _inputs(rng, [65, 1, 130], 4, 2, 64, BF16)
    do = w_out.astype(BF16)
    l2 = jnp.asarray(rng.standard_normal((q.shape[0], 4)) + 6.0, jnp.float32)
    delta = jnp.asarray(rng.standard_normal((q.shape[0], 4)), jnp.float32)
    q, k, v, do = (jnp.nan_to_num(x) for x in (q, k, v, do))
    kw = dict(max_seqlen=130, causal=causal, scale=0.125, interpret=True, mods=mods)
    one, two = (prefill_bwd.varlen_attention_bwd_mosaic(q, k, v, cu, do, l2, delta, wgs=w, **kw) for w in (1, 2))
    for a, b in zip(one, two):
        assert np.all(np.isfinite(np.asarray(b)))
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("hopper, interpret, triton, dtype, head_dim, config, expected", [
    (True, False, True, BF16, 128, None, "mosaic"),  # measured faster on the H200 (docs/performance.md)
    (True, False, True, jnp.float16, 64, None, "mosaic"),
    (True, False, True, BF16, 256, None, "triton"),  # the Mosaic backward runs 64 and 128
    (True, False, True, jnp.float32, 128, None, "triton"),
    (True, False, True, BF16, 128, PrefillConfig(block_m=32, block_n=32), "triton"),  # the Triton kernels' tiles
    (True, True, True, BF16, 128, None, "triton"),  # interpret mode
    (False, False, True, BF16, 128, None, "triton"),  # not sm_90
    (False, True, False, BF16, 128, None, "mosaic"),  # the Pallas Triton backend gone
])
def test_default_backward_backend_rule(monkeypatch, hopper, interpret, triton, dtype, head_dim, config, expected):
    """``backward_backend=None``: the Mosaic backward where it applies on a compiled Hopper GPU, else Triton."""
    from pallas_attn.core import backend
    from pallas_attn.ops import varlen as ops
    monkeypatch.setattr(backend, "is_hopper", lambda: hopper)
    monkeypatch.setattr(backend, "triton_available", lambda: triton)
    q = jax.ShapeDtypeStruct((16, 4, head_dim), dtype)
    assert ops.backward_backend_for(q, None, config, interpret) == expected
