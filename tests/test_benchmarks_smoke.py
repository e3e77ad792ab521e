"""The benchmark harness runs end to end: ``--tiny`` mode, one workload (P1), one implementation (pallas_attn).

Interpreted on CPU (a few seconds), compiled on a GPU; checks the JSON rows the results format promises, the
``--variant`` and ``--budget`` options, and that a run cut short leaves a readable file. The ``jax_pallas_mgpu``
anchor (GPU only) is checked without a GPU: its per-length-group layout round-trips packed rows exactly, it refuses
what it cannot run, and its P1/P2 function lowers for an abstract H200 (~4 s). The training steps (P1-bwd, P2-bwd)
run with their anchors, their metric counts 3.5 forwards, and their gradient check catches a gradient that leaks.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
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


def test_variant_row_calls_the_public_function_with_its_arguments(tmp_path):
    assert run.main(["--tiny", "--only", "P1", "--impl", "none", "--variant", "bn32:backend=triton,config.block_n=32",
                     "--out", str(tmp_path), "--no-plots"]) == 0
    (path,) = tmp_path.glob("*-tiny.json")
    rows = [r for r in json.loads(path.read_text()) if r["workload"] == "P1"]
    assert [r["impl"] for r in rows] == ["pallas_attn/bn32"]
    assert rows[0]["error"] is None and rows[0]["rel_err"] < 2e-2
    assert rows[0]["note"].startswith("backend=triton,config.block_n=32")


def test_variant_parsing_and_config_fields():
    from benchmarks import variants, workloads as wl
    v = variants.parse("x:num_splits=4,config.block_n=128,config.approx_exp2=false,registers=232/40")
    assert dict(v.kwargs) == {"num_splits": 4, "registers": (232, 40)}
    assert v.fields == (("config", "block_n", 128), ("config", "approx_exp2", False))
    d1, p1, s1 = (wl.WORKLOADS[i] for i in ("D1", "P1", "S1"))
    split = variants.parse("s:num_splits=4,config.block_n=128")
    assert variants.accepts(d1, split) and not variants.accepts(p1, split)
    kw = variants.resolve(d1, split)
    assert kw["num_splits"] == 4 and kw["config"].block_n == 128
    triton = variants.parse("t:backend=triton")
    assert variants.accepts(p1, triton) and variants.accepts(s1, triton)
    with pytest.raises(ValueError, match="no field"):
        variants.resolve(p1, variants.parse("bad:config.nope=1"))
    feats = variants.parse("f:window_size=127/0,softcap=50,sinks=1,alibi=true")
    assert dict(feats.features) == {"window_size": (127, 0), "softcap": 50.0, "sinks": True, "alibi": True}
    assert feats.kwargs == () and variants.accepts(d1, feats) and variants.accepts(p1, feats)
    assert not variants.accepts(s1, feats)  # sparse_mla_attention takes no window
    for bad in ("noname", "a/b:x=1", "n:config=3", "n:other.x=1", "n:x", "n:window_size=3", "n:sinks=2",
                "n:alibi_slopes=1", "n:softcap=x"):
        with pytest.raises(ValueError):
            variants.parse(bad)
    with pytest.raises(ValueError, match="already"):
        variants.make_impls(["triton:backend=triton"], {"pallas_attn/triton"})


@pytest.fixture
def default_row_and_floor(monkeypatch):
    """Only the ``pallas_attn`` row and the jnp floor (keeps interpreted runs to seconds)."""
    from benchmarks import anchors, impls
    picked = [impls.OUR_IMPLS[0], *(i for i in anchors.ANCHORS if i.name == "jnp")]
    monkeypatch.setattr(run.impls_lib, "all_impls", lambda: list(picked))


def test_tiny_model_family_workloads_run_with_their_twins(tmp_path, default_row_and_floor):
    assert run.main(["--tiny", "--only", "W1,W2", "--out", str(tmp_path), "--no-plots", "--target-s", "0.005"]) == 0
    (path,) = tmp_path.glob("*-tiny.json")
    rows = {(r["workload"], r["impl"]): r for r in json.loads(path.read_text()) if r["workload"] != "ceiling"}
    assert set(rows) == {(w, i) for w in ("W1-short", "W1", "P2", "W2") for i in ("pallas_attn", "jnp")}
    for (workload, impl), r in rows.items():
        assert r["error"] is None and r["rel_err"] < 2e-2, (workload, impl, r["error"], r["rel_err"])
    w1, w2 = rows[("W1", "pallas_attn")], rows[("W2", "jnp")]
    assert w1["features"] == {"sinks": True, "window_size": [15, 0]} and w2["features"] == {"window_size": [31, 0]}
    assert w1["twin"] == {"workload": "W1-short", "impl": "pallas_attn"} and w2["twin"]["workload"] == "P2"
    twin = rows[("W1-short", "pallas_attn")]
    assert w1["ratio_to_twin"] == pytest.approx(w1["metric"] / twin["metric"])
    assert w2["ratio_to_twin"] == pytest.approx(w2["metric"] / rows[("P2", "jnp")]["metric"])
    assert "features" not in rows[("P2", "pallas_attn")] and rows[("P2", "pallas_attn")]["ratio_to_twin"] is None


def test_windowed_metrics_count_what_the_window_leaves():
    import numpy as np

    from benchmarks import workloads as wl
    w1, short = (wl.build_host(wl.WORKLOADS[i]) for i in ("W1", "W1-short"))
    assert np.all(w1.keys_read() == 128) and w1.bytes_moved() == short.bytes_moved()  # min(ctx, window) keys
    assert w1.visible_pairs() == 64 * 128 and wl.num_input_sets(w1) > 1  # reads 17 MB of a 4.3 GB pool
    w2, p2 = (wl.build_host(wl.WORKLOADS[i]) for i in ("W2", "P2"))
    brute = sum(min(p + 1, 4096) for p in range(32768))
    assert w2.visible_pairs() == brute and p2.visible_pairs() == 32768 * 32769 // 2
    assert w2.flops() == 4 * brute * 128 * 32


def test_anchors_without_the_features_do_not_run_on_them():
    from benchmarks import impls, variants, workloads as wl
    every = {i.name: i for i in impls.all_impls()}
    for wid in ("W1", "W2"):
        spec = wl.WORKLOADS[wid]
        served = {n for n, i in every.items() if i.serves(spec)}
        assert "jnp" in served and "pallas_attn" in served
        assert not any(every[n].anchor for n in served - {"jnp"}), served
    p1 = wl.WORKLOADS["P1"]
    mosaic = every["pallas_attn/mosaic"]
    assert not mosaic.unsupported(wl.WORKLOADS["W2"])  # the Hopper prefill takes every feature too
    sinks = variants.make_impl(variants.parse("sinks:sinks=1"))
    assert sinks.spec_for(p1).features == {"sinks"} and sinks.twin_impl(p1) == "pallas_attn"
    assert not every["cudnn"].serves(sinks.spec_for(p1))


def test_feature_variant_runs_against_the_plain_row(tmp_path, default_row_and_floor):
    assert run.main(["--tiny", "--only", "D1", "--impl", "pallas_attn", "--variant", "softcap:softcap=50",
                     "--out", str(tmp_path), "--no-plots", "--target-s", "0.005"]) == 0
    (path,) = tmp_path.glob("*-tiny.json")
    rows = {r["impl"]: r for r in json.loads(path.read_text()) if r["workload"] == "D1"}
    assert set(rows) == {"pallas_attn", "pallas_attn/softcap"}
    softcap = rows["pallas_attn/softcap"]
    assert softcap["error"] is None and softcap["rel_err"] < 2e-2 and softcap["features"] == {"softcap": 50.0}
    assert softcap["ratio_to_twin"] == pytest.approx(softcap["metric"] / rows["pallas_attn"]["metric"])


def test_budget_skips_and_says_so(tmp_path, capsys):
    assert run.main(["--tiny", "--only", "P1", "--impl", "pallas_attn", "--budget", "0", "--out", str(tmp_path),
                     "--no-plots"]) == 0
    out = capsys.readouterr().out
    assert "skipped P1/pallas_attn: budget" in out and "skipped for the budget" in out
    (path,) = tmp_path.glob("*-tiny.json")
    assert {r["workload"] for r in json.loads(path.read_text())} == {"ceiling"}  # nothing recorded for P1


def test_run_cut_short_leaves_a_readable_file(tmp_path, monkeypatch):
    calls = []

    def measure_then_die(impl, batches, options, subset, target_s, verbose=False):
        if calls:
            raise KeyboardInterrupt  # the second case: the run is killed
        calls.append(impl.name)
        return run.CaseResult(batches[0].host, median_s=1e-3, wall_s=0.1)

    monkeypatch.setattr(run, "measure_case", measure_then_die)
    with pytest.raises(KeyboardInterrupt):
        run.main(["--tiny", "--only", "P1,P2", "--impl", "pallas_attn", "--out", str(tmp_path), "--no-plots"])
    (path,) = tmp_path.glob("*-tiny.json")
    rows = json.loads(path.read_text())
    assert [(r["workload"], r["impl"]) for r in rows if r["workload"] != "ceiling"] == [("P1", calls[0])]
    assert rows[-1]["metric"] > 0 and rows[-1]["ratio_to_ceiling"] > 0 and rows[-1]["wall_s"] == 0.1
    assert not list(tmp_path.glob(".*.tmp"))


def test_impl_selector_matches_variants_and_rejects_unknown():
    from benchmarks import impls
    names = [i.name for i in impls.select(impls.all_impls(), ["pallas_attn"])]
    assert "pallas_attn" in names and "pallas_attn/no_split" in names and "jnp" not in names
    assert [i.name for i in impls.select(impls.all_impls(), ["pallas_attn/paged"])] == ["pallas_attn/paged"]
    with pytest.raises(ValueError, match="unknown implementations"):
        impls.select(impls.all_impls(), ["nope"])
    assert impls.select(impls.all_impls(), ["none"]) == []


def test_families_and_ids():
    from benchmarks import workloads as wl
    rule = wl.prefill_rule_specs()
    assert len({s.id for s in rule}) == len(rule) and all(s.family == "prefill-rule" for s in rule)
    mixed = wl.build_host(wl.find_spec("mixed-128x1-256"))
    assert mixed.num_tokens == 17757  # the shape of results/lab/prefill-backend-rule-short.json
    assert wl.find_spec("P1") is wl.WORKLOADS["P1"] and wl.find_spec("nope") is None
    args = run.parse_args(["--only", "p1,one-512", "--family", "sparse-shapes"])
    ids = [s.id for s in run._selected_specs(args)]
    assert ids[:2] == ["P1", "one-512"] and all(i.startswith("sparse-") for i in ids[2:])
    assert [s.id for s in run._selected_specs(run.parse_args(["--split-sweep"]))][0] == "split-b1-c1024"
    assert run.parse_args(["--grid", "models"]).family == "models"  # pallas-attn bench --grid models
    mla = wl.mla_shape_specs()
    assert len({s.id for s in mla}) == len(mla) == len(wl.MLA_SHAPES)
    assert all(s.kind == "mla" and s.family == "mla-shapes" for s in mla)
    assert wl.build_host(wl.find_spec("mla-b32-c4096-h128-q2")).num_tokens == 64


def test_standard_workloads_match_their_definition():
    import numpy as np

    from benchmarks import workloads as wl
    d1 = wl.build_host(wl.WORKLOADS["D1"])
    assert np.array_equal(d1.seq_lens, np.random.default_rng(0).integers(1024, 8193, 64))
    owned = np.concatenate([d1.block_tables[b, :-(-int(n) // 16)] for b, n in enumerate(d1.seq_lens)])
    assert d1.num_pages == owned.size and np.array_equal(np.sort(owned), np.arange(d1.num_pages))  # exact pool
    v1 = wl.build_host(wl.WORKLOADS["V1"])
    assert np.array_equal(v1.seq_lens, np.random.default_rng(1).integers(4096, 16385, 32))
    assert v1.num_tokens == 32 * 6
    p1 = wl.build_host(wl.WORKLOADS["P1"])
    assert p1.num_tokens == 29184 and p1.flops() == 4 * sum(n * (n + 1) // 2 for n in p1.seq_lens) * 128 * 32


# ------------------------------------------------------------------------------------ dense MLA (L1, L2)
def test_tiny_mla_workloads_run_with_their_anchors(tmp_path):
    """L1 (decode, no cu_query_lens) and L2 (two causal new tokens per request): ours (the default and the Triton
    kernel's row), the jnp floor and the sparse kernel over every position all match the reference;
    paged_attention/latent sits them out (576 > 512 dims)."""
    assert run.main(["--tiny", "--only", "L1,L2", "--out", str(tmp_path), "--no-plots", "--target-s", "0.005"]) == 0
    (path,) = tmp_path.glob("*-tiny.json")
    rows = [r for r in json.loads(path.read_text()) if r["workload"] != "ceiling"]
    ours = ("pallas_attn", "pallas_attn/triton")
    impls = (*ours, "jnp", "sparse_mla_attention/all")
    assert {(r["workload"], r["impl"], r["unit"]) for r in rows} == {
        (w, i, u) for w in ("L1", "L2") for i in impls for u in ("GB/s", "TFLOP/s")}
    for r in rows:
        assert r["error"] is None and r["rel_err"] < 2e-2, (r["workload"], r["impl"], r["error"], r["rel_err"])
        assert r["kind"] == "mla" and r["anchor"] == (r["impl"] not in ours)
        assert r["metric"] > 0 and r["ratio_to_ceiling"] > 0 and r["ratio_to_best_anchor"] > 0


def test_mla_workloads_match_their_definition():
    import numpy as np

    from benchmarks import anchors, sweep, workloads as wl
    l1, l2 = (wl.build_host(wl.WORKLOADS[i]) for i in ("L1", "L2"))
    assert np.array_equal(l1.seq_lens, np.random.default_rng(0).integers(4096, 8193, 128))
    assert l1.one_token_each and l1.num_tokens == 128 and l1.spec.num_q_heads == 16
    assert l1.bytes_moved() == l1.seq_lens.sum() * 576 * 2  # the latent rows, each read once
    assert l1.flops() == l1.seq_lens.sum() * 16 * (2 * 576 + 2 * 512)
    assert not l2.one_token_each and l2.num_tokens == 128 and l2.max_query_len == 2
    pairs = 64 * (8191 + 8192)  # causal: the first new token sees 8191 keys, the second all 8192
    assert l2.visible_pairs() == pairs and l2.flops() == pairs * 128 * (2 * 576 + 2 * 512)
    topk = anchors.all_positions_topk(l2)  # every key a token sees, ascending, -1 after
    assert topk.shape == (128, 8192) and int(np.sum(topk >= 0)) == pairs
    assert np.array_equal(topk[0, :8191], np.arange(8191)) and topk[0, 8191] == -1 and topk[1, 8191] == 8191
    assert all(e["config"].block_h <= 16 for e in sweep.stage1(l1.spec, tiny=False))  # L1 has 16 heads
    assert sweep.stage2(l2.spec, sweep.stage1(l2.spec, tiny=True)[0], tiny=True)[1]["num_splits"] == 2


def test_paged_attention_anchor_runs_mla_below_its_head_dim_limit():
    """paged_attention/latent serves no 576-dim workload (the limit, not an error row); with a latent of 96 dims
    (64 values) it runs and matches reference.mla_attention."""
    import dataclasses as dc

    import jax

    from benchmarks import anchors, checks, impls, workloads as wl
    (paged,) = [i for i in anchors.ANCHORS if i.name == "paged_attention/latent"]
    assert not paged.serves(wl.WORKLOADS["L1"]) and paged.unsupported(wl.WORKLOADS["L2"]) == {"head_dim 576 > 512"}
    narrow = dc.replace(wl.TINY_WORKLOADS["L2"], head_dim=96, kv_lora_rank=64)
    assert paged.serves(narrow)
    batch = wl.build_arrays(wl.build_host(narrow), jax.random.key(0))
    prepared = paged.prepare([batch], impls.Options(interpret=True, tiny=True))
    out = prepared.canonical(prepared.fn(*prepared.args[0]))
    assert out.shape == (batch.host.num_tokens, narrow.num_q_heads, 64)
    assert checks.rel_err(out, checks.reference_subset(batch)) < 2e-2


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

    def through_fp16(x):
        return np.asarray(x.astype(jnp.float16).astype(s.jnp_dtype))

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

    def shapes(h):
        return tuple(jax.ShapeDtypeStruct((*r.shape, h, s.head_dim), jnp.float16) for r in rows)

    text = _lower(fn, shapes(s.num_q_heads), shapes(s.num_kv_heads), shapes(s.num_kv_heads))
    assert text.count("custom_call @mosaic_gpu") == len(rows)


def test_baseline_resolves_revisions_and_passes_the_selection_on():
    from benchmarks import baseline
    try:
        head = baseline.resolve("HEAD")
    except ValueError:
        pytest.skip("not a git checkout")
    assert head and all(c in "0123456789abcdef" for c in head)
    with pytest.raises(ValueError, match="not a revision"):
        baseline.resolve("no-such-revision-anywhere")
    args = run.parse_args(["--tiny", "--only", "P1", "--family", "split", "--no-check"])
    passed = run._baseline_args(args, run._selected_specs(args), 0.02)
    assert passed[:2] == ["--only", "P1,split-b1-c32,split-b1-c128,split-b2-c32,split-b2-c128"]
    assert "--tiny" in passed and "--no-check" in passed


def test_budget_estimates_prefer_what_was_measured(tmp_path):
    from benchmarks import workloads as wl
    p1, p2 = wl.WORKLOADS["P1"], wl.WORKLOADS["P2"]
    rows = [{"workload": "P1", "impl": "jnp", "unit": "TFLOP/s", "wall_s": 42.0, "setup_s": 7.0, "target_s": 0.5},
            {"workload": "P2", "impl": "jnp", "unit": "TFLOP/s", "wall_s": 99.0, "setup_s": 9.0, "target_s": 0.2}]
    (tmp_path / "2026-12-03-nvidia-h200.json").write_text(json.dumps(rows))
    est = run.Estimates.load(tmp_path, "nvidia-h200", tiny=False, target_s=0.5)
    assert est.case(p1, "jnp") == 42.0 and est.setup(p1) == 7.0
    assert est.case(p2, "jnp") == run.CASE_S["P2"] and est.setup(p2) == run.SETUP_S["P2"]  # other --target-s
    assert run.Estimates(0.5).case(wl.prefill_rule_specs()[0], "pallas_attn") == run.FAMILY_CASE_S


def test_lab_ab_times_a_model_family_feature(tmp_path, monkeypatch):
    """``benchmarks.lab.ab --b softcap=50``: the feature's cost, B with the feature on the same batch (no output
    difference recorded: B computes something else); ``--unroll`` wraps both."""
    from benchmarks.lab import ab

    monkeypatch.setenv("OUT", str(tmp_path))
    assert ab.main(["--b", "softcap=50", "--only", "D1", "--tiny", "--reps", "1", "--unroll", "2",
                    "--json", "feature.json"]) == 0
    [row] = json.loads((tmp_path / "feature.json").read_text())["rows"]
    assert row["workload"] == "D1" and row["rel_l2_b_vs_a"] is None and math.isfinite(row["gain"])


def test_lab_ab_against_another_checkout(tmp_path, monkeypatch, capsys):
    """``--a-tree DIR``: A runs the packages of another checkout in the same process (here a copy of this one: the
    same outputs), and this checkout's modules are back in ``sys.modules`` afterwards."""
    import shutil
    import sys

    import pallas_attn
    from benchmarks.lab import ab

    root = pathlib.Path(__file__).resolve().parents[1]
    tree = tmp_path / "tree"
    for package in ("pallas_attn", "benchmarks"):
        shutil.copytree(root / package, tree / package, ignore=shutil.ignore_patterns("__pycache__", "results"))
    monkeypatch.setenv("OUT", str(tmp_path))
    assert ab.main(["--a-tree", str(tree), "--b", "default", "--only", "D1", "--tiny", "--reps", "1",
                    "--json", "tree.json"]) == 0
    assert f"A: pallas_attn from {tree / 'pallas_attn'}" in capsys.readouterr().out
    doc = json.loads((tmp_path / "tree.json").read_text())
    [row] = doc["rows"]
    assert doc["a_tree"] == str(tree) and row["rel_l2_b_vs_a"] == 0.0
    assert sys.modules["pallas_attn"] is pallas_attn


