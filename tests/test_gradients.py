"""Gradients of varlen_attention against autodiff of the dense reference (reference.varlen_attention_dense): lengths
0 / 1 / tile ± 1 / long, GQA, head dims, causal or not, window edges, soft-cap with large logits, ALiBi, sinks, a
cotangent on the LSE; NaN in padding rows; no gradient across a document boundary; bit-identical run to run; under
jit, vmap and remat."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from pallas_attn import PrefillConfig, reference, varlen_attention
from pallas_attn.testing import assert_attention_close, random_packed

TILES = PrefillConfig(block_m=16, block_n=16)  # forward and backward: CPU lengths cross several tiles
I32 = jnp.int32


def _inputs(rng, lens, hq, hkv, d, dtype=jnp.float32, pad=3, q_scale=1.0):
    """Packed q, k, v with NaN in the ``pad`` padding rows, and fixed random cotangents for out and the LSE."""
    q, cu = random_packed(rng, lens, hq, d, jnp.float32, pad_to=sum(lens) + pad)
    k, _ = random_packed(rng, lens, hkv, d, jnp.float32, pad_to=sum(lens) + pad)
    v, _ = random_packed(rng, lens, hkv, d, jnp.float32, pad_to=sum(lens) + pad)
    t = q.shape[0]
    w_out = jnp.asarray(rng.standard_normal((t, hq, d)), jnp.float32)
    w_lse = jnp.asarray(rng.standard_normal((t, hq)), jnp.float32)
    return (q * q_scale).astype(dtype), k.astype(dtype), v.astype(dtype), cu, w_out, w_lse


def _loss(fn, cu, w_out, w_lse, max_seqlen, with_lse, **kw):
    """Σ w · out (+ Σ w · lse over the rows that see a key): every output element and LSE has its own cotangent."""
    def loss(q, k, v, sinks=None):
        out, lse = fn(q, k, v, cu, max_seqlen=max_seqlen, sinks=sinks, return_lse=True, **kw)
        total = jnp.sum(out.astype(jnp.float32) * w_out)
        if with_lse:
            total += jnp.sum(jnp.where(jnp.isfinite(lse), lse * w_lse, 0.0))
        return total
    return loss


def _grads(rng, lens, hq, hkv, d, *, dtype=jnp.float32, sinks=False, with_lse=True, q_scale=1.0, max_seqlen=None,
           **kw):
    """The kernels' gradients and the dense reference's, for q, k, v (and the sinks)."""
    q, k, v, cu, w_out, w_lse = _inputs(rng, lens, hq, hkv, d, dtype, q_scale=q_scale)
    s = jnp.asarray(rng.standard_normal(hq), jnp.float32) if sinks else None
    max_seqlen = max_seqlen or max(max(lens), 1)
    argnums = (0, 1, 2, 3) if sinks else (0, 1, 2)
    ours = jax.grad(_loss(varlen_attention, cu, w_out, w_lse, max_seqlen, with_lse, config=TILES,
                          backward_config=TILES, **kw), argnums=argnums)(q, k, v, s)
    ref = jax.grad(_loss(reference.varlen_attention_dense, cu, w_out, w_lse, max_seqlen, with_lse, **kw),
                   argnums=argnums)(*(x.astype(jnp.float32) for x in (q, k, v)), s)
    return ours, ref, int(cu[-1])


def _assert_close(ours, ref, dtype, valid_rows):
    rtol = 1e-5 if dtype == jnp.float32 else 2e-2  # half precision: inputs rounded, P and dS rounded for the dots
    for name, a, b in zip(("dq", "dk", "dv", "dsinks"), ours, ref):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.isfinite(a).all(), f"{name} is not finite"
        if name == "dsinks":
            assert_attention_close(a[None, None], b[None, None], rtol=max(rtol, 1e-5))
            continue
        assert_attention_close(a, b, rtol=rtol, valid_rows=valid_rows)
        assert not np.any(a[valid_rows:]), f"{name}: a padding row has a gradient"


# name: (lengths, Hq, Hkv, head_dim, keyword arguments). Tiles are 16 rows / keys.
SCENARIOS = {
    "causal_mixed_lengths": ([17, 0, 1, 15, 16, 40], 4, 2, 16, {}),
    "bidirectional": ([17, 1, 33], 4, 1, 16, dict(causal=False)),
    "mha": ([20, 9], 2, 2, 64, {}),
    "gqa_8": ([19, 30], 8, 1, 16, {}),
    "head_dim_128": ([18, 7], 2, 1, 128, {}),
    "window_left": ([40, 16, 5], 4, 2, 16, dict(window_size=(15, 0))),
    "window_0": ([20, 3], 2, 1, 16, dict(window_size=(0, 0))),
    "window_both_sides": ([35, 12], 2, 1, 16, dict(causal=False, window_size=(16, 17))),
    "window_past_the_request": ([20], 2, 1, 16, dict(window_size=(100, 0))),
    "softcap_large_logits": ([33, 8], 4, 2, 16, dict(softcap=30.0, q_scale=1e3)),
    "alibi": ([34, 15], 4, 2, 16, dict(alibi_slopes=np.geomspace(0.5, 0.01, 4).astype(np.float32))),
    "sinks": ([25, 0, 17], 4, 2, 16, dict(sinks=True)),
    "everything": ([41, 16], 4, 2, 16, dict(window_size=(20, 0), softcap=5.0, sinks=True,
                                            alibi_slopes=np.full(4, 0.1, np.float32))),
    "truncated_past_max_seqlen": ([40, 10], 2, 1, 16, dict(max_seqlen=32)),
}


@pytest.mark.parametrize("name", SCENARIOS)
def test_matches_dense_reference(name, rng):
    lens, hq, hkv, d, kw = SCENARIOS[name]
    kw = dict(kw)
    if "alibi_slopes" in kw:
        kw["alibi_slopes"] = jnp.asarray(kw["alibi_slopes"])
    ours, ref, valid = _grads(rng, lens, hq, hkv, d, **kw)
    _assert_close(ours, ref, jnp.float32, valid)


@pytest.mark.parametrize("dtype, with_lse", [(jnp.bfloat16, False), (jnp.bfloat16, True), (jnp.float16, True)])
def test_half_precision(dtype, with_lse, rng):
    """bf16 / fp16 inputs, float32 accumulation: the gradients in the inputs' dtype, within 2e-2 of float32."""
    ours, ref, valid = _grads(rng, [30, 17], 4, 2, 64, dtype=dtype, with_lse=with_lse, sinks=True)
    assert all(g.dtype == dtype for g in ours[:3])
    _assert_close(ours, ref, dtype, valid)


