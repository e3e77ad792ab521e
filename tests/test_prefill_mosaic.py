"""varlen_attention(backend="mosaic"): the Hopper kernel (wgmma, TMA, warp specialisation) against the reference.

On CPU the Mosaic GPU interpreter runs it (warpgroups as threads, barriers, TMA and wgmma simulated; ~5 s a case;
freshly allocated buffers start as NaN there, so a row the kernel never writes fails). Each case has a hard time
limit: an interpreted deadlock must fail the test, not stall the suite.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from pallas_attn import DecodeConfig, MosaicPrefillConfig, PrefillConfig, reference, varlen_attention
from pallas_attn.testing import assert_attention_close, random_packed

from .test_lowering import _lower

# name: (lens, num_q_heads, num_kv_heads, head_dim, causal, dtype); query tiles are 64 rows, K/V tiles 128. A
# program takes three (tile, head) items of one request and KV head: with groups 1, 2, 4 and 8 its items span two
# tiles (one K/V step apart when causal), and a request's last program may be part-filled.
SCENARIOS = {
    "edges_gqa2": ([0, 1, 63, 64, 65], 4, 2, 64, True, jnp.bfloat16),
    "long_gqa4_d128": ([130, 1, 200], 8, 2, 128, True, jnp.bfloat16),
    "noncausal_mqa2": ([200, 3], 2, 1, 64, False, jnp.bfloat16),
    "fp16_gqa8": ([127, 129], 8, 1, 64, True, jnp.float16),
    "gqa3_d128": ([65, 192, 2], 6, 2, 128, True, jnp.bfloat16),
    "mha_group1": ([257, 64, 9], 2, 2, 64, True, jnp.bfloat16),
    # request 1 starts at 8: K/V windows 0-2 read in place (full for its last tiles), its partial window 3 staged
    "aligned_long_gqa2": ([8, 400, 3], 4, 2, 64, True, jnp.bfloat16),
    # a narrower head runs zero-padded to the next kernel width: 96 at 128 (Phi-3); 80, 32 and 192 (padded to 256)
    # are in the GPU-only list below, to keep the interpreter's runs few (it deadlocks now and then, on jax 0.12)
    "d96_gqa2": ([70, 3, 130], 4, 2, 96, True, jnp.bfloat16),
    # 256: two compute warpgroups (two items a program), 64-key K/V slots (two of 128 would not fit shared memory)
    "d256_mqa2": ([65, 2], 2, 1, 256, True, jnp.bfloat16),
}
GPU_SCENARIOS = {
    "d80_noncausal": ([65, 9], 2, 1, 80, False, jnp.float16),
    "d32_gqa4": ([64, 1, 100], 4, 1, 32, True, jnp.bfloat16),
    "d192_gqa3": ([70, 130], 6, 2, 192, True, jnp.bfloat16),  # zero-padded to 256; 3 items of a program's 2
}


def _inputs(rng, lens, hq, hkv, d, dtype, pad=3):
    total = sum(lens) + pad
    q, cu = random_packed(rng, lens, hq, d, dtype, pad_to=total)  # padding rows are NaN
    k, _ = random_packed(rng, lens, hkv, d, dtype, pad_to=total)
    v, _ = random_packed(rng, lens, hkv, d, dtype, pad_to=total)
    return q, k, v, cu


@pytest.mark.timeout(300, method="thread")  # an interpreter deadlock fails fast, with stacks
@pytest.mark.parametrize("name", [*SCENARIOS, *(pytest.param(n, marks=pytest.mark.gpu) for n in GPU_SCENARIOS)])
def test_matches_reference(name, rng):
    lens, hq, hkv, d, causal, dtype = {**SCENARIOS, **GPU_SCENARIOS}[name]
    q, k, v, cu = _inputs(rng, lens, hq, hkv, d, dtype)
    out, lse = varlen_attention(q, k, v, cu, max_seqlen=max(lens), causal=causal, return_lse=True,
                                backend="mosaic")
    ref_out, ref_lse = reference.varlen_attention(q, k, v, cu, causal=causal, return_lse=True)
    n = sum(lens)
    assert out.dtype == q.dtype and out.shape == q.shape and lse.shape == q.shape[:2]
    assert_attention_close(out, ref_out, dtype=dtype, valid_rows=n)
    np.testing.assert_allclose(np.asarray(lse)[:n], np.asarray(ref_lse)[:n], rtol=1e-5, atol=1e-4)
    assert np.all(np.asarray(out, np.float32)[n:] == 0) and np.all(np.asarray(lse)[n:] == -np.inf)


@pytest.mark.timeout(300, method="thread")  # an interpreter deadlock fails fast, with stacks
def test_isolation_under_huge_values(rng):
    """One request's K/V set to 1e4 leaves the others' outputs bit-identical (tiles reach past request ends)."""
    lens = [70, 5, 64]
    q, k, v, cu = _inputs(rng, lens, 4, 2, 64, jnp.bfloat16)
    def run(k, v):
        return np.asarray(varlen_attention(q, k, v, cu, max_seqlen=128, backend="mosaic"), np.float32)

    base = run(k, v)
    rows = slice(70, 75)
    k2, v2 = k.at[rows].set(1e4), v.at[rows].set(1e4)
    other = run(k2, v2)
    keep = np.ones(sum(lens), bool)
    keep[rows] = False
    np.testing.assert_array_equal(other[: sum(lens)][keep], base[: sum(lens)][keep])


@pytest.mark.timeout(300, method="thread")  # an interpreter deadlock fails fast, with stacks
@pytest.mark.parametrize("pad, features", [
    (602, None), (600, None),  # T = 736 (K/V read in place), 734 (not whole 8-row groups: K/V padded)
    (602, "all")])  # every feature: ALiBi's column terms and the rows' term after the loop, the sink, the cap
def test_isolation_under_nan(rng, pad, features):
    """NaN in another request's q/k/v rows (which the unaligned tiles and K/V windows load: request starts 3 and 73
    are not multiples of 8) leaves the others' outputs bit-identical; many padding rows (more than one program
    zeroes) come out 0."""
    lens = [3, 70, 61]
    q, k, v, cu = _inputs(rng, lens, 4, 2, 64, jnp.bfloat16, pad=pad)
    kw = _features(rng, features, 4) if features else {}

    def run(q, k, v):
        out, lse = varlen_attention(q, k, v, cu, max_seqlen=128, return_lse=True, backend="mosaic", **kw)
        return np.asarray(out, np.float32), np.asarray(lse)

    base, base_lse = run(q, k, v)
    n = sum(lens)
    assert np.all(base[n:] == 0) and np.all(base_lse[n:] == -np.inf)
    ref = reference.varlen_attention(q, k, v, cu, **kw)
    assert_attention_close(base, ref, dtype=jnp.bfloat16, valid_rows=n)
    rows = slice(3, 73)
    other, other_lse = run(q.at[rows].set(jnp.nan), k.at[rows].set(jnp.nan), v.at[rows].set(jnp.nan))
    keep = np.ones(len(base), bool)
    keep[rows] = False
    np.testing.assert_array_equal(other[keep], base[keep])
    np.testing.assert_array_equal(other_lse[keep], base_lse[keep])


@pytest.mark.timeout(300, method="thread")  # an interpreter deadlock fails fast, with stacks
def test_padding_rounds(rng, monkeypatch):
    """With fewer padding programs than 512-row chunks of padding (MAX_PAD_SLOTS), each loops over rounds: every
    padding row still comes out 0 and the requests' rows stay right."""
    from pallas_attn.kernels.mosaic import prefill as prefill_mosaic
    monkeypatch.setattr(prefill_mosaic, "MAX_PAD_SLOTS", 1)  # shapes no other test uses: a fresh trace
    lens = [37, 9]
    q, k, v, cu = _inputs(rng, lens, 4, 2, 64, jnp.bfloat16, pad=1100)  # 3 rounds of one program
    out = np.asarray(varlen_attention(q, k, v, cu, max_seqlen=64, backend="mosaic"), np.float32)
    n = sum(lens)
    assert np.all(out[n:] == 0)
    assert_attention_close(out, reference.varlen_attention(q, k, v, cu), dtype=jnp.bfloat16, valid_rows=n)