def test_lab_program_cost(tmp_path, monkeypatch):
    """``benchmarks.lab.program_cost --tiny``: a row per backend and tile count, a line fitted through them, the
    JSON written as it goes."""
    from benchmarks.lab import program_cost

    monkeypatch.setenv("OUT", str(tmp_path))
    assert program_cost.main(["--tiny", "--backends", "triton"]) == 0
    doc = json.loads((tmp_path / "program-cost.json").read_text())
    assert [(r["backend"], r["tiles"]) for r in doc["rows"]] == [("triton", 1), ("triton", 2)]
    assert all(math.isfinite(r["median_us"]) and r["median_us"] > 0 for r in doc["rows"])
    assert set(doc["fits"]) == {"triton"} and math.isfinite(doc["fits"]["triton"]["program_fixed_us"])


def test_model_grid(tmp_path):
    """``--family models``: the model-shaped grid (decode batch × context per model, causal prefill batches,
    bidirectional encoder prefill) within its K/V memory cap; a bidirectional cell counts every pair and its rows
    are checked against the non-causal reference."""
    from benchmarks import workloads as wl

    specs = wl.model_grid_specs()
    ids = {s.id for s in specs}
    assert len(ids) == len(specs)
    assert {"llama70b-tp8-decode-b256-c8192-bs16", "gemma3-prefill-few-long", "enc-d128-prefill-few",
            "llama8b-decode-b1-c131072-bs64"} <= ids
    decode = [s for s in specs if s.kind == "decode"]
    for s in decode:
        lens = s.groups[0].seq_lens
        n, longest = (lens.n, lens.high) if isinstance(lens, wl.Draw) else (len(lens), max(lens))
        assert 2 * n * longest * s.num_kv_heads * s.head_dim * 2 <= wl.MODEL_KV_BYTES, s.id
    assert {"gptoss-decode-b64-mixed-bs16", "llama8b-decode-b64-mixed-bs16"} <= ids
    encoder = wl.build_host(next(s for s in specs if s.id == "enc-d64-prefill-many"))
    assert encoder.visible_pairs() == 64 * 512 * 512
    assert run.main(["--tiny", "--family", "models", "--impl", "pallas_attn", "--out", str(tmp_path), "--no-plots",
                     "--target-s", "0.005"]) == 0
    rows = json.loads(next(tmp_path.glob("*-tiny.json")).read_text())
    assert {r["workload"] for r in rows} - {"ceiling"} == {s.id for s in wl.model_grid_specs(tiny=True)}
    assert all(r["rel_err"] is not None and r["rel_err"] < 1e-2 for r in rows if r["impl"] == "pallas_attn")


