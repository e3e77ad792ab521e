"""The benchmark harness runs end to end: ``--tiny`` mode, one workload (P1), one implementation (pallas_attn).

Interpreted on CPU (a few seconds), compiled on a GPU; checks the JSON rows DESIGN.md §4 asks for. The
``jax_pallas_mgpu`` anchor (GPU only) is checked without a GPU: its per-length-group layout round-trips packed rows
exactly, it refuses what it cannot run, and its P1/P2 function lowers for an abstract H200 (~4 s).
"""

from __future__ import annotations

import dataclasses
import json
import math
import types

import pytest

run = pytest.importorskip("benchmarks.run")

ROW_FIELDS = {"workload", "impl", "median_ms", "metric", "unit", "rel_err", "ratio_to_ceiling",
              "ratio_to_best_anchor", "device", "versions", "date"}


def test_tiny_p1_pallas_attn_writes_rows(tmp_path, capsys):
    assert run.main(["--tiny", "--only", "P1", "--impl", "pallas_attn", "--out", str(tmp_path), "--no-plots"]) == 0
    files = list(tmp_path.glob("*-tiny.json"))
    assert len(files) == 1, files
    rows = json.loads(files[0].read_text())
    for row in rows:
        assert ROW_FIELDS <= set(row), ROW_FIELDS - set(row)
    ceilings = {r["unit"] for r in rows if r["workload"] == "ceiling"}
    assert ceilings == {"TFLOP/s", "GB/s"}
    assert {r["impl"] for r in rows if r["workload"] == "P1"} == {"pallas_attn", "pallas_attn/triton"}  # + variant
    (ours,) = [r for r in rows if r["workload"] == "P1" and r["impl"] == "pallas_attn"]
    assert ours["unit"] == "TFLOP/s" and ours["error"] is None
    assert ours["median_ms"] > 0 and ours["metric"] > 0 and ours["ratio_to_ceiling"] > 0
    assert ours["ratio_to_best_anchor"] is None  # no anchor was selected
    assert math.isfinite(ours["rel_err"]) and ours["rel_err"] < 2e-2
    assert ours["versions"]["jax"] and ours["date"] and ours["device"]
    out = capsys.readouterr().out
    assert "P1" in out and "pallas_attn" in out


def test_impl_selector_matches_variants_and_rejects_unknown():
    from benchmarks import impls
    names = [i.name for i in impls.select(impls.all_impls(), ["pallas_attn"])]
    assert "pallas_attn" in names and "pallas_attn/no_split" in names and "jnp" not in names
    assert [i.name for i in impls.select(impls.all_impls(), ["pallas_attn/paged"])] == ["pallas_attn/paged"]
    with pytest.raises(ValueError, match="unknown implementations"):
        impls.select(impls.all_impls(), ["nope"])


