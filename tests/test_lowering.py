"""Every public kernel lowers for the H200 (CUDA, sm_90) at the standard workloads' shapes, checked on a CPU.

Interpret mode runs the kernel bodies through XLA and never touches the Triton or Mosaic GPU lowering, where a
construct the interpreter accepts can still fail (an unsupported op, a layout, an alignment Mosaic GPU cannot
prove). An abstract H200 (``AbstractDevice``) gives the Triton lowering its compute capability without a GPU; ptxas
still only runs on a real one (``tools/offline_compile.py`` covers registers and spills).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest
from jax._src.mesh import AbstractDevice
from jax.sharding import AbstractMesh

from pallas_attn import mla_attention, paged_attention, paged_decode_attention, sparse_mla_attention, varlen_attention

S = jax.ShapeDtypeStruct
BF16, I32 = jnp.bfloat16, jnp.int32
H200 = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(device_kind="NVIDIA H200", num_cores=132,
                                                                 platform="cuda"))


def _lower(fn, *shapes) -> str:
    with jax.sharding.use_abstract_mesh(H200):
        return jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()


def _pallas_calls(text: str) -> int:
    return text.count("__gpu$xla.gpu.triton") + text.count("mosaic_gpu")


@pytest.mark.parametrize("backend, dtype, head_dim", [("triton", BF16, 128), ("triton", jnp.float32, 96),
                                                      ("mosaic", BF16, 128)])
def test_varlen_p1(backend, dtype, head_dim):
    fn = functools.partial(varlen_attention, max_seqlen=8192, return_lse=True, interpret=False, backend=backend)
    text = _lower(fn, S((29184, 32, head_dim), dtype), S((29184, 8, head_dim), dtype),
                  S((29184, 8, head_dim), dtype), S((17,), I32))
    assert _pallas_calls(text) >= 1


@pytest.mark.parametrize("kw", [dict(alibi=True), dict(alibi=True, softcap=30.0, window_size=(1023, 0), sinks=True)])
def test_varlen_mosaic_features(kw):
    """The Hopper prefill with ALiBi (its column positions built as registers: compiled code only) and with every
    feature at once."""
    kw = dict(kw)
    names = [f for f in ("alibi_slopes", "sinks") if kw.pop(f.split("_")[0], False)]

    def fn(q, k, v, cu, *feats):
        return varlen_attention(q, k, v, cu, max_seqlen=8192, return_lse=True, interpret=False, backend="mosaic",
                                **dict(zip(names, feats)), **kw)

    text = _lower(fn, S((29184, 32, 128), BF16), S((29184, 8, 128), BF16), S((29184, 8, 128), BF16), S((17,), I32),
                  *[S((32,), jnp.float32)] * len(names))
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("batch, max_blocks", [(64, 512), (4, 8192)])  # D1 (tail-balance split), D2 (split-KV)
def test_paged_decode(batch, max_blocks):
    fn = functools.partial(paged_decode_attention, return_lse=True, interpret=False)
    cache = S((batch * max_blocks, 16, 8, 128), BF16)
    text = _lower(fn, S((batch, 32, 128), BF16), cache, cache, S((batch, max_blocks), I32), S((batch,), I32))
    assert _pallas_calls(text) >= 1


@pytest.mark.parametrize("tokens, seqs, max_query_len, max_blocks", [
    (192, 32, 6, 1024),  # V1: one launch
    (2152, 68, 512, 512),  # M1: short launch split on its own, merged by the chunk launch
    (600, 4, 512, 4096),  # few chunks over long contexts: both launches split, one merge
])
def test_paged_ragged(tokens, seqs, max_query_len, max_blocks):
    fn = functools.partial(paged_attention, max_query_len=max_query_len, return_lse=True, interpret=False)
    cache = S((seqs * max_blocks, 16, 8, 128), BF16)
    text = _lower(fn, S((tokens, 32, 128), BF16), cache, cache, S((seqs, max_blocks), I32), S((seqs,), I32),
                  S((seqs + 1,), I32))
    assert _pallas_calls(text) >= (1 if max_query_len <= 16 else 2)


# The Mosaic paged kernel at the standard and model shapes: D1 (GQA 4, pages of 16: four copies a tile), a TP-8
# shard of Llama-3.1-70B (one KV head, group 8), Gemma-3 decode (head dim 256, two slots), V1 and M1 in one launch,
# pages of 64 with a window, soft-cap, ALiBi and sinks, and pages of 544 (hybrid models).
MOSAIC_PAGED = {
    "d1": (64, 64, 1, 512, 16, 32, 8, 128, {}),
    "tp8_shard": (64, 64, 1, 512, 16, 8, 1, 128, dict(num_splits=4)),
    "gemma_d256": (8, 8, 1, 256, 16, 8, 4, 256, dict(window_size=(1023, 0), softcap=50.0)),
    "v1": (192, 32, 6, 1024, 16, 32, 8, 128, {}),
    "m1": (2152, 68, 512, 512, 16, 32, 8, 128, dict(split_size=1024)),
    "bs64_features": (256, 16, 32, 256, 64, 64, 8, 64, dict(alibi=True, sinks=True)),
    "bs544_hybrid": (64, 64, 1, 32, 544, 16, 2, 128, {}),  # Qwen3-Next-style pages: copies of 32 rows
}


@pytest.mark.parametrize("name", MOSAIC_PAGED)
def test_paged_mosaic(name):
    tokens, seqs, max_query_len, max_blocks, bs, hq, hkv, d, kw = MOSAIC_PAGED[name]
    kw = dict(kw)
    names = [f for f in ("alibi_slopes", "sinks") if kw.pop(f.split("_")[0], False)]  # f32[Hq] arrays

    def fn(q, k_cache, v_cache, block_tables, seq_lens, cu_query_lens, *feats):
        return paged_attention(q, k_cache, v_cache, block_tables, seq_lens, cu_query_lens,
                               max_query_len=max_query_len, return_lse=True, interpret=False, backend="mosaic",
                               **dict(zip(names, feats)), **kw)

    cache = S((seqs * max_blocks, bs, hkv, d), BF16)
    text = _lower(fn, S((tokens, hq, d), BF16), cache, cache, S((seqs, max_blocks), I32), S((seqs,), I32),
                  S((seqs + 1,), I32), *[S((hq,), jnp.float32)] * len(names))
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("tokens, hq, hkv, d, kw", [
    (29184, 32, 8, 128, {}),  # P1-bwd
    (32768, 16, 16, 64, dict(causal=False, window_size=(255, 255), softcap=30.0)),  # an encoder, every feature
    (4099, 8, 1, 128, dict(window_size=(1023, 0), sinks=True)),  # rows not a multiple of 8
])
def test_varlen_backward_mosaic(tokens, hq, hkv, d, kw):
    """The Mosaic backward kernels (dK / dV, dQ) at training shapes."""
    kw = dict(kw)
    sinks = kw.pop("sinks", False)

    def fn(q, k, v, cu, *s):
        loss = lambda q, k, v, *s: varlen_attention(  # noqa: E731
            q, k, v, cu, max_seqlen=8192, interpret=False, backward_backend="mosaic", sinks=s[0] if s else None,
            **kw).astype(jnp.float32).sum()
        return jax.grad(loss, argnums=tuple(range(3 + len(s))))(q, k, v, *s)

    text = _lower(fn, S((tokens, hq, d), BF16), S((tokens, hkv, d), BF16), S((tokens, hkv, d), BF16), S((17,), I32),
                  *([S((hq,), jnp.float32)] if sinks else []))
    assert text.count("mosaic_gpu") >= 2


@pytest.mark.parametrize("cache_dtype", [BF16, jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_paged_decode_mosaic(cache_dtype):
    """D1 through the Mosaic decode path, with a bf16 cache and with FP8 pages widened in shared memory."""
    scales = [S((), jnp.float32)] * 2 if cache_dtype != BF16 else []

    def fn(q, k_cache, v_cache, block_tables, seq_lens, *kv_scales):
        return paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens,
                                      k_scale=kv_scales[0] if kv_scales else None,
                                      v_scale=kv_scales[1] if kv_scales else None, return_lse=True,
                                      interpret=False, backend="mosaic")

    cache = S((64 * 512, 16, 8, 128), cache_dtype)
    text = _lower(fn, S((64, 32, 128), BF16), cache, cache, S((64, 512), I32), S((64,), I32), *scales)
    assert "mosaic_gpu" in text


# FP8 pages with per-(token, head) scale caches through the Mosaic paged kernel: D1 (head dim 128), a TP-8 shard
# (one KV head: its scales 4 bytes apart, gathered into bands), Gemma-3 (head dim 256: the value rows widened in two
# column tiles) with a window (the band is the window's tiles), gpt-oss (head dim 64) as an M1-like mixed batch.
MOSAIC_TOKEN_SCALES = {
    "d1": (64, 64, 1, 512, 16, 32, 8, 128, {}),
    "tp8_shard": (64, 64, 1, 512, 16, 8, 1, 128, {}),
    "gemma_d256_window": (8, 8, 1, 256, 16, 8, 4, 256, dict(window_size=(1023, 0))),
    "gptoss_mixed": (2152, 68, 512, 512, 16, 64, 8, 64, dict(window_size=(127, 0))),
}


@pytest.mark.parametrize("name", MOSAIC_TOKEN_SCALES)
def test_paged_mosaic_token_scales(name):
    tokens, seqs, max_query_len, max_blocks, bs, hq, hkv, d, kw = MOSAIC_TOKEN_SCALES[name]

    def fn(q, k_cache, v_cache, block_tables, seq_lens, cu_query_lens, k_scale, v_scale):
        return paged_attention(q, k_cache, v_cache, block_tables, seq_lens, cu_query_lens, k_scale=k_scale,
                               v_scale=v_scale, max_query_len=max_query_len, return_lse=True, interpret=False,
                               backend="mosaic", **kw)

    cache = S((seqs * max_blocks, bs, hkv, d), jnp.float8_e4m3fn)
    scales = S(cache.shape[:3], jnp.float32)
    text = _lower(fn, S((tokens, hq, d), BF16), cache, cache, S((seqs, max_blocks), I32), S((seqs,), I32),
                  S((seqs + 1,), I32), scales, scales)
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("cache_dtype, mode", [(jnp.float8_e4m3fn, "tensor"), (jnp.float8_e5m2, "tensor"),
                                               (jnp.float8_e4m3fn, "token")])
def test_fp8_caches(cache_dtype, mode):
    """FP8 pages (loaded as pairs, converted in registers) through both paged kernels, at D1's and M1's shapes, with
    per-tensor scales or per-(token, head) scale caches."""
    scale = S((), jnp.float32) if mode == "tensor" else S((64 * 512, 16, 8), jnp.float32)
    cache = S((64 * 512, 16, 8, 128), cache_dtype)
    decode = lambda *a: paged_decode_attention(*a[:5], k_scale=a[5], v_scale=a[6], interpret=False)  # noqa: E731
    text = _lower(decode, S((64, 32, 128), BF16), cache, cache, S((64, 512), I32), S((64,), I32), scale, scale)
    assert _pallas_calls(text) >= 1
    cache = S((68 * 512, 16, 8, 128), cache_dtype)
    scale = S((), jnp.float32) if mode == "tensor" else S((68 * 512, 16, 8), jnp.float32)
    ragged = lambda *a: paged_attention(*a[:6], k_scale=a[6], v_scale=a[7], max_query_len=512,  # noqa: E731
                                        interpret=False)
    text = _lower(ragged, S((2152, 32, 128), BF16), cache, cache, S((68, 512), I32), S((68,), I32), S((69,), I32),
                  scale, scale)
    assert _pallas_calls(text) >= 2


@pytest.mark.parametrize("head_dim, block_size, dtype", [(512, 544, BF16), (320, 48, jnp.float32)])
def test_wide_heads_and_pages(head_dim, block_size, dtype):
    """Heads padded to 512 and pages that are not powers of two, through every Triton kernel's default tiles."""
    prefill = functools.partial(varlen_attention, max_seqlen=4096, interpret=False, backend="triton")
    qkv = [S((8192, h, head_dim), dtype) for h in (16, 4, 4)]
    assert _pallas_calls(_lower(prefill, *qkv, S((5,), I32))) >= 1
    cache = S((512, block_size, 4, head_dim), dtype)
    decode = functools.partial(paged_decode_attention, return_lse=True, interpret=False)
    assert _pallas_calls(_lower(decode, S((8, 16, head_dim), dtype), cache, cache, S((8, 64), I32), S((8,), I32))) >= 1
    ragged = functools.partial(paged_attention, max_query_len=512, interpret=False)
    assert _pallas_calls(_lower(ragged, S((1024, 16, head_dim), dtype), cache, cache, S((8, 64), I32), S((8,), I32),
                                S((9,), I32))) >= 2


