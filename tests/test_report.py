"""``benchmarks.report``: the README's performance table is exactly what the report prints for the file it names,
and the report's numbers are the results file's."""

from __future__ import annotations

import json
import pathlib
import re

import pytest

report = pytest.importorskip("benchmarks.report")

ROOT = pathlib.Path(__file__).resolve().parent.parent
CANONICAL = ROOT / "benchmarks" / "results" / "2026-11-30-nvidia-h200.json"
BLOCK = re.compile(r"<!-- benchmarks\.report (?P<file>\S+) -->\n(?P<table>.*?)<!-- /benchmarks\.report -->", re.S)


def test_readme_table_is_the_report_of_its_file():
    readme = (ROOT / "README.md").read_text()
    match = BLOCK.search(readme)
    if match is None:
        pytest.fail("README.md has no generated performance table. Add, where the table belongs:\n"
                    "<!-- benchmarks.report benchmarks/results/<FILE>.json -->\n"
                    "<the output of: python -m benchmarks.report benchmarks/results/<FILE>.json>\n"
                    "<!-- /benchmarks.report -->")
    expected = report.render(ROOT / match["file"])
    assert match["table"].strip() == expected.strip(), (
        f"README.md's table differs from the report of {match['file']}: regenerate it with "
        f"python -m benchmarks.report {match['file']}")


def _table_rows(text: str) -> dict[str, list[str]]:
    rows = {}
    for line in text.splitlines():
        if line.startswith("| ") and not line.startswith("| workload"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows[cells[0].split(":")[0]] = cells
    return rows


def test_report_of_the_canonical_run_has_every_workload_with_its_numbers():
    text = report.render(CANONICAL)
    rows = _table_rows(text)
    assert list(rows) == ["P1", "P2", "D1", "D2", "V1", "M1", "S1"]
    data = json.loads(CANONICAL.read_text())

    def metric(workload, impl, unit):
        (row,) = [r for r in data if (r["workload"], r["impl"], r["unit"]) == (workload, impl, unit)]
        return row["metric"]

    matmul, copy = metric("ceiling", "matmul_bf16_8192", "TFLOP/s"), metric("ceiling", "copy", "GB/s")
    assert text.splitlines()[0].startswith("NVIDIA H200, 2026-11-30; jax 0.11.2")
    assert f"bf16 matmul {matmul:.0f} TFLOP/s" in text and f"copy {copy:,.0f} GB/s" in text

    p1, cudnn_packed = metric("P1", "pallas_attn", "TFLOP/s"), metric("P1", "cudnn/packed", "TFLOP/s")
    assert rows["P1"][1:] == [f"{p1:.0f} TFLOP/s", f"cudnn/packed {cudnn_packed:.0f} TFLOP/s",
                              f"×{p1 / cudnn_packed:.2f}", f"{p1 / matmul:.2f}"]
    d1, decode = metric("D1", "pallas_attn", "GB/s"), metric("D1", "jax_pallas_decode", "GB/s")
    assert d1 > metric("D1", "pallas_attn/paged", "GB/s")  # the default row is the faster of ours
    assert rows["D1"][1:] == [f"{d1:,.0f} GB/s", f"jax_pallas_decode {decode:,.0f} GB/s", f"×{d1 / decode:.2f}",
                              f"{d1 / copy:.2f}"]
    m1, m1_parts = metric("M1", "pallas_attn", "GB/s"), metric("M1", "pallas_attn/parts", "GB/s")
    assert m1_parts > m1 and rows["M1"][1] == f"{m1:,.0f} GB/s"  # the default row, not the faster variant
    assert rows["P1"][0] == "P1: varlen prefill, 16 requests 256..8192"


def test_report_is_deterministic_and_the_command_prints_it(capsys):
    assert report.render(CANONICAL) == report.render(CANONICAL)
    assert report.main([str(CANONICAL)]) == 0
    assert capsys.readouterr().out == report.render(CANONICAL) + "\n"


def test_report_orders_the_standard_workloads_first(tmp_path):
    def row(workload, impl, metric):
        return {"workload": workload, "impl": impl, "unit": "GB/s", "metric": metric, "error": None,
                "device": "NVIDIA H200", "date": "2026-12-04", "versions": {"jax": "0.11.2"},
                "anchor": impl != "pallas_attn"}

    path = tmp_path / "r.json"
    path.write_text(json.dumps([row("X9", "jnp", 1.0), row("L2", "pallas_attn", 2.0), row("L1", "jnp", 1850.0),
                                row("S1", "jnp", 4.0), row("L1", "pallas_attn", 3700.0)]))
    table = _table_rows(report.render(path))
    assert list(table) == ["S1", "L1", "L2", "X9"]  # the standard order, then the others as the file has them
    assert table["L1"][0].startswith("L1: dense MLA decode")
    assert table["L1"][1:4] == ["3,700 GB/s", "jnp 1,850 GB/s", "×2.00"]


def test_report_marks_missing_rows(tmp_path):
    rows = [{"workload": "ceiling", "impl": "copy", "unit": "GB/s", "metric": 4000.0, "error": None,
             "device": "NVIDIA H200", "date": "2026-12-03", "versions": {"jax": "0.11.2"}, "anchor": False},
            {"workload": "D1", "impl": "pallas_attn", "unit": "GB/s", "metric": None, "error": "boom",
             "device": "NVIDIA H200", "date": "2026-12-03", "versions": {"jax": "0.11.2"}, "anchor": False},
            {"workload": "X9", "impl": "jnp", "unit": "GB/s", "metric": 1234.5, "error": None,
             "device": "NVIDIA H200", "date": "2026-12-03", "versions": {"jax": "0.11.2"}, "anchor": True}]
    path = tmp_path / "r.json"
    path.write_text(json.dumps(rows))
    table = _table_rows(report.render(path))
    assert table["D1"][1:] == ["error", "-", "-", "-"]
    assert table["X9"] == ["X9", "-", "jnp 1,234 GB/s", "-", "-"]