def test_model_grid_cells_have_their_anchors():
    """Each cell of the model grid is run by the anchors of its kind, so it gets a ratio to the best anchor: the
    causal prefill cells by cuDNN and JAX's Mosaic GPU attention, the decode cells by cuDNN's paged attention and
    JAX's Pallas decode and paged kernels; the bidirectional encoder cells by none (these anchors attend
    causally)."""
    from benchmarks import anchors, workloads as wl

    by_name = {a.name: a for a in anchors.ANCHORS}
    for s in wl.model_grid_specs():
        runs = {n for n, a in by_name.items() if a.applies(s) and n != "jnp"}
        if s.kind == "decode":
            assert runs == {"cudnn/paged", "jax_pallas_decode", "jax_pallas_paged"}, s.id
        elif s.causal:
            assert runs == {"cudnn", "jax_pallas_mgpu"}, s.id
        else:
            assert not runs, s.id


# ------------------------------------------------------------------------------------ training steps (P1-bwd, P2-bwd)
def test_training_steps_are_the_prefill_batches_at_three_and_a_half_forwards():
    from benchmarks import workloads as wl
    for tiny in (False, True):
        table = wl.TINY_WORKLOADS if tiny else wl.WORKLOADS
        for wid in ("P1", "P2"):
            fwd, step = table[wid], table[f"{wid}-bwd"]
            assert step.kind == "prefill-bwd"
            assert dataclasses.replace(step, id=wid, kind="prefill", what=fwd.what) == fwd  # groups, heads, seed
            h_fwd, h_step = wl.build_host(fwd), wl.build_host(step)
            assert h_step.flops() == 3.5 * h_fwd.flops() and not h_step.paged
    p1 = wl.build_host(wl.WORKLOADS["P1-bwd"])
    assert p1.flops() == 14 * sum(n * (n + 1) // 2 for n in p1.seq_lens) * 128 * 32
    assert {"P1-bwd", "P2-bwd"} <= set(run.STANDARD_IDS)
    assert [s.id for s in run._selected_specs(run.parse_args(["--only", "p1-bwd"]))] == ["P1-bwd"]


def test_tiny_training_steps_run_with_their_anchors(tmp_path):
    """Ours, mha's Triton VJP and the jnp floor's autodiff match the reference gradients; cuDNN and tokamax say why
    they cannot run where they cannot (no cuDNN on a CPU, no tokamax package)."""
    from benchmarks import workloads as wl
    assert run.main(["--tiny", "--only", "P1-bwd,P2-bwd", "--out", str(tmp_path), "--no-plots",
                     "--target-s", "0.005"]) == 0
    (path,) = tmp_path.glob("*-tiny.json")
    rows = {(r["workload"], r["impl"]): r for r in json.loads(path.read_text()) if r["workload"] != "ceiling"}
    impls = {"pallas_attn", "pallas_attn/triton", "cudnn", "jax_pallas_mha", "tokamax_mosaic", "jnp"}
    assert set(rows) >= {(w, i) for w in ("P1-bwd", "P2-bwd") for i in impls}
    for (workload, impl), r in rows.items():
        assert r["kind"] == "prefill-bwd" and r["unit"] == "TFLOP/s"
        if impl in ("pallas_attn", "pallas_attn/triton", "jax_pallas_mha", "jnp"):
            assert r["error"] is None, (workload, impl, r["error"])
        if r["error"] is None:
            assert r["rel_err"] < 2e-2, (workload, impl, r["rel_err"])
            host = wl.build_host(wl.TINY_WORKLOADS[workload])
            assert r["metric"] == pytest.approx(host.flops() / (r["median_ms"] * 1e-3) / 1e12)
    tokamax = rows[("P1-bwd", "tokamax_mosaic")]
    assert tokamax["error"] is None or "tokamax" in tokamax["error"] or "GPU only" in tokamax["error"]


def test_training_step_check_covers_every_row():
    """The check keeps the cotangent on prefixes of three requests; the reference's gradients there are exact and
    every other row's gradient must be zero: a gradient that leaks past a prefix is caught."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks import checks, workloads as wl
    spans = checks._grad_spans(wl.build_host(wl.WORKLOADS["P1-bwd"]))
    # in packed order: the longest (8192) and a middle request (1024) their first GRAD_ROWS, the shortest whole
    assert [m for _, m in spans] == [checks.GRAD_ROWS, checks.GRAD_ROWS, 256]
    batch = wl.build_arrays(wl.build_host(wl.TINY_WORKLOADS["P1-bwd"]), jax.random.key(0))
    subset = checks.reference_subset(batch)
    kept = np.asarray(jnp.any(checks.check_cotangent(batch) != 0, axis=(1, 2)))
    assert np.array_equal(np.flatnonzero(kept), subset.rows)  # tiny requests are whole: 7, 17 and 48 rows
    T = batch.host.num_tokens
    exact = []
    for ref in subset.refs:
        full = np.zeros((T, *ref.shape[1:]), np.float32)
        full[subset.rows] = ref
        exact.append(jnp.asarray(full))
    assert checks.rel_err(tuple(exact), subset) == 0.0
    outside = int(np.flatnonzero(~kept)[0])
    leaked = (exact[0], exact[1].at[outside].add(1.0), exact[2])
    assert checks.rel_err(leaked, subset) > 0.1


def test_training_step_sweep_and_variants_set_the_backward_tiles(tmp_path):
    from benchmarks import sweep, variants, workloads as wl
    from pallas_attn.core import config as config_lib
    p1, step = wl.WORKLOADS["P1"], wl.WORKLOADS["P1-bwd"]
    grid = sweep.stage1(step, tiny=False)
    assert len(grid) == 36 and all(set(e) == {"backward_config"} for e in grid)
    assert sweep.label(grid[0]).startswith("backward_config: block_m=32")
    v = variants.parse("bwd:backward_config.block_n=64")
    assert variants.accepts(step, v) and not variants.accepts(p1, v)
    assert variants.resolve(step, v)["backward_config"] == dataclasses.replace(
        config_lib.default_backward_config(128), block_n=64)
    assert run.main(["--tiny", "--sweep", "--only", "P1-bwd", "--out", str(tmp_path), "--target-s", "0.005"]) == 0
    (path,) = tmp_path.glob("*-sweep.json")
    results = json.loads(path.read_text())["workloads"]["P1-bwd"]["results"]
    assert [e["stage"] for e in results] == ["default", "1", "1"]
    assert all(e["error"] is None and e["rel_err"] < 2e-2 for e in results)
    assert results[1]["backward_config"]["block_m"] == 16


@pytest.mark.parametrize("impl", ["pallas_attn/mosaic", "jax_pallas_mha"])
def test_training_step_lowers_for_h200_at_p1(impl):
    """P1-bwd at its real shapes, compiled for an abstract H200: our Mosaic forward and backward kernels, and mha's
    backward over the 29,184-token packed row (its tiles must divide it)."""
    import jax

    from benchmarks import impls, workloads as wl
    from tests.test_lowering import _lower
    batch = wl.build_arrays(wl.build_host(wl.WORKLOADS["P1-bwd"]), jax.random.key(0))
    prepared = {i.name: i for i in impls.all_impls()}[impl].prepare([batch], impls.Options(interpret=False))
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), prepared.args[0])
    text = _lower(prepared.fn, *shapes)
    if impl == "pallas_attn/mosaic":  # the forward and the backward's dK / dV and dQ kernels
        assert text.count("mosaic_gpu") >= 3
    else:  # mha's fused backward and its dO·O kernel
        assert text.count("__gpu$xla.gpu.triton") >= 2 and "mosaic_gpu" not in text
