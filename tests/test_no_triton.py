"""Without the Pallas Triton backend (deprecated since JAX 0.11, to be removed): ``import pallas_attn`` works, the
functions with a Mosaic GPU kernel run on it, and the others raise :class:`pallas_attn.BackendUnavailableError`
naming themselves. The removal is simulated: ``jax.experimental.pallas.triton`` made unimportable in a fresh
interpreter (and, for the backend rule alone, ``backend.pallas_triton`` set to None in this one)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_attn.core import backend
from pallas_attn.kernels.mosaic import prefill as mosaic_prefill
from pallas_attn.testing import random_packed

WITHOUT_TRITON = textwrap.dedent("""
    import sys
    sys.modules["jax.experimental.pallas.triton"] = None  # what a JAX without the backend does on import
    import jax, jax.numpy as jnp, numpy as np
    jax.config.update("jax_cpu_enable_async_dispatch", False)  # the Mosaic GPU interpreter: tests/conftest.py
    import pallas_attn as pa
    from pallas_attn.testing import assert_attention_close, make_paged_kv, random_packed
    assert not pa.core.backend.triton_available()

    rng = np.random.default_rng(0)
    q, cu = random_packed(rng, [5, 70], 4, 64, jnp.bfloat16, pad_to=80)
    k, _ = random_packed(rng, [5, 70], 2, 64, jnp.bfloat16, pad_to=80)
    v, _ = random_packed(rng, [5, 70], 2, 64, jnp.bfloat16, pad_to=80)
    out = pa.varlen_attention(q, k, v, cu, max_seqlen=70)  # the default: Mosaic (its interpreter on CPU)
    assert_attention_close(out, pa.reference.varlen_attention(q, k, v, cu), dtype=jnp.bfloat16, valid_rows=75)
    print("varlen: mosaic")

    def raises(fn, *names):
        try:
            fn()
        except pa.BackendUnavailableError as e:
            assert all(n in str(e) for n in names), (names, str(e))
            print("raises:", names[0])
        else:
            raise AssertionError(f"{names} did not raise")

    kc, vc, bt = make_paged_kv(rng, [9, 30], 16, 2, 64, jnp.bfloat16, max_blocks=2)
    qd = jnp.asarray(rng.standard_normal((2, 4, 64)), jnp.bfloat16)
    lens = jnp.array([9, 30], jnp.int32)
    out = pa.paged_decode_attention(qd, kc, vc, bt, lens)  # the default: Mosaic (its interpreter on CPU)
    assert_attention_close(out, pa.reference.paged_decode_attention(qd, kc, vc, bt, lens), dtype=jnp.bfloat16)
    cu1 = jnp.array([0, 1, 2], jnp.int32)
    out = pa.paged_attention(qd, kc, vc, bt, lens, cu1, max_query_len=1)
    assert_attention_close(out, pa.reference.paged_attention(qd, kc, vc, bt, lens, cu1), dtype=jnp.bfloat16)
    print("paged: mosaic")
    raises(lambda: pa.paged_decode_attention(qd.astype(jnp.float32), kc.astype(jnp.float32),
                                             vc.astype(jnp.float32), bt, lens), "paged_decode_attention", "float32")
    kc4, vc4, bt4 = make_paged_kv(rng, [9, 30], 4, 2, 64, jnp.bfloat16)
    raises(lambda: pa.paged_attention(qd, kc4, vc4, bt4, lens, cu1, max_query_len=1), "paged_attention",
           "block_size=4")
    grad = jax.grad(lambda q: pa.varlen_attention(q, k, v, cu, max_seqlen=70).astype(jnp.float32).sum())
    want = jax.grad(lambda q: pa.reference.varlen_attention_dense(q, k.astype(jnp.float32), v.astype(jnp.float32),
                                                                  cu, max_seqlen=70).sum())(q.astype(jnp.float32))
    assert_attention_close(grad(q), want, dtype=jnp.bfloat16, rtol=2e-2, valid_rows=75)  # the Mosaic backward
    print("grad: mosaic")
    q256, k256 = (jnp.zeros((8, h, 256), jnp.bfloat16) for h in (4, 2))
    grad256 = jax.jit(jax.grad(lambda q: pa.varlen_attention(q, k256, k256, jnp.array([0, 8], jnp.int32),
                                                             max_seqlen=8).astype(jnp.float32).sum()))
    raises(lambda: grad256.lower(q256), "the gradient of varlen_attention", "head_dim=256")
    raises(lambda: pa.varlen_attention(q, k, v, cu, max_seqlen=70, backend="triton"), "varlen_attention",
           "backend='triton'")
    raises(lambda: pa.varlen_attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), cu,
                                       max_seqlen=70), "varlen_attention", "float32")
    kv, _, btm = make_paged_kv(rng, [9, 30], 16, None, 576, jnp.bfloat16, max_blocks=2)
    qm = jnp.asarray(rng.standard_normal((2, 16, 576)), jnp.bfloat16)
    raises(lambda: pa.mla_attention(qm, kv, btm, lens), "mla_attention", "interpret mode")  # Mosaic: compiled only
    # no kernel, no backend needed
    empty = pa.paged_decode_attention(qd[:0], kc, vc, bt[:0], lens[:0])
    assert empty.shape == (0, 4, 64)
    merged, _ = pa.merge_attention_states(jnp.ones((2, 3, 4, 8)), jnp.zeros((2, 3, 4)))
    assert merged.shape == (3, 4, 8)
    print("OK")