@pytest.mark.parametrize("heads, max_query_len, sinks", [(16, 1, False), (128, 2, True)])  # L1, L2
def test_mla(heads, max_query_len, sinks):
    """Dense MLA at the harness's shapes: 16 heads decoding (one 16-row tile), 128 heads two tokens a step."""
    batch = 128 if max_query_len == 1 else 64

    def fn(q, kv_cache, block_tables, seq_lens, *rest):
        cu = rest[0] if max_query_len > 1 else None
        return mla_attention(q, kv_cache, block_tables, seq_lens, cu, max_query_len=max_query_len,
                             sinks=rest[-1] if sinks else None, return_lse=True, interpret=False)

    extra = ([S((batch + 1,), I32)] if max_query_len > 1 else []) + ([S((heads,), jnp.float32)] if sinks else [])
    text = _lower(fn, S((batch * max_query_len, heads, 576), BF16), S((batch * 128, 64, 576), BF16),
                  S((batch, 128), I32), S((batch,), I32), *extra)
    assert _pallas_calls(text) >= 1


@pytest.mark.parametrize("backend, sinks", [(None, False), ("triton", True), ("mosaic", True)])
def test_sparse_s1(backend, sinks):
    def fn(q, kv_cache, block_tables, topk_indices, *sink):  # sinks f32[num_heads]: read at the finalization
        return sparse_mla_attention(q, kv_cache, block_tables, topk_indices, sinks=sink[0] if sink else None,
                                    return_lse=True, interpret=False, backend=backend)

    text = _lower(fn, S((64, 128, 576), BF16), S((64 * 512, 64, 576), BF16), S((64, 512), I32),
                  S((64, 2048), I32), *([S((128,), jnp.float32)] if sinks else []))
    assert _pallas_calls(text) >= 1
    if backend == "mosaic":
        assert "mosaic_gpu" in text