@pytest.mark.parametrize("kw, shapes, match", [
    (dict(), ((8, 4, 64), (8, 2, 64), jnp.float32), "dtype float32"),
    (dict(), ((8, 4, 512), (8, 2, 512), jnp.bfloat16), r"head_dim=512 \(supported: multiples of 8 up to 256\)"),
    (dict(), ((8, 4, 264), (8, 2, 264), jnp.bfloat16), r"head_dim=264 \(supported: multiples of 8 up to 256\)"),
    (dict(backend="cuda"), ((8, 4, 64), (8, 2, 64), jnp.bfloat16), "backend must be one of"),
])
def test_unsupported_inputs_raise(kw, shapes, match):
    (qs, ks, dtype) = shapes
    q, k = jnp.zeros(qs, dtype), jnp.zeros(ks, dtype)
    cu = jnp.asarray([0, 8], jnp.int32)
    with pytest.raises(ValueError, match=match):
        varlen_attention(q, k, k, cu, max_seqlen=8, **{"backend": "mosaic", **kw})


@pytest.mark.parametrize("backend, config, match", [
    ("mosaic", PrefillConfig(), "config must be a MosaicPrefillConfig for backend='mosaic'; got PrefillConfig"),
    ("triton", MosaicPrefillConfig(), "config must be a PrefillConfig for backend='triton'; got MosaicPrefillConfig"),
    (None, DecodeConfig(), r"config must be a PrefillConfig \(backend='triton'\) or MosaicPrefillConfig "
                           r"\(backend='mosaic'\); got DecodeConfig"),
    (None, "fast", "config must be a PrefillConfig .*; got str"),
])
def test_config_of_another_backend_raises(backend, config, match):
    q, k = jnp.zeros((8, 4, 64), jnp.bfloat16), jnp.zeros((8, 2, 64), jnp.bfloat16)
    with pytest.raises(TypeError, match=match):
        varlen_attention(q, k, k, jnp.asarray([0, 8], jnp.int32), max_seqlen=8, backend=backend, config=config)