""")


@pytest.mark.timeout(600)
def test_library_runs_without_the_triton_backend():
    result = subprocess.run([sys.executable, "-c", WITHOUT_TRITON], capture_output=True, text=True, timeout=580)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.splitlines()[-1] == "OK", result.stdout


def test_default_backend_is_mosaic_without_triton(monkeypatch):
    monkeypatch.setattr(backend, "pallas_triton", None)
    pick = lambda **kw: backend.select_backend(  # noqa: E731
        kw.pop("backend", None), config=None, default=lambda: "triton", function="f", **kw)
    assert pick(mosaic_unsupported=lambda: None) == "mosaic"
    with pytest.raises(backend.BackendUnavailableError, match=r"f runs on the Pallas Triton backend.*\(head_dim"):
        pick(mosaic_unsupported=lambda: "head_dim=512")
    with pytest.raises(backend.BackendUnavailableError, match=r"backend='triton'"):
        pick(backend="triton", mosaic_unsupported=lambda: None)


def test_staging_without_triton_matches(rng, monkeypatch):
    """The Mosaic prefill's K/V staging by XLA (no Triton copy kernel) gives every window the kernel reads."""
    lens = [3, 130, 1, 200]
    k, cu = random_packed(rng, lens, 2, 64, jnp.bfloat16, pad_to=340)
    v, _ = random_packed(rng, lens, 2, 64, jnp.bfloat16, pad_to=340)
    block_kv = 128
    k_ref, v_ref, stage_ref = mosaic_prefill._stage_kv(k, v, cu, block_kv, 200, interpret=True)
    monkeypatch.setattr(mosaic_prefill, "pltriton", None)
    k_xla, v_xla, stage_xla = mosaic_prefill._stage_kv(k, v, cu, block_kv, 200, interpret=True)
    np.testing.assert_array_equal(np.asarray(stage_xla), np.asarray(stage_ref))
    stage = np.asarray(stage_ref).reshape(-1, 2)  # per request: first staged window, its index among the staged
    read = [stage[b, 1] + j for b, n in enumerate(lens) for j in range(-(-n // block_kv) - stage[b, 0])]
    assert read  # unaligned starts: windows are staged
    rows = np.concatenate([np.arange(w * block_kv, (w + 1) * block_kv) for w in read])
    for got, want in ((k_xla, k_ref), (v_xla, v_ref)):
        np.testing.assert_array_equal(np.asarray(got, np.float32)[rows], np.asarray(want, np.float32)[rows])
