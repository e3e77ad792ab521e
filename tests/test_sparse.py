"""sparse_mla_attention against the reference: -1 padding, all -1 rows, duplicates, last partial pages, poison in
unowned slots, several tokens per request, attention sinks."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_attn import SparseConfig, reference, sparse_mla_attention
from pallas_attn.testing import assert_attention_close, make_paged_kv

SMALL = SparseConfig(block_n=16, block_h=16, num_warps=4)


def _topk(rng, seq_lens, tokens_per_req, topk, unused=0.3, dup=True):
    rows = []
    for length, n in zip(seq_lens, tokens_per_req):
        for _ in range(n):
            idx = rng.integers(0, max(length, 1), topk)
            idx[-1] = length - 1  # the last (partial) page is always hit
            if dup and topk > 2:
                idx[1] = idx[0]  # a duplicate counts twice
            idx[rng.random(topk) < unused] = -1
            rows.append(idx if length else np.full(topk, -1))
    return np.asarray(rows, np.int32)


# name: (seq_lens, tokens per request or None for decode, heads, dim_qk, kv_lora_rank, block_size, topk, dtype)
SCENARIOS = {
    "decode_small_dims": ([30, 7, 64], None, 4, 80, 64, 4, 24, jnp.float32),
    "decode_576_bf16": ([40, 100], None, 16, 576, 512, 16, 64, jnp.bfloat16),
    "multi_token_576": ([50, 9, 33], [3, 1, 2], 8, 576, 512, 64, 32, jnp.bfloat16),
    "block_size_1": ([20, 5], [2, 1], 4, 80, 64, 1, 16, jnp.float32),
    "heads_not_pow2": ([25], None, 20, 80, 64, 8, 40, jnp.float32),
    "block_size_48": ([100, 47], [2, 1], 4, 80, 64, 48, 24, jnp.float32),  # pages of any multiple of 16
    "block_size_544": ([600, 9], None, 4, 80, 64, 544, 32, jnp.float32),
}


def _check_against_reference(rng, seq_lens, per, heads, dqk, dv, bs, topk, dtype, sinks=None, **kwargs):
    """Random top-k sets (-1 at random places, duplicates, the last partial page; row 0 all -1) over a cache with
    NaN in every slot no request owns; with ``per`` (tokens per request) two padding tokens with NaN queries and
    garbage indices. Output, LSE, the empty row and the padding rows against the reference, with ``sinks``
    (``f32[heads]``) given to both."""
    kv, _, bt = make_paged_kv(rng, seq_lens, bs, None, dqk, dtype)
    tokens = per or [1] * len(seq_lens)
    idx = _topk(rng, seq_lens, tokens, topk)
    idx[0] = -1  # a row that sees nothing
    pad = 0 if per is None else 2
    t = len(idx) + pad
    idx = np.concatenate([idx, rng.integers(-1, 50, (pad, topk)).astype(np.int32)])  # padding rows: garbage
    q = np.full((t, heads, dqk), np.nan, np.float32)
    q[: t - pad] = rng.standard_normal((t - pad, heads, dqk))
    q = jnp.asarray(q, dtype)
    cu = None if per is None else jnp.asarray(np.concatenate([[0], np.cumsum(per)]), jnp.int32)
    out, lse = sparse_mla_attention(q, kv, bt, jnp.asarray(idx), cu_query_lens=cu, kv_lora_rank=dv, sinks=sinks,
                                    return_lse=True, **kwargs)
    ref_out, ref_lse = reference.sparse_mla_attention(q, kv, bt, jnp.asarray(idx), cu_query_lens=cu,
                                                      kv_lora_rank=dv, sinks=sinks, return_lse=True)
    n = t - pad
    assert out.shape == (t, heads, dv) and out.dtype == q.dtype
    assert_attention_close(out, ref_out, dtype=dtype, valid_rows=n)
    np.testing.assert_array_equal(np.isneginf(np.asarray(lse)[:n]), np.isneginf(np.asarray(ref_lse)[:n]))
    fin = np.isfinite(np.asarray(ref_lse)[:n])
    np.testing.assert_allclose(np.asarray(lse)[:n][fin], np.asarray(ref_lse)[:n][fin], rtol=1e-5, atol=1e-4)
    assert np.all(np.asarray(out, np.float32)[0] == 0) and np.all(np.asarray(lse)[0] == -np.inf)
    assert np.all(np.asarray(out, np.float32)[n:] == 0) and np.all(np.asarray(lse)[n:] == -np.inf)


@pytest.mark.parametrize("name", SCENARIOS)
def test_matches_reference(name, rng):
    _check_against_reference(rng, *SCENARIOS[name], config=SMALL)


# Attention sinks (docs/design.md#model-family-features): each row's denominator gets exp(sink_h), the LSE stays over
# the keys, a row with no key stays 0 / -inf. The sinks' regimes: far below every score (no effect), about the
# scores, far above them (the output shrinks towards 0, its limit).
SINK_REGIMES = {
    "very_negative": lambda rng, h: np.full(h, -30.0),
    "moderate": lambda rng, h: rng.standard_normal(h),
    "very_positive": lambda rng, h: np.full(h, 30.0),
}
# name: as SCENARIOS (many query heads share the one latent head, each with its own sink)
SINK_SCENARIOS = {
    "decode_f32_20_heads": ([25, 40, 9], None, 20, 80, 64, 8, 40, jnp.float32),  # head blocks of 16: one partial
    "multi_token_576_bf16": SCENARIOS["multi_token_576"],
}


def _sinks(rng, regime, heads):
    return jnp.asarray(SINK_REGIMES[regime](rng, heads), jnp.float32)


@pytest.mark.parametrize("regime", SINK_REGIMES)
@pytest.mark.parametrize("name", SINK_SCENARIOS)
def test_sinks_match_reference(name, regime, rng):
    scenario = SINK_SCENARIOS[name]
    _check_against_reference(rng, *scenario, sinks=_sinks(rng, regime, scenario[2]), config=SMALL)


def test_sinks_with_value_splits(rng):
    """Value-split programs each finalize the whole row: each applies the sink to its columns."""
    _check_against_reference(rng, *SCENARIOS["multi_token_576"], sinks=_sinks(rng, "moderate", 8),
                             config=SparseConfig(block_n=16, block_h=16, num_warps=4, value_splits=4))


def test_sinks_leave_the_lse_and_shrink_the_output(rng):
    """The LSE with sinks is the LSE without them, bit for bit; each row's output is the sink-free one scaled by
    1 / (1 + exp(sink_h - lse))."""
    kv, _, bt = make_paged_kv(rng, [30, 7, 64], 4, None, 80, jnp.float32)
    idx = jnp.asarray(_topk(rng, [30, 7, 64], [1, 1, 1], 24))
    q = jnp.asarray(rng.standard_normal((3, 4, 80)), jnp.float32)
    sinks = _sinks(rng, "moderate", 4)
    kw = dict(kv_lora_rank=64, return_lse=True, config=SMALL)
    out, lse = sparse_mla_attention(q, kv, bt, idx, **kw)
    out_s, lse_s = sparse_mla_attention(q, kv, bt, idx, sinks=sinks, **kw)
    np.testing.assert_array_equal(np.asarray(lse_s), np.asarray(lse))
    want = np.asarray(out) / (1.0 + np.exp(np.asarray(sinks)[None, :] - np.asarray(lse)))[..., None]
    assert_attention_close(out_s, want)


@pytest.mark.parametrize("kw, match", [
    (dict(rank=100), "kv_lora_rank=100"),
    (dict(idx_rows=3), "topk_indices must be"),
    (dict(cu=jnp.array([0, 2], jnp.int32)), "cu_query_lens must be"),
    (dict(sinks=jnp.zeros(3)), "sinks"),
    (dict(sinks=jnp.zeros((4, 1))), "sinks"),
    (dict(sinks=jnp.zeros(4, jnp.int32)), "sinks"),
])
def test_bad_input_raises(kw, match):
    q = jnp.ones((2, 4, 80), jnp.float32)
    kv = jnp.ones((4, 4, 80), jnp.float32)
    bt = jnp.zeros((2, 2), jnp.int32)
    idx = jnp.zeros((kw.get("idx_rows", 2), 16), jnp.int32)
    with pytest.raises((ValueError, TypeError), match=match):
        sparse_mla_attention(q, kv, bt, idx, cu_query_lens=kw.get("cu"), kv_lora_rank=kw.get("rank", 64),
                             sinks=kw.get("sinks"))


@pytest.mark.gpu
def test_s1_shape_compiled(rng):
    seq_lens = [32768, 5000, 700]
    kv, _, bt = make_paged_kv(rng, seq_lens, 64, None, 576, jnp.bfloat16)
    idx = jnp.asarray(_topk(rng, seq_lens, [1, 1, 1], 2048, unused=0.05))
    q = jnp.asarray(rng.standard_normal((3, 128, 576)), jnp.bfloat16)
    out = sparse_mla_attention(q, kv, bt, idx)
    assert_attention_close(out, reference.sparse_mla_attention(q, kv, bt, idx), dtype=jnp.bfloat16)


@pytest.mark.parametrize("value_splits", [2, 4])
def test_value_splits_match_reference(value_splits, rng):
    """Programs that split the value dims (each recomputing QKᵀ) give the same result as the reference."""
    seq_lens, per = [50, 9], [2, 1]
    kv, _, bt = make_paged_kv(rng, seq_lens, 16, None, 576, jnp.bfloat16)
    idx = _topk(rng, seq_lens, per, 32)
    idx[1] = -1
    q = jnp.asarray(rng.standard_normal((len(idx), 8, 576)), jnp.bfloat16)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(per)]), jnp.int32)
    cfg = SparseConfig(block_n=16, block_h=16, num_warps=4, value_splits=value_splits)
    out, lse = sparse_mla_attention(q, kv, bt, jnp.asarray(idx), cu_query_lens=cu, return_lse=True, config=cfg)
    ref_out, ref_lse = reference.sparse_mla_attention(q, kv, bt, jnp.asarray(idx), cu_query_lens=cu, return_lse=True)
    assert_attention_close(out, ref_out, dtype=jnp.bfloat16)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), rtol=1e-5, atol=1e-4)


# ----------------------------------------------------------------------------- the Mosaic GPU kernel (sm_90)
# name: (seq_lens, tokens per request or None for decode, heads, block_size, topk, dtype)
MOSAIC_SCENARIOS = {
    "decode_bs64_topk256": ([300, 1, 64, 129, 2000], None, 64, 64, 256, jnp.bfloat16),
    "decode_bs1_topk64": ([40, 7, 64], None, 128, 1, 64, jnp.bfloat16),
    "multi_token_bs16_topk200": ([90, 17, 500], [3, 1, 4], 64, 16, 200, jnp.bfloat16),  # top-k padded to 256
    "decode_fp16": ([70, 333], None, 64, 32, 128, jnp.float16),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", MOSAIC_SCENARIOS)
def test_mosaic_matches_reference(name, rng):
    """The compiled Mosaic kernel under the same hostile inputs as the Triton one."""
    seq_lens, per, heads, bs, topk, dtype = MOSAIC_SCENARIOS[name]
    _check_against_reference(rng, seq_lens, per, heads, 576, 512, bs, topk, dtype, backend="mosaic")


@pytest.mark.gpu
@pytest.mark.parametrize("regime", SINK_REGIMES)
@pytest.mark.parametrize("splits", [1, 4])
def test_mosaic_sinks_match_reference(monkeypatch, rng, splits, regime):
    """Sinks in the compiled Mosaic kernel: in the kernel for one program per (token, 64 heads), once after the
    merge for a list shared by 4 programs (token 0 sees nothing: 0 and -inf whatever its sink)."""
    from pallas_attn.kernels.mosaic import sparse_mla as sparse_mosaic

    monkeypatch.setattr(sparse_mosaic, "default_splits", lambda *args: splits)
    _check_against_reference(rng, [5000, 300, 3000], None, 128, 576, 512, 64, 512, jnp.bfloat16,
                             sinks=_sinks(rng, regime, 128), backend="mosaic")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["mosaic", "triton"])
def test_corrupt_indices_and_pages_are_ignored_compiled(rng, backend):
    """Indices past ``seq_lens`` inside an owned page (unwritten, NaN slots), past the table row, below -1, and on
    page ids outside the pool: all ignored like -1, the other requests bit-identical (docs/design.md#isolation-
    whatever-the-inputs)."""
    lens = [700, 300, 129]
    kv, _, bt = make_paged_kv(rng, lens, 64, None, 576, jnp.bfloat16, max_blocks=16)
    idx = _topk(rng, lens, [1, 1, 1], 256)
    q = jnp.asarray(rng.standard_normal((3, 128, 576)), jnp.bfloat16)
    sl = jnp.asarray(lens, jnp.int32)
    kw = dict(seq_lens=sl, kv_lora_rank=512, backend=backend)
    clean = np.asarray(sparse_mla_attention(q, kv, bt, jnp.asarray(idx), **kw), np.float32)
    bad = idx.copy()
    bad[1, :4] = [300, 383, 1023, -7]  # past seq_len in its last page, on a table entry it does not use, below -1
    bt_bad = bt.at[0, 3].set(-2).at[0, 5].set(kv.shape[0] + 3)  # request 0: keys 192..255 and 320..383 masked
    out = np.asarray(sparse_mla_attention(q, kv, bt_bad, jnp.asarray(bad), **kw), np.float32)
    assert not np.isnan(out).any()
    np.testing.assert_array_equal(out[2], clean[2])
    ref = reference.sparse_mla_attention(q, kv, bt_bad, jnp.asarray(bad), seq_lens=sl, kv_lora_rank=512)
    assert_attention_close(out, ref, dtype=jnp.bfloat16)


@pytest.mark.gpu
def test_mosaic_split_matches_reference(monkeypatch, rng):
    """Each token's top-k list shared by 4 programs per head block, partial outputs merged (the default rule splits
    lists of 1024+ positions of small batches; forced here on a shorter one, with the usual hostile inputs: token 0
    sees nothing, token 1 is a real merge)."""
    from pallas_attn.kernels.mosaic import sparse_mla as sparse_mosaic

    monkeypatch.setattr(sparse_mosaic, "default_splits", lambda *args: 4)
    _check_against_reference(rng, [5000, 3000], None, 128, 576, 512, 64, 512, jnp.bfloat16, backend="mosaic")


@pytest.mark.parametrize("heads, topk, block_size, splits, sinks", [
    (128, 2048, 64, None, False), (64, 100, 16, None, False), (64, 64, 1, None, False), (64, 4096, 64, 1, False),
    (128, 2048, 64, 8, False), (128, 2048, 64, 1, True), (64, 1024, 64, 4, True)])
def test_mosaic_lowers_for_cuda(heads, topk, block_size, splits, sinks):
    """The compiled path's lowering (cp.async gather, wgmma, TMA, barriers → Mosaic GPU MLIR for sm_90), checked
    without a GPU: shared memory fits (q 72 KB + two 72 KB slots + the ring of resolved rows), the inlined gather
    lowers, any top-k (the rows are resolved a tile at a time); sinks loaded in the kernel, or merged after
    splits."""
    import jax

    from pallas_attn.kernels.mosaic import sparse_mla as sparse_mosaic

    S = jax.ShapeDtypeStruct
    topk_p = -(-topk // sparse_mosaic.BLOCK_N) * sparse_mosaic.BLOCK_N
    args = (S((3, heads, 576), jnp.bfloat16), S((40, block_size, 576), jnp.bfloat16), S((3, 40), jnp.int32),
            S((3, topk_p), jnp.int32), S((3,), jnp.int32), S((3,), jnp.int32)) + ((S((heads,), jnp.float32),)
                                                                                  if sinks else ())

    def f(q, kv, bt, ti, tr, tk, *sk):
        return sparse_mosaic.sparse_mla_mosaic(q, kv, bt, ti, tr, tk, *sk, kv_lora_rank=512, scale=0.04,
                                               num_splits=splits)

    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("hopper, interpret, heads, dtype, expected", [
    (True, False, 128, jnp.bfloat16, "mosaic"),
    (True, False, 64, jnp.float16, "mosaic"),
    (True, False, 16, jnp.bfloat16, "triton"),  # heads not a multiple of 64
    (True, False, 128, jnp.float32, "triton"),
    (True, True, 128, jnp.bfloat16, "triton"),  # interpret mode: the Mosaic kernel is compiled only
    (False, False, 128, jnp.bfloat16, "triton"),
])
def test_default_backend_rule(monkeypatch, hopper, interpret, heads, dtype, expected):
    from pallas_attn.core import backend
    from pallas_attn.ops import sparse_mla as sparse

    monkeypatch.setattr(backend, "is_hopper", lambda: hopper)
    q = jnp.zeros((2, heads, 576), dtype)
    assert sparse.default_backend(q, 512, interpret) == expected
    assert sparse.default_backend(jnp.zeros((2, heads, 320), dtype), 256, interpret) == "triton"  # unmeasured


@pytest.mark.parametrize("programs, tiles, expected", [
    (128, 32, 1),  # S1: the batch fills the GPU
    (64, 32, 2),   # 64 programs: half the SMs idle
    (2, 32, 16),   # one token, 128 heads: 32 programs of 2 tiles
    (16, 32, 8),   # 8 tokens: 128 programs of 4 tiles
    (2, 16, 8),    # top-k 1024: still split
    (32, 4, 1),    # top-k 256: the merge would cost more than the split buys
    (6, 1, 1),
])
def test_default_splits(programs, tiles, expected):
    from pallas_attn.kernels.mosaic import sparse_mla as sparse_mosaic

    assert sparse_mosaic.default_splits(programs, tiles, num_sms=132) == expected


def test_mosaic_backend_refuses_what_it_cannot_run():
    q = jnp.ones((2, 16, 576), jnp.bfloat16)
    kv = jnp.ones((4, 4, 576), jnp.bfloat16)
    bt = jnp.zeros((2, 2), jnp.int32)
    idx = jnp.zeros((2, 64), jnp.int32)
    with pytest.raises(ValueError, match="backend='mosaic' does not support"):
        sparse_mla_attention(q, kv, bt, idx, backend="mosaic", interpret=True)
    with pytest.raises(ValueError, match="backend must be one of"):
        sparse_mla_attention(q, kv, bt, idx, backend="cuda")
