"""The benchmark harness runs end to end: ``--tiny`` mode, one workload (P1), one implementation (pallas_attn).

Interpreted on CPU (a few seconds), compiled on a GPU; checks the JSON rows DESIGN.md §4 asks for.
"""

from __future__ import annotations

import json
import math

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
    (ours,) = [r for r in rows if r["workload"] == "P1"]
    assert ours["impl"] == "pallas_attn" and ours["unit"] == "TFLOP/s" and ours["error"] is None
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