def test_check_grads_numerically(rng):
    """Finite differences in float32 on a tiny batch (``jax.test_util.check_grads``, reverse mode)."""
    q, k, v, cu, _, _ = _inputs(rng, [5, 3], 2, 1, 16, pad=0)
    sinks = jnp.asarray(rng.standard_normal(2), jnp.float32)
    fn = lambda q, k, v, s: varlen_attention(q, k, v, cu, max_seqlen=5, sinks=s, softcap=4.0,  # noqa: E731
                                             config=TILES, backward_config=TILES)
    check_grads(fn, (q, k, v, sinks), order=1, modes=["rev"], atol=1e-2, rtol=1e-2, eps=1e-2)


def test_no_gradient_crosses_a_document_boundary(rng):
    """The gradient of one packed document's loss with respect to every other document's tokens is exactly zero,
    and NaN in those tokens leaves the document's own gradient bit-identical."""
    lens = [12, 20, 9]
    q, k, v, cu, w_out, _ = _inputs(rng, lens, 4, 2, 16)
    doc = np.zeros(q.shape[0], bool)
    doc[12:32] = True  # document 1
    w_doc = jnp.where(jnp.asarray(doc)[:, None, None], w_out, 0.0)

    def grads(q, k, v):
        return jax.grad(lambda q, k, v: jnp.sum(varlen_attention(q, k, v, cu, max_seqlen=20, config=TILES,
                                                                 backward_config=TILES) * w_doc),
                        argnums=(0, 1, 2))(q, k, v)

    clean = grads(q, k, v)
    for g in clean:
        g = np.asarray(g)
        assert np.all(g[~doc] == 0), "a gradient crossed a document boundary"
        assert np.isfinite(g).all() and np.any(g[doc])
    poisoned = grads(*(jnp.where(jnp.asarray(~doc)[:, None, None], jnp.nan, x) for x in (q, k, v)))
    for g, c in zip(poisoned, clean):
        np.testing.assert_array_equal(np.asarray(g)[doc], np.asarray(c)[doc])


@pytest.mark.parametrize("deterministic", [True, False])
def test_bit_identical_run_to_run(deterministic, rng):
    """No atomics in either backward kernel: the same gradients, bit for bit, with ``deterministic`` either way (False
    is FlashAttention's leave to use atomics, which changes nothing here); a non-bool is a named error."""
    q, k, v, cu, w_out, w_lse = _inputs(rng, [40, 17], 4, 2, 16)
    loss = _loss(varlen_attention, cu, w_out, w_lse, 40, True, config=TILES, backward_config=TILES,
                 deterministic=deterministic)
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    first, second = grad(q, k, v), grad(q, k, v)
    for a, b in zip(first, second):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(TypeError, match="deterministic must be a static Python bool"):
        varlen_attention(q, k, v, cu, max_seqlen=40, deterministic="yes")


def test_jit_vmap_and_remat(rng):
    """A batch of packed rows under vmap, the attention rematerialised inside a jitted loss: the same gradients."""
    q, k, v, cu, w_out, _ = _inputs(rng, [10, 7], 2, 1, 16, pad=1)
    qs, ks, vs = (jnp.stack([x, x * -0.7]) for x in (q, k, v))  # two rows of packed documents

    def one(q, k, v):
        return varlen_attention(q, k, v, cu, max_seqlen=16, config=TILES, backward_config=TILES)

    def loss(attend, q, k, v):
        return jnp.sum(jax.vmap(attend)(q, k, v) * w_out[None])

    got = jax.jit(jax.grad(lambda *a: loss(jax.checkpoint(one), *a), argnums=(0, 1, 2)))(qs, ks, vs)
    dense = lambda q, k, v: reference.varlen_attention_dense(q, k, v, cu, max_seqlen=16)  # noqa: E731
    want = jax.grad(lambda *a: loss(dense, *a), argnums=(0, 1, 2))(qs, ks, vs)
    for a, b in zip(got, want):
        assert_attention_close(np.asarray(a).reshape(-1, *a.shape[2:]), np.asarray(b).reshape(-1, *b.shape[2:]),
                               rtol=1e-5)


def test_empty_batch_and_forward_mode(rng):
    """No request: zero gradients without a kernel. Forward mode is not offered: jax.jvp raises."""
    q = jnp.ones((4, 2, 16))
    grads = jax.grad(lambda q: varlen_attention(q, q[:, :1], q[:, :1], jnp.array([0], I32), max_seqlen=4).sum())(q)
    assert not np.any(np.asarray(grads))
    q, k, v, cu, _, _ = _inputs(rng, [5], 2, 1, 16, pad=0)
    with pytest.raises(TypeError, match="custom_vjp"):
        jax.jvp(lambda q: varlen_attention(q, k, v, cu, max_seqlen=5, config=TILES), (q,), (q,))