def test_mosaic_config_selects_the_mosaic_backend():
    """``backend=None`` with a MosaicPrefillConfig runs the Mosaic kernel (here: refuses float32, as it does)."""
    q, k = jnp.zeros((8, 4, 64), jnp.float32), jnp.zeros((8, 2, 64), jnp.float32)
    with pytest.raises(ValueError, match="backend='mosaic' does not support dtype float32"):
        varlen_attention(q, k, k, jnp.asarray([0, 8], jnp.int32), max_seqlen=8, config=MosaicPrefillConfig())


@pytest.mark.parametrize("kw, match", [
    (dict(block_kv=96), r"block_kv=96 must be a power of two in \[64, 128\]"),
    (dict(block_kv=256), r"block_kv=256 must be a power of two in \[64, 128\]"),
    (dict(max_concurrent_steps=1), r"max_concurrent_steps=1 must be in \[2, 8\]"),
    (dict(p_chunks=1), r"p_chunks=1 must be a power of two in \[2, 16\]"),
    (dict(block_kv=64, p_chunks=16), r"p_chunks=16 must be a power of two in \[2, 8\]"),
])
def test_bad_mosaic_config_raises(kw, match):
    with pytest.raises(ValueError, match=match):
        MosaicPrefillConfig(**kw)


@pytest.mark.parametrize("head_dim, config, need", [
    (128, MosaicPrefillConfig(max_concurrent_steps=3), 245760),  # three 128-key slots at head dim 128
    (256, MosaicPrefillConfig(), 327680),  # two 128-key slots at 256 (its default: two of 64 keys)
])
def test_config_past_shared_memory_raises(head_dim, config, need):
    """K/V slots and the three warpgroups' Q/O that outgrow the 227 KB."""
    q, k = jnp.zeros((8, 4, head_dim), jnp.bfloat16), jnp.zeros((8, 2, head_dim), jnp.bfloat16)
    with pytest.raises(ValueError, match=rf"config=MosaicPrefillConfig\(.*\) needs {need} bytes of shared memory at "
                                         rf"head_dim={head_dim}"):
        varlen_attention(q, k, k, jnp.asarray([0, 8], jnp.int32), max_seqlen=8, config=config)


