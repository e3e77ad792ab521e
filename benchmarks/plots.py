"""PNG plots from a results JSON, one per family, next to it (``benchmarks/results/`` by default).

    python -m benchmarks.plots benchmarks/results/2026-11-30-nvidia-h200.json [--out DIR]

* ``<stem>-prefill.png``: TFLOP/s by implementation for the prefill workloads (P1, P2), matmul ceiling dashed;
* ``<stem>-training.png``: the same for their training steps (P1-bwd, P2-bwd: forward + backward, 3.5 × the
  forward's useful FLOPs);
* ``<stem>-decode.png``: GB/s by implementation and workload (D1, D2, V1, M1; context range in the label), copy
  ceiling dashed;
* ``<stem>-sparse.png``: S1 TFLOP/s and GB/s by implementation;
* ``<stem>-mla.png``: dense MLA, L1 and L2 TFLOP/s and GB/s by implementation;
* ``<stem>-split.png``: the ``--split-sweep`` grid (when present): GB/s against context length, one colour per
  batch size, solid = split-KV heuristic, dashed = ``num_splits=1``.
Every bar is labelled with its value; error rows are left out.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

DECODE_LABELS = {"D1": "D1 (64 req, ctx 1k-8k)", "D2": "D2 (4 req, ctx 20k-128k)", "V1": "V1 (32 req, 4k-16k, q=6)",
                 "M1": "M1 (mixed)"}
PREFILL_LABELS = {"P1": "P1 (varlen, 29k tokens)", "P2": "P2 (one 32k request)"}
TRAINING_LABELS = {"P1-bwd": "P1-bwd (P1, forward + backward)", "P2-bwd": "P2-bwd (P2, forward + backward)"}
SPARSE_LABELS = {"S1": "S1 sparse MLA"}
MLA_LABELS = {"L1": "L1 (decode, 16 heads)", "L2": "L2 (q_len 2, 128 heads)"}


def _ok(rows, workloads, unit):
    return [r for r in rows if r.get("workload") in workloads and r.get("unit") == unit and r.get("metric") is not None
            and not r.get("error")]


def _ceiling(rows, unit):
    for r in rows:
        if r.get("workload") == "ceiling" and r.get("unit") == unit and r.get("metric"):
            return r["metric"], r["impl"]
    return None, None


def _grouped_bars(ax, rows, workloads, labels, unit):
    import numpy as np
    present = [w for w in workloads if any(r["workload"] == w for r in rows)]
    seen = []
    for r in rows:
        if r["impl"] not in seen:
            seen.append(r["impl"])
    impl_names = sorted(seen, key=lambda n: (not n.startswith("pallas_attn"), seen.index(n)))  # ours first
    width = 0.8 / max(1, len(impl_names))
    x = np.arange(len(present))
    for j, name in enumerate(impl_names):
        vals = []
        for w in present:
            match = [r["metric"] for r in rows if r["workload"] == w and r["impl"] == name]
            vals.append(match[0] if match else 0.0)
        bars = ax.bar(x + (j - (len(impl_names) - 1) / 2) * width, vals, width, label=name,
                      hatch=None if name.startswith("pallas_attn") else "//", alpha=0.9)
        for b, v in zip(bars, vals):
            if v > 0:
                ax.annotate(f"{v:,.0f}", (b.get_x() + b.get_width() / 2, v), ha="center", va="bottom", fontsize=7,
                            rotation=90, xytext=(0, 2), textcoords="offset points")
    ax.set_xticks(x, [labels.get(w, w) for w in present])
    ax.set_ylabel(unit)
    return present


def _finish(fig, ax, rows, unit, title, path, legend_below: bool = False):
    ceil, name = _ceiling(rows, unit)
    if ceil:
        ax.axhline(ceil, color="k", ls="--", lw=1, label=f"ceiling: {name} {ceil:,.0f}")
    device = next((r.get("device") for r in rows if r.get("device")), "")
    date = next((r.get("date") for r in rows if r.get("date")), "")
    ax.set_title(f"{title} — {device} {date}")
    if legend_below:
        ax.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.14))
    else:
        ax.legend(fontsize=7, ncol=2, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    import matplotlib.pyplot as plt
    plt.close(fig)
    return path


def _both_units(rows, labels, title, path):
    """One panel per unit (TFLOP/s, GB/s), the workloads of ``labels`` grouped in each, its ceiling dashed; None
    when no row of them measured anything."""
    import matplotlib.pyplot as plt
    measured = [r for r in rows if r.get("workload") in labels and r.get("metric") is not None and not r.get("error")]
    if not measured:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(5 + 5 * len(labels), 4))
    for ax, unit in zip(axes, ("TFLOP/s", "GB/s")):
        sub = [r for r in measured if r["unit"] == unit]
        if sub:
            _grouped_bars(ax, sub, list(labels), labels, unit)
            ceil, name = _ceiling(rows, unit)
            if ceil:
                ax.axhline(ceil, color="k", ls="--", lw=1, label=f"{name} {ceil:,.0f}")
            ax.legend(fontsize=7)
            ax.grid(axis="y", alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def make_plots(rows: list[dict], out_dir, stem: str) -> list[pathlib.Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []

    pre = _ok(rows, PREFILL_LABELS, "TFLOP/s")
    if pre:
        fig, ax = plt.subplots(figsize=(10, 4.5))
        _grouped_bars(ax, pre, list(PREFILL_LABELS), PREFILL_LABELS, "useful causal TFLOP/s")
        written.append(_finish(fig, ax, rows, "TFLOP/s", "Prefill", out_dir / f"{stem}-prefill.png"))

    train = _ok(rows, TRAINING_LABELS, "TFLOP/s")
    if train:
        fig, ax = plt.subplots(figsize=(10, 4.5))
        _grouped_bars(ax, train, list(TRAINING_LABELS), TRAINING_LABELS, "TFLOP/s (3.5 × forward useful FLOPs)")
        written.append(_finish(fig, ax, rows, "TFLOP/s", "Prefill training step: forward + backward",
                               out_dir / f"{stem}-training.png"))

    dec = _ok(rows, DECODE_LABELS, "GB/s")
    if dec:
        fig, ax = plt.subplots(figsize=(12, 4.5))
        _grouped_bars(ax, dec, list(DECODE_LABELS), DECODE_LABELS, "GB/s of K/V that must be read")
        written.append(_finish(fig, ax, rows, "GB/s", "Decode / verification / mixed", out_dir / f"{stem}-decode.png"))

    for labels, title, suffix in ((SPARSE_LABELS, "Sparse MLA decode (S1)", "sparse"),
                                  (MLA_LABELS, "Dense MLA (L1, L2)", "mla")):
        path = _both_units(rows, labels, title, out_dir / f"{stem}-{suffix}.png")
        if path is not None:
            written.append(path)

    split = [r for r in rows if r.get("family") == "split" and r.get("metric") is not None and not r.get("error")]
    if split:
        fig, ax = plt.subplots(figsize=(9, 5.5))
        batches = sorted({r["batch"] for r in split})
        colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
        for i, b in enumerate(batches):
            for impl, ls, tag in (("pallas_attn", "-", "split-KV heuristic"), ("pallas_attn/no_split", "--",
                                                                              "num_splits=1")):
                pts = sorted((r["ctx"], r["metric"]) for r in split if r["batch"] == b and r["impl"] == impl)
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], ls, marker="o", color=colors[i % len(colors)],
                            label=f"batch {b}, {tag}")
        contexts = sorted({r["ctx"] for r in split})
        ax.set_xscale("log", base=2)
        ax.set_xticks(contexts, [f"{c // 1024}k" if c >= 1024 else str(c) for c in contexts])
        ax.minorticks_off()
        ax.set_xlabel("context length (tokens per request)")
        ax.set_ylabel("GB/s of K/V read")
        written.append(_finish(fig, ax, rows, "GB/s", "Paged decode: split-KV on / off", out_dir / f"{stem}-split.png",
                               legend_below=True))
    return written


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.plots", description="PNG plots from a results JSON")
    p.add_argument("results", help="results JSON written by benchmarks.run")
    p.add_argument("--out", default=None, help="directory for the PNGs (default: next to the JSON)")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    path = pathlib.Path(args.results)
    rows = json.loads(path.read_text())
    for png in make_plots(rows, args.out or path.parent, stem=path.stem):
        print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