def test_standard_workloads_match_design():
    from benchmarks import workloads as wl
    import numpy as np
    d1 = wl.build_host(wl.WORKLOADS["D1"])
    assert np.array_equal(d1.seq_lens, np.random.default_rng(0).integers(1024, 8193, 64))
    owned = np.concatenate([d1.block_tables[b, :-(-int(n) // 16)] for b, n in enumerate(d1.seq_lens)])
    assert d1.num_pages == owned.size and np.array_equal(np.sort(owned), np.arange(d1.num_pages))  # exact pool
    v1 = wl.build_host(wl.WORKLOADS["V1"])
    assert np.array_equal(v1.seq_lens, np.random.default_rng(1).integers(4096, 16385, 32))
    assert v1.num_tokens == 32 * 6
    p1 = wl.build_host(wl.WORKLOADS["P1"])
    assert p1.num_tokens == 29184 and p1.flops() == 4 * sum(n * (n + 1) // 2 for n in p1.seq_lens) * 128 * 32


# ------------------------------------------------------------------------------------ jax_pallas_mgpu anchor
P1_GROUPS = [(2, 256), (4, 512), (4, 1024), (3, 2048), (2, 4096), (1, 8192)]  # (requests, length), lengths ascending


def _small_heads(spec):
    """The workload's lengths with few, mgpu-legal heads: the layout work runs on CPU in a second."""
    return dataclasses.replace(spec, num_q_heads=2, num_kv_heads=1, head_dim=64)


def test_jax_pallas_mgpu_groups_round_trip_p1():
    import jax
    import jax.numpy as jnp
    import numpy as np
    from benchmarks import anchors, impls, workloads as wl
    host = wl.build_host(_small_heads(wl.WORKLOADS["P1"]))
    rows, inverse = anchors._length_groups(host)
    assert [r.shape for r in rows] == P1_GROUPS
    for r in rows:  # each group row is one whole request, in packed order
        starts = r[:, 0]
        assert set(starts) <= set(host.cu_query_lens[:-1].tolist())
        assert np.array_equal(r, starts[:, None] + np.arange(r.shape[1])[None, :])
    packed = np.arange(host.num_tokens)
    assert np.array_equal(np.asarray(anchors._ungroup([packed[r] for r in rows], inverse)), packed)

    batch = wl.build_arrays(host, jax.random.key(0))
    prepared = anchors._prepare_jax_mgpu([batch], impls.Options(interpret=False))
    qs, ks, vs = prepared.args[0]
    s = host.spec
    assert [q.shape for q in qs] == [(*g, s.num_q_heads, s.head_dim) for g in P1_GROUPS]
    assert [k.shape for k in ks] == [(*g, s.num_kv_heads, s.head_dim) for g in P1_GROUPS]
    assert all(x.dtype == jnp.float16 for x in (*qs, *ks, *vs))
    a = batch.arrays
    through_fp16 = lambda x: np.asarray(x.astype(jnp.float16).astype(s.jnp_dtype))
    assert np.array_equal(np.asarray(prepared.canonical(ks)), through_fp16(a["k"]))
    assert np.array_equal(np.asarray(prepared.canonical(vs)), through_fp16(a["v"]))
    scaled_q = a["q"].astype(jnp.float32) * (1 / math.sqrt(s.head_dim))
    assert np.array_equal(np.asarray(prepared.canonical(qs)), through_fp16(scaled_q))
    assert "6 call(s)" in prepared.note


@pytest.mark.parametrize("tiny, interpret, lengths, match", [
    (True, True, None, "GPU only"),
    (True, False, None, "head_dim"),
    (False, False, (256, 96), "multiple of 128"),
])
def test_jax_pallas_mgpu_refuses(tiny, interpret, lengths, match):
    import jax
    from benchmarks import anchors, impls, workloads as wl
    spec = (wl.TINY_WORKLOADS if tiny else wl.WORKLOADS)["P1"]
    if lengths is not None:
        spec = _small_heads(dataclasses.replace(spec, groups=(wl.Group(lengths),)))
    batch = wl.build_arrays(wl.build_host(spec), jax.random.key(0))
    with pytest.raises(NotImplementedError, match=match):
        anchors._prepare_jax_mgpu([batch], impls.Options(interpret=interpret, tiny=tiny))


@pytest.mark.parametrize("workload", ["P1", "P2"])
def test_jax_pallas_mgpu_lowers_for_h200(workload, monkeypatch):
    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.gpu import attention_mgpu
    from benchmarks import anchors, workloads as wl
    from tests.test_lowering import _lower
    # a CPU jaxlib has no CUDA runtime to report; the kernel asks only to refuse causal on CUDA 12.8.0..12.9.0
    monkeypatch.setattr(attention_mgpu, "cuda_versions", types.SimpleNamespace(cuda_runtime_get_version=lambda: 12091))
    s = wl.WORKLOADS[workload]
    rows, _ = anchors._length_groups(wl.build_host(s))
    fn = anchors._mgpu_fn(attention_mgpu.TuningConfig(**anchors.MGPU_CONFIG, causal=True))
    shapes = lambda h: tuple(jax.ShapeDtypeStruct((*r.shape, h, s.head_dim), jnp.float16) for r in rows)
    text = _lower(fn, shapes(s.num_q_heads), shapes(s.num_kv_heads), shapes(s.num_kv_heads))
    assert text.count("custom_call @mosaic_gpu") == len(rows)