@pytest.mark.parametrize("head_dim, causal, return_lse, num_tokens, config", [
    (128, True, True, 8192, None), (64, False, False, 8195, None),  # 8195: not whole 8-row groups
    (128, True, False, 8192, MosaicPrefillConfig(p_chunks=4)),  # P in 32-column blocks: wgmma-layout slices
    (128, True, False, 8192, MosaicPrefillConfig(block_kv=64, max_concurrent_steps=4)),
    (64, True, True, 8192, MosaicPrefillConfig(block_kv=64, p_chunks=8)),  # 8-column blocks, the narrowest
    (64, True, False, 8192, MosaicPrefillConfig(max_concurrent_steps=3)),  # fits beside 64-wide heads
    (96, True, True, 8195, None),  # zero-padded to 128
    # 256 (two compute warpgroups): lowering it took minutes on jax 0.12's CPU, so it is checked compiled on the GPU
    pytest.param(256, True, True, 8192, None, marks=pytest.mark.gpu),
    pytest.param(256, False, False, 8195, None, marks=pytest.mark.gpu),  # Q padded to whole 8-row groups
])
def test_lowers_for_cuda(head_dim, causal, return_lse, num_tokens, config):
    """The compiled path's lowering (wgmma, TMA, barriers → Mosaic GPU MLIR for sm_90), checked without a GPU at a
    P1-sized shape: what the interpreter does not exercise (tiling/alignment proofs, layouts) fails here."""
    s = jax.ShapeDtypeStruct
    args = (s((num_tokens, 32, head_dim), jnp.bfloat16), s((num_tokens, 8, head_dim), jnp.bfloat16),
            s((num_tokens, 8, head_dim), jnp.bfloat16), s((17,), jnp.int32))
    f = functools.partial(varlen_attention, max_seqlen=4096, causal=causal, return_lse=return_lse, interpret=False,
                          backend="mosaic", config=config)
    text = _lower(f, *args)  # an abstract H200: the staging copy is a Triton kernel, which needs its sm version
    assert "mosaic_gpu" in text



