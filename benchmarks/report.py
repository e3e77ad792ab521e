"""The README's performance table, generated from one results file so that it cannot drift from the measurement.

    python -m benchmarks.report benchmarks/results/2026-11-30-nvidia-h200.json

Prints Markdown: a line with the run's device, date, versions and ceilings, then one row per workload (the standard
ones in order, then any other workload of the file in the order it appears): the default ``pallas_attn`` row
(else the fastest ``pallas_attn/<variant>``) in the workload's primary unit, the fastest anchor of the same run and
unit, the ratio of the two, and the ratio to the ceiling of that unit measured in the same run. The README holds
this text between ``<!-- benchmarks.report benchmarks/results/<FILE>.json -->`` and ``<!-- /benchmarks.report -->``
(``tests/test_report.py`` checks it).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys

from benchmarks import workloads as wl

OURS = "pallas_attn"
STANDARD_IDS = ("P1", "P2", "D1", "D2", "V1", "M1", "S1", "L1", "L2")
CEILING_LABELS = {"TFLOP/s": "bf16 matmul", "GB/s": "copy"}
VERSION_KEYS = ("jax", "jaxlib", "triton", "platform", "pallas_attn")


def fmt(x: float) -> str:
    """568.4 → '568', 3982.5 → '3,983', 42.17 → '42.2', 0.001593 → '0.00159'."""
    if abs(x) >= 100:
        return f"{x:,.0f}"
    if abs(x) >= 10:
        return f"{x:.1f}"
    return f"{x:.3g}"


def _is_ours(impl: str) -> bool:
    return impl == OURS or impl.startswith(OURS + "/")


def _is_anchor(row: dict) -> bool:
    if "anchor" in row:
        return bool(row["anchor"])
    return not (row["impl"].startswith(OURS) or row["workload"] == "ceiling")


def _ok(row: dict, unit: str) -> bool:
    return row.get("unit") == unit and row.get("metric") is not None and not row.get("error")


def _best(rows: list[dict]) -> dict | None:
    return max(rows, key=lambda r: r["metric"], default=None)  # the first of equals: file order


def _platform(text: str) -> str:
    m = re.fullmatch(r"cuda (\d+)", text)
    return f"CUDA {int(m[1]) // 1000}.{int(m[1]) % 1000 // 10}" if m else text


def _versions(rows: list[dict]) -> str:
    """The versions of the run; a key whose value differs between rows (a merged file) lists each value."""
    parts = []
    for key in (*VERSION_KEYS, "git"):
        values = list(dict.fromkeys(str(r.get("versions", {}).get(key)) for r in rows
                                    if r.get("versions", {}).get(key) is not None))
        if not values:
            continue
        text = " / ".join(_platform(v) if key == "platform" else v for v in values)
        parts.append(text if key == "platform" else f"{key} {text}")
    return ", ".join(parts)


def _description(workload: str, tiny: bool) -> str:
    spec = wl.find_spec(workload, tiny)
    return spec.what if spec is not None else ""


def _primary_unit(workload: str, rows: list[dict], tiny: bool) -> str | None:
    spec = wl.find_spec(workload, tiny)
    if spec is not None:
        return spec.units[0]
    return next((r["unit"] for r in rows if r.get("unit")), None)


def render(path) -> str:
    """The Markdown text ``python -m benchmarks.report path`` prints (no trailing newline)."""
    path = pathlib.Path(path)
    rows = json.loads(path.read_text())
    tiny = path.stem.endswith("-tiny")
    ceilings = {}
    for r in rows:
        if r["workload"] == "ceiling" and _ok(r, r.get("unit")):
            ceilings.setdefault(r["unit"], r["metric"])
    measured = [r for r in rows if r["workload"] != "ceiling"]
    present = list(dict.fromkeys(r["workload"] for r in measured))
    order = [w for w in STANDARD_IDS if w in present] + [w for w in present if w not in STANDARD_IDS]

    devices = " / ".join(dict.fromkeys(str(r.get("device")) for r in rows))
    dates = sorted({str(r.get("date")) for r in rows})
    date = dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}"
    ceiling_text = ", ".join(f"{CEILING_LABELS.get(u, u)} {fmt(v)} {u}" for u, v in ceilings.items()) or "none"
    lines = [f"{devices}, {date}; {_versions(rows)}; ceilings measured in the same run: {ceiling_text}.", "",
             "| workload | pallas_attn | best anchor | × best anchor | × ceiling |",
             "|---|---|---|---|---|"]
    for workload in order:
        wrows = [r for r in measured if r["workload"] == workload]
        unit = _primary_unit(workload, wrows, tiny)
        ours = (_best([r for r in wrows if r["impl"] == OURS and _ok(r, unit)])  # what a user gets by default
                or _best([r for r in wrows if _is_ours(r["impl"]) and _ok(r, unit)]))
        anchor = _best([r for r in wrows if _is_anchor(r) and _ok(r, unit)])
        name = f"{workload}: {_description(workload, tiny)}".rstrip(": ")
        if ours is None:
            tried = any(_is_ours(r["impl"]) for r in wrows)
            ours_text, vs_anchor, vs_ceiling = ("error" if tried else "-"), "-", "-"
        else:
            variant = ours["impl"][len(OURS) + 1:]
            ours_text = f"{fmt(ours['metric'])} {unit}" + (f" ({variant})" if variant else "")
            vs_anchor = f"×{ours['metric'] / anchor['metric']:.2f}" if anchor else "-"
            vs_ceiling = f"{ours['metric'] / ceilings[unit]:.2f}" if ceilings.get(unit) else "-"
        anchor_text = f"{anchor['impl']} {fmt(anchor['metric'])} {unit}" if anchor else "-"
        lines.append(f"| {name} | {ours_text} | {anchor_text} | {vs_anchor} | {vs_ceiling} |")
    lines += ["", "pallas_attn: the default row (else the fastest variant, named); best anchor: the fastest other "
              "implementation of the same run and unit; × ceiling: ÷ the ceiling of that unit "
              "(`benchmarks/README.md` has the formulas)."]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.report", description=__doc__.split("\n\n")[0])
    p.add_argument("file", help="a results file written by python -m benchmarks.run")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    print(render(args.file))
    return 0


if __name__ == "__main__":
    sys.exit(main())