@pytest.mark.parametrize("hopper, interpret, dtype, head_dim, max_seqlen, num_tokens, expected", [
    (True, False, jnp.bfloat16, 128, 1024, 16384, "mosaic"),
    (True, False, jnp.float16, 128, 32768, 32768, "mosaic"),  # P2
    (True, False, jnp.bfloat16, 128, 512, 32768, "mosaic"),  # 64 x 512 tokens: Mosaic measured faster
    (True, False, jnp.bfloat16, 128, 2048, 2048, "mosaic"),  # one request of 2048: Mosaic measured faster
    (True, False, jnp.bfloat16, 128, 1024, 1024, "triton"),  # one request of 1024: a tie, Triton's launch is lighter
    (True, False, jnp.bfloat16, 128, 512, 512, "triton"),  # one request of 512: Triton measured 2x faster
    (True, False, jnp.bfloat16, 128, 256, 32768, "triton"),  # short (and mixed, unaligned) requests: Triton
    (True, False, jnp.bfloat16, 64, 8192, 29184, "mosaic"),  # P1 at head_dim 64: Mosaic measured faster
    (True, False, jnp.bfloat16, 64, 2048, 32768, "mosaic"),  # head_dim 64, 16 x 2048 tokens: Mosaic measured faster
    (True, False, jnp.bfloat16, 64, 1024, 32768, "triton"),  # head_dim 64, 32 x 1024 tokens: Triton measured faster
    (True, False, jnp.bfloat16, 96, 8192, 29184, "triton"),  # Mosaic runs 96, not measured against Triton
    (True, False, jnp.bfloat16, 256, 8192, 29184, "mosaic"),  # Gemma-3 mixed batch: Mosaic measured 1.84x faster
    (True, False, jnp.bfloat16, 256, 16384, 32768, "mosaic"),  # Gemma-3, 2 x 16384: Mosaic measured 2.13x faster
    (True, False, jnp.bfloat16, 256, 256, 32768, "triton"),  # Gemma-3, 128 x 256: Triton measured faster
    (True, False, jnp.bfloat16, 80, 8192, 29184, "triton"),  # zero-padded on Mosaic: not measured either
    (True, False, jnp.bfloat16, 512, 8192, 29184, "triton"),  # the Mosaic kernel does not run it
    (True, False, jnp.float32, 128, 8192, 29184, "triton"),  # the Mosaic kernel is bf16/fp16 only
    (True, True, jnp.bfloat16, 128, 8192, 29184, "triton"),  # interpret mode
    (False, False, jnp.bfloat16, 128, 8192, 29184, "triton"),  # not sm_90
])
def test_default_backend_rule(monkeypatch, hopper, interpret, dtype, head_dim, max_seqlen, num_tokens, expected):
    """``backend=None`` picks the kernel measured faster on the H200 (head dim 256: on an H100) for the shape
    (docs/performance.md#prefill-backend-rule)."""
    from pallas_attn.core import backend
    from pallas_attn.ops import varlen as prefill
    monkeypatch.setattr(backend, "is_hopper", lambda: hopper)
    q, k = (jax.ShapeDtypeStruct((num_tokens, h, head_dim), dtype) for h in (4, 2))
    assert prefill.default_backend(q, k, max_seqlen, interpret) == expected


@settings(max_examples=25, deadline=None, derandomize=True)
@given(lens=st.lists(st.integers(0, 300), min_size=1, max_size=12), extra=st.integers(0, 40),
       causal=st.booleans(), group=st.sampled_from([1, 2, 3, 4, 8]), wgs=st.sampled_from([2, 3]))
def test_work_list_covers_every_item_once(lens, extra, causal, group, wgs):
    """The static work list holds every (request, tile, head) item exactly once, in programs of ``wgs`` (the
    compute warpgroups) consecutive items of one request, heaviest program first, unused slots last (-1);
    ``slot`` inverts the order (the LSE gather relies on it)."""
    from pallas_attn.kernels.mosaic.prefill import BLOCK_Q, ROW_ALIGN, _work_list, num_work_slots
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    num_tokens = int(cu[-1]) + extra
    max_seqlen = max(lens)
    num_slots = num_work_slots(num_tokens, len(lens), max_seqlen, group, wgs)
    req, first, slot, cu_programs, tiles = (np.asarray(x) for x in _work_list(
        jnp.asarray(cu), num_slots, causal, max_seqlen, group, wgs))
    shifts = cu[:-1] % ROW_ALIGN
    np.testing.assert_array_equal(tiles, [-(-(n + s) // BLOCK_Q) if n else 0 for n, s in zip(lens, shifts)])
    used = req >= 0
    assert not used[used.sum():].any()  # unused slots at the end
    items = [(b, i) for b, f in zip(req[used].tolist(), first[used].tolist())
             for i in range(f, min(f + wgs, tiles[b] * group))]
    assert sorted(items) == [(b, i) for b in range(len(lens)) for i in range(tiles[b] * group)]
    keys = [min(-(-min(f + wgs, tiles[b] * group) // group) * BLOCK_Q - shifts[b], lens[b]) if causal
            else lens[b] for b, f in zip(req[used], first[used])]
    assert keys == sorted(keys, reverse=True)
    for b in range(len(lens)):
        for c in range(cu_programs[b + 1] - cu_programs[b]):
            assert (req[slot[cu_programs[b] + c]], first[slot[cu_programs[b] + c]]) == (b, c * wgs)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(lens=st.lists(st.integers(0, 300), min_size=1, max_size=12), extra=st.integers(0, 20),
       block_kv=st.sampled_from([64, 128]))
def test_staged_windows_hold_every_window_not_read_in_place(lens, extra, block_kv):
    """Request b's K/V window j (its keys block_kv · [j, j + 1)) is read in place only where a TMA into tiled shared
    memory can (start a multiple of 8) and the window lies inside the request; every other window is staged, zeros
    past the request's end, within the static staged buffer. Aligned requests stage at most their last window."""
    from pallas_attn.kernels.mosaic.prefill import ROW_ALIGN, _stage_kv
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    num_tokens = max(int(cu[-1]) + extra, 1)  # varlen_attention returns at once on no tokens
    k = np.arange(1, num_tokens + 1, dtype=np.float32)[:, None, None] * np.ones((1, 2, 16), np.float32)
    k_staged, v_staged, kv_stage = (np.asarray(x) for x in _stage_kv(
        jnp.asarray(k), jnp.asarray(-k), jnp.asarray(cu), block_kv, max(lens), interpret=True))
    for b, (start, end) in enumerate(zip(cu[:-1], cu[1:])):
        first_staged, staged0 = kv_stage[2 * b], kv_stage[2 * b + 1]
        num_windows = -(-(end - start) // block_kv)
        if start % ROW_ALIGN == 0:
            assert first_staged >= num_windows - 1
        for j in range(num_windows):
            rows = start + j * block_kv + np.arange(block_kv)
            if j < first_staged:  # in place
                assert start % ROW_ALIGN == 0 and rows[-1] < end
                continue
            want = np.where(rows < end, rows + 1, 0)[:, None, None] * np.ones((1, 2, 16))
            window = slice((staged0 + j - first_staged) * block_kv, (staged0 + j - first_staged + 1) * block_kv)
            assert window.stop <= len(k_staged)
            np.testing.assert_array_equal(k_staged[window], want)
            np.testing.assert_array_equal(v_staged[window], -want)


@pytest.mark.timeout(300, method="thread")  # an interpreter deadlock fails fast, with stacks
@pytest.mark.parametrize("config", [
    MosaicPrefillConfig(p_chunks=4),  # P packed a 32-column block at a time
    MosaicPrefillConfig(block_kv=64, max_concurrent_steps=3),  # causal requests of many K/V steps, a deeper ring
    MosaicPrefillConfig(block_kv=64, p_chunks=8),  # 8-column blocks, the narrowest
], ids=["p_chunks4", "bkv64_mcs3", "bkv64_pc8"])
def test_configs(rng, config):
    """Configs other than the default: the same results. Masked diagonal tiles, K/V windows read in place and
    staged (requests start at 0, 130 and 131), and a request shorter than a block included."""
    lens = [130, 1, 70]
    q, k, v, cu = _inputs(rng, lens, 4, 2, 64, jnp.bfloat16)
    out, lse = varlen_attention(q, k, v, cu, max_seqlen=max(lens), return_lse=True, config=config)
    ref_out, ref_lse = reference.varlen_attention(q, k, v, cu, return_lse=True)
    n = sum(lens)
    assert_attention_close(out, ref_out, dtype=jnp.bfloat16, valid_rows=n)
    np.testing.assert_allclose(np.asarray(lse)[:n], np.asarray(ref_lse)[:n], rtol=1e-5, atol=1e-4)


@pytest.mark.timeout(300, method="thread")  # an interpreter deadlock fails fast, with stacks
@pytest.mark.parametrize("causal", [True, False])
def test_request_past_max_seqlen_is_truncated(rng, causal):
    """A request longer than ``max_seqlen`` breaks the contract: it is truncated to its first ``max_seqlen`` rows,
    queries and keys (its other rows are zeros, LSE -inf, as the reference defines), and the other requests stay
    right: its tiles cannot crowd theirs out of the static work list."""
    lens = [300, 20, 20, 20]
    q, k, v, cu = _inputs(rng, lens, 2, 1, 64, jnp.bfloat16, pad=5)
    out, lse = varlen_attention(q, k, v, cu, max_seqlen=32, causal=causal, return_lse=True,
                                backend="mosaic")  # 4 work slots for 8 tiles
    ref, ref_lse = reference.varlen_attention(q, k, v, cu, max_seqlen=32, causal=causal, return_lse=True)
    assert_attention_close(out, ref, dtype=jnp.bfloat16)
    assert np.all(np.asarray(out, np.float32)[32:300] == 0)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), rtol=1e-5, atol=1e-4)


@pytest.mark.timeout(300, method="thread")  # an interpreter deadlock fails fast, with stacks
def test_rows_before_the_first_request_are_zero(rng):
    """``cu_seqlens[0] > 0``: the rows before it belong to no request and come out zero, LSE -inf."""
    lens = [13, 70, 1]
    q, k, v, cu = _inputs(rng, lens, 4, 2, 64, jnp.bfloat16, pad=3)
    cu = cu.at[0].set(6)  # request 0 is rows 6..12
    out, lse = varlen_attention(q, k, v, cu, max_seqlen=70, return_lse=True, backend="mosaic")
    ref, ref_lse = reference.varlen_attention(q, k, v, cu, max_seqlen=70, return_lse=True)
    assert_attention_close(out, ref, dtype=jnp.bfloat16)
    assert np.all(np.asarray(out, np.float32)[:6] == 0) and np.all(np.asarray(lse)[:6] == -np.inf)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), rtol=1e-5, atol=1e-4)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(cu=st.lists(st.integers(0, 90), min_size=2, max_size=8).map(sorted), extra=st.integers(0, 20),
       max_seqlen=st.integers(1, 40))
def test_zero_ranges_cover_exactly_the_rows_no_program_computes(cu, extra, max_seqlen):
    from pallas_attn.kernels.mosaic.prefill import _zero_ranges
    num_tokens = cu[-1] + extra
    ranges = np.asarray(_zero_ranges(jnp.asarray(cu, jnp.int32), num_tokens, max_seqlen))
    n = ranges[0]
    zeroed = np.zeros(num_tokens, int)
    for lo, hi in ranges[1:1 + 2 * n].reshape(-1, 2):
        assert lo < hi
        zeroed[lo:hi] += 1
    computed = np.zeros(num_tokens, int)
    for start, end in zip(cu[:-1], cu[1:]):
        computed[start:min(end, start + max_seqlen)] += 1
    np.testing.assert_array_equal(zeroed + computed, 1)


# ------------------------------------------------------------------------------------------ model-family features
# Requests at unaligned starts (3, 133), one of a single token, one longer than two K/V tiles of 128: a window
# that cuts inside a tile, tiles a window leaves behind, items of one program whose windows start apart.
FEATURE_LENS = [3, 130, 1, 200]


def _features(rng, name, hq):
    heads = lambda lo, hi: jnp.asarray(rng.uniform(lo, hi, hq), jnp.float32)  # noqa: E731
    return {"w0": dict(window_size=(0, -1)), "w63": dict(window_size=(63, -1)),
            "w130": dict(window_size=(130, -1)), "w5-7": dict(window_size=(5, 7)),
            "softcap": dict(softcap=2.0), "alibi": dict(alibi_slopes=heads(0.01, 0.3)),
            "sinks": dict(sinks=heads(-2, 2)),
            "all": dict(window_size=(40, -1), softcap=3.0, alibi_slopes=heads(0.01, 0.3), sinks=heads(-1, 1))}[name]


@pytest.mark.timeout(300, method="thread")  # an interpreter deadlock fails fast, with stacks
@pytest.mark.parametrize("name, causal, hq, block_kv", [
    ("w0", True, 6, 128), ("w63", True, 4, 64), ("w130", True, 6, 64), ("w5-7", False, 4, 64),
    ("softcap", True, 6, 128), ("alibi", False, 6, 128), ("sinks", True, 6, 128), ("all", True, 4, 64)])
def test_features_match_reference(rng, name, causal, hq, block_kv):
    """Group 2 with 64-key tiles: a program's items are tiles of one request whose windows start on different
    steps (the earlier ones pass over the later ones' first steps)."""
    q, k, v, cu = _inputs(rng, FEATURE_LENS, hq, 2, 64, jnp.bfloat16)
    kw = _features(rng, name, hq)
    out, lse = varlen_attention(q, k, v, cu, max_seqlen=200, causal=causal, return_lse=True, backend="mosaic",
                                config=MosaicPrefillConfig(block_kv=block_kv), **kw)
    ref, ref_lse = reference.varlen_attention(q, k, v, cu, causal=causal, return_lse=True, **kw)
    n = sum(FEATURE_LENS)
    assert_attention_close(out, ref, dtype=jnp.bfloat16, valid_rows=n)
    np.testing.assert_allclose(np.asarray(lse)[:n], np.asarray(ref_lse)[:n], rtol=1e-4, atol=2e-3)
    assert np.all(np.asarray(out, np.float32)[n:] == 0) and np.all(np.asarray(lse)[n:] == -np.inf)


@pytest.mark.timeout(300, method="thread")  # an interpreter deadlock fails fast, with stacks
def test_window_keys_outside_every_window_hold_nan(rng):
    """NaN in the keys of whole K/V tiles a window leaves behind: never loaded (the program's steps start at its
    items' earliest window)."""
    lens = [400]
    q, k, v, cu = _inputs(rng, lens, 4, 2, 64, jnp.bfloat16, pad=0)
    kw = dict(max_seqlen=400, backend="mosaic", window_size=(20, -1))
    out = np.asarray(varlen_attention(q, k, v, cu, **kw), np.float32)
    # rows 320..399 (tiles 5, 6 of 64 rows) see keys from 300 on: K/V tiles 0, 1 (keys 0..255) are outside
    bad = np.asarray(varlen_attention(q, k.at[:256].set(jnp.nan), v.at[:256].set(jnp.nan), cu, **kw), np.float32)
    np.testing.assert_array_equal(bad[320:], out[320:])


@pytest.mark.timeout(120, method="thread")  # Mosaic GPU's layout inference can search for minutes: it must not
@pytest.mark.parametrize("feature", ["window", "all", "alibi"])
def test_features_lower_for_sm90(feature, rng):
    kw = dict(window_size=(4095, 0)) if feature != "alibi" else {}
    if feature == "all":
        kw.update(softcap=50.0)
    heads = [jax.ShapeDtypeStruct((32,), jnp.float32)] * {"window": 0, "all": 2, "alibi": 1}[feature]

    def fn(q, k, v, cu, *h):
        extra = dict(zip(("alibi_slopes", "sinks"), h))
        return varlen_attention(q, k, v, cu, max_seqlen=32768, return_lse=True, interpret=False, backend="mosaic",
                                **kw, **extra)

    text = _lower(fn, jax.ShapeDtypeStruct((32768, 32, 128), jnp.bfloat16),
                  jax.ShapeDtypeStruct((32768, 8, 128), jnp.bfloat16),
                  jax.ShapeDtypeStruct((32768, 8, 128), jnp.bfloat16), jax.ShapeDtypeStruct((2,), jnp.int32), *heads)
    assert "mosaic_gpu" in text
