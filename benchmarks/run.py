"""The benchmark harness: every DESIGN.md §4 workload × every implementation available, ceilings in the same run.

    python -m benchmarks.run                       # all workloads, all implementations (GPU)
    python -m benchmarks.run --only P1,D1 --impl pallas_attn,cudnn
    python -m benchmarks.run --split-sweep         # decode batch × context, split-KV on / off
    python -m benchmarks.run --sweep --only D2     # tuning: config grid for our kernels
    PALLAS_ATTN_INTERPRET=1 python -m benchmarks.run --tiny --out /tmp/bench_smoke   # CPU smoke test
    pallas-attn bench [same flags]                 # the package CLI calls main(argv)

Per workload: build the inputs (one set, or several to rotate between when they fit in L2), compute the reference
on a subset of rows (:mod:`benchmarks.checks`), then for each implementation: prepare (layout work, outside the
timing), compile and run once, compare with the reference (``rel_err``), time (:mod:`benchmarks.timing`). An
implementation that raises anywhere gives an ``error`` row; the run goes on.

Output: a table on stdout and ``<out>/<YYYY-MM-DD>-<device-slug>[-tiny].json``, a list of rows
``{workload, impl, median_ms, metric, unit, rel_err, ratio_to_ceiling, ratio_to_best_anchor, device, versions,
date, ...}`` (rows of the same workload/impl/unit from an earlier run that day are replaced, the others kept), and
the plots of :mod:`benchmarks.plots`.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import math
import pathlib
import platform
import re
import subprocess
import sys
import time
import traceback

import jax
import numpy as np

from benchmarks import ceilings as ceilings_lib
from benchmarks import checks, impls as impls_lib, workloads as wl
from benchmarks.timing import time_fn

RESULTS_DIR = pathlib.Path(__file__).resolve().parent / "results"
STANDARD_IDS = ["P1", "P2", "D1", "D2", "V1", "M1", "S1"]
FORMULAS = [
    "TFLOP/s (prefill-like) = 4 · visible (q,k) pairs · head_dim · num_q_heads / t",
    "GB/s (decode-like)     = (Σ seq_len · num_kv_heads · head_dim · 2 (K,V) · 2 B + q bytes + out bytes) / t",
    "S1 TFLOP/s             = Σ tokens · topk · (2·H·576 + 2·H·512) / t;  S1 GB/s = Σ tokens · topk · 576 · 2 B / t",
    "ratio_to_ceiling: TFLOP/s ÷ bf16 matmul TFLOP/s, GB/s ÷ copy GB/s (both measured in this run); "
    "ratio_to_best_anchor: ÷ the best non-pallas_attn row of the same workload and unit",
]


# ------------------------------------------------------------------------------------------------ environment
def device_kind() -> str:
    return jax.devices()[0].device_kind


def device_slug(kind: str | None = None) -> str:
    return re.sub(r"[^a-z0-9]+", "-", (kind or device_kind()).lower()).strip("-") or "unknown"


def versions() -> dict:
    v = {"python": platform.python_version(), "jax": jax.__version__, "numpy": np.__version__}
    try:
        import jaxlib
        v["jaxlib"] = jaxlib.__version__
    except Exception:  # noqa: BLE001
        pass
    try:
        import pallas_attn
        v["pallas_attn"] = pallas_attn.__version__
    except Exception:  # noqa: BLE001
        pass
    try:
        import triton  # noqa: F401  (present on the GPU machine through torch; not needed by us)
        v["triton"] = triton.__version__
    except Exception:  # noqa: BLE001
        pass
    try:
        v["platform"] = jax.devices()[0].client.platform_version
    except Exception:  # noqa: BLE001
        pass
    try:
        root = pathlib.Path(__file__).resolve().parent.parent
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                             timeout=5).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=5).stdout.strip()
        if sha:
            v["git"] = sha + ("-dirty" if dirty else "")
    except Exception:  # noqa: BLE001
        pass
    return v


# ------------------------------------------------------------------------------------------------ one case
@dataclasses.dataclass
class CaseResult:
    host: wl.HostBatch
    median_s: float | None = None
    rel_err: float | None = None
    note: str = ""
    error: str | None = None
    rounds_ms: list[float] = dataclasses.field(default_factory=list)
    iters: int = 0
    sets: int = 1

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def median_ms(self) -> float | None:
        return None if self.median_s is None else self.median_s * 1e3

    def metric(self, unit: str) -> float | None:
        return None if self.median_s is None else self.host.metric(unit, self.median_s)


def _short_error(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    first = next((line for line in msg if line.strip()), "")
    return f"{type(e).__name__}: {first[:300]}"


def measure_case(impl, batches, options, subset, target_s: float, verbose: bool = False) -> CaseResult:
    """Prepare, compile, check, time one implementation on one workload; never raises."""
    res = CaseResult(batches[0].host, sets=len(batches))
    prepared = None
    try:
        prepared = impl.prepare(batches, options)
        res.note = prepared.note
        out = jax.block_until_ready(prepared.fn(*prepared.args[0]))  # compile + first run
        if subset is not None:
            res.rel_err = checks.rel_err(prepared.canonical(out), subset)
        del out
        t = time_fn(prepared.fn, prepared.args, target_s=target_s)
        res.median_s, res.rounds_ms, res.iters = t.median_s, [r * 1e3 for r in t.rounds_s], t.iters
    except Exception as e:  # noqa: BLE001 - an anchor that cannot run records an error row
        res.error = _short_error(e)
        if verbose:
            traceback.print_exc()
    finally:
        del prepared
        gc.collect()
    return res


# ------------------------------------------------------------------------------------------------ rows
def _row(workload: str, impl: str, unit: str | None, res: CaseResult | None, *, ctx: dict, anchor: bool,
         kind: str, extra: dict | None = None) -> dict:
    row = {"workload": workload, "impl": impl, "median_ms": None, "metric": None, "unit": unit, "rel_err": None,
           "ratio_to_ceiling": None, "ratio_to_best_anchor": None, "device": ctx["device"],
           "versions": ctx["versions"], "date": ctx["date"], "kind": kind, "anchor": anchor, "note": "",
           "error": None}
    if res is not None:
        row.update(median_ms=res.median_ms, metric=res.metric(unit) if unit else None, rel_err=res.rel_err,
                   note=res.note, error=res.error, rounds_ms=res.rounds_ms, iters=res.iters, input_sets=res.sets)
    if extra:
        row.update(extra)
    return row


def add_ratios(rows: list[dict], ceil: dict[str, ceilings_lib.Ceiling]) -> None:
    best: dict[tuple, float] = {}
    for r in rows:
        if r["anchor"] and r["metric"] is not None and r["workload"] != "ceiling":
            key = (r["workload"], r["unit"])
            best[key] = max(best.get(key, 0.0), r["metric"])
    for r in rows:
        if r["metric"] is None:
            continue
        c = ceil.get(r["unit"])
        if c is not None and c.value > 0:
            r["ratio_to_ceiling"] = r["metric"] / c.value
        b = best.get((r["workload"], r["unit"]))
        if b:
            r["ratio_to_best_anchor"] = r["metric"] / b


def results_path(out_dir: pathlib.Path, date: str, slug: str, tiny: bool, suffix: str = "") -> pathlib.Path:
    return out_dir / f"{date}-{slug}{'-tiny' if tiny else ''}{suffix}.json"


def write_rows(path: pathlib.Path, rows: list[dict], merge: bool) -> list[dict]:
    """Writes ``rows``; with ``merge``, rows of an existing file whose (workload, impl, unit) is not re-measured
    are kept (so ``--only`` runs of one day accumulate). Returns what was written."""
    keep = []
    if merge and path.exists():
        try:
            old = json.loads(path.read_text())
            new_keys = {(r["workload"], r["impl"], r["unit"]) for r in rows}
            keep = [r for r in old if (r.get("workload"), r.get("impl"), r.get("unit")) not in new_keys]
        except Exception:  # noqa: BLE001 - an unreadable old file is replaced
            keep = []
    allrows = keep + rows
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(allrows, indent=1, default=_json_default) + "\n")
    return allrows


def _json_default(x):
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return float(x)
    return str(x)


def _fmt(x, spec: str) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-" if x is None else "nan"
    return format(x, spec)


def _fmt_metric(x) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-" if x is None else "nan"
    return f"{x:,.1f}" if abs(x) >= 100 else f"{x:.4g}"


def print_table(rows: list[dict], tol_by_workload: dict[str, float], file=None) -> None:
    file = file or sys.stdout
    headers = ["workload", "impl", "median ms", "metric", "unit", "x ceiling", "x best anchor", "rel_err", "note"]
    body = []
    for r in rows:
        if r["error"]:
            body.append([r["workload"], r["impl"], "-", "-", r["unit"] or "", "-", "-", "-", f"error: {r['error']}"])
            continue
        err = r["rel_err"]
        flag = ""
        tol = tol_by_workload.get(r["workload"])
        if err is not None and (math.isnan(err) or (tol is not None and err > tol)):
            flag = " (!)"
        body.append([r["workload"], r["impl"], _fmt(r["median_ms"], ".4f"), _fmt_metric(r["metric"]), r["unit"],
                     _fmt(r["ratio_to_ceiling"], ".3f"), _fmt(r["ratio_to_best_anchor"], ".3f"),
                     _fmt(err, ".2e") + flag, r.get("note") or ""])
    try:
        from rich.console import Console
        from rich.table import Table
        table = Table(show_lines=False, header_style="bold")
        for h in headers:
            table.add_column(h, justify="right" if h in ("median ms", "metric", "x ceiling", "x best anchor",
                                                        "rel_err") else "left", overflow="fold")
        for b in body:
            table.add_row(*b)
        Console(file=file, width=max(160, 20)).print(table)
    except ImportError:
        widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(headers)]
        print("  ".join(h.ljust(w) for h, w in zip(headers, widths)), file=file)
        for b in body:
            print("  ".join(c.ljust(w) for c, w in zip(b, widths)), file=file)


# ------------------------------------------------------------------------------------------------ progress
class Progress:
    def __init__(self, total: int, enabled: bool = True):
        self.bar = None
        if enabled:
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=total, file=sys.stderr, dynamic_ncols=True, leave=True)
            except ImportError:
                pass

    def describe(self, text: str) -> None:
        if self.bar is not None:
            self.bar.set_description_str(text[:60])
        else:
            print(f"  {text}", file=sys.stderr, flush=True)

    def step(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def write(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# ------------------------------------------------------------------------------------------------ main
def parse_args(argv):
    p = argparse.ArgumentParser(prog="pallas-attn bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default=None,
                   help=f"comma-separated workload ids (default: all of {','.join(STANDARD_IDS)}; 'none' for none)")
    p.add_argument("--impl", default=None, help="comma-separated implementations (a name selects its /variants too)")
    p.add_argument("--tiny", action="store_true", help="tiny shapes: a CPU smoke test of the harness (interpret mode)")
    p.add_argument("--sweep", action="store_true", help="tuning mode: config grid for our kernels")
    p.add_argument("--write-tables", action="store_true",
                   help="with --sweep: write the winners into pallas_attn/tuned.py (the tables config.py reads)")
    p.add_argument("--split-sweep", action="store_true",
                   help="decode batch {1,4,16,64} x ctx {1k,8k,32k,128k}, num_splits=1 vs the heuristic "
                        "(alone unless --only names standard workloads too)")
    p.add_argument("--out", default=None, help=f"results directory (default {RESULTS_DIR})")
    p.add_argument("--target-s", type=float, default=None,
                   help="seconds of timing per case (default 0.5; 0.2 in --sweep; 0.02 with --tiny)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNGs")
    p.add_argument("--no-merge", action="store_true", help="overwrite the day's results file instead of merging")
    p.add_argument("--no-check", action="store_true", help="skip the reference check (rel_err = null)")
    p.add_argument("--list", action="store_true", help="list workloads and implementations, then exit")
    p.add_argument("-v", "--verbose", action="store_true", help="print tracebacks of failing cases")
    return p.parse_args(argv)


def _selected_specs(args) -> list[wl.Spec]:
    if args.only is None:
        ids = [] if args.split_sweep else list(STANDARD_IDS)
    elif args.only.strip().lower() in ("", "none"):
        ids = []
    else:
        ids = [s.strip().upper() for s in args.only.split(",") if s.strip()]
    specs = wl.get_specs(ids, tiny=args.tiny)
    if args.split_sweep:
        specs += wl.split_sweep_specs(tiny=args.tiny)
    return specs


def _list(tiny: bool) -> None:
    for spec in wl.get_specs(STANDARD_IDS, tiny):
        names = [i.name for i in impls_lib.all_impls() if i.applies(spec)]
        print(f"{spec.id}  {spec.what}  [{', '.join(spec.units)}]\n    {', '.join(names)}")


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.list:
        _list(args.tiny)
        return 0
    from pallas_attn.core import backend
    interpret = backend.resolve_interpret(None)
    target_s = args.target_s or (0.02 if args.tiny else (0.2 if args.sweep else 0.5))
    specs = _selected_specs(args)
    selectors = [s.strip() for s in args.impl.split(",")] if args.impl else None
    impls = impls_lib.select(impls_lib.all_impls(), selectors)
    options = impls_lib.Options(interpret=interpret, tiny=args.tiny)
    out_dir = pathlib.Path(args.out) if args.out else RESULTS_DIR
    kind = device_kind()
    ctx = {"device": kind, "versions": versions(), "date": datetime.date.today().isoformat()}
    print(f"device: {kind} ({jax.default_backend()}, interpret={interpret}); versions: "
          + ", ".join(f"{k} {v}" for k, v in ctx["versions"].items()), flush=True)
    t_start = time.perf_counter()

    if args.sweep:
        return _main_sweep(args, specs, options, out_dir, ctx, target_s)

    cases = [(s, i) for s in specs for i in impls if i.applies(s)]
    progress = Progress(total=len(cases) + 2)
    progress.describe("ceilings")
    ceil = ceilings_lib.measure_all(tiny=args.tiny, target_s=target_s)
    progress.step(2)
    rows = [_row("ceiling", c.name, c.unit, None, ctx=ctx, anchor=False, kind="ceiling",
                 extra={"median_ms": c.median_ms, "metric": c.value, "ratio_to_ceiling": 1.0, "note": c.what})
            for c in ceil.values()]
    tol_by_workload = {}
    for spec in specs:
        applicable = [i for i in impls if i.applies(spec)]
        if not applicable:
            continue
        progress.describe(f"{spec.id} inputs")
        host = wl.build_host(spec)
        tol_by_workload[spec.id] = checks.tolerance(spec.jnp_dtype)
        n_sets = wl.num_input_sets(host, max_sets=2 if args.tiny else 32)
        batches = [wl.build_arrays(host, jax.random.key(1000 * spec.seed + i)) for i in range(n_sets)]
        subset, subset_error = None, None
        if not args.no_check:
            try:
                subset = checks.reference_subset(batches[0])
            except Exception as e:  # noqa: BLE001 - time anyway, rel_err stays null
                subset_error = _short_error(e)
                progress.write(f"{spec.id}: reference check unavailable: {subset_error}")
        extra = {}
        if spec.id.startswith("split-"):
            extra = {"batch": host.num_seqs, "ctx": int(host.seq_lens.max()), "family": "split"}
        for impl in applicable:
            progress.describe(f"{spec.id} {impl.name}")
            res = measure_case(impl, batches, options, subset, target_s, verbose=args.verbose)
            if subset_error and res.ok:
                res.note = (res.note + "; " if res.note else "") + "no reference check"
            for unit in spec.units:
                rows.append(_row(spec.id, impl.name, unit, res, ctx=ctx, anchor=impl.anchor, kind=spec.kind,
                                 extra=extra))
            progress.step()
        del batches, subset
        gc.collect()
    progress.close()
    add_ratios(rows, ceil)

    print()
    for line in FORMULAS:
        print(line)
    print_table(rows, tol_by_workload)
    path = results_path(out_dir, ctx["date"], device_slug(kind), args.tiny)
    allrows = write_rows(path, rows, merge=not args.no_merge)
    print(f"\nwrote {len(rows)} rows to {path}" + (f" ({len(allrows) - len(rows)} kept from earlier)"
                                                  if len(allrows) > len(rows) else ""))
    if not args.no_plots:
        try:
            from benchmarks import plots
            for png in plots.make_plots(allrows, out_dir, stem=path.stem):
                print(f"wrote {png}")
        except Exception as e:  # noqa: BLE001 - plots are a convenience
            print(f"plots skipped: {_short_error(e)}")
    print(f"total {time.perf_counter() - t_start:.1f} s")
    return 0


def _main_sweep(args, specs, options, out_dir, ctx, target_s) -> int:
    from benchmarks import sweep
    specs = [s for s in specs if not s.id.startswith("split-")]
    progress = Progress(total=len(specs))
    per_workload = {}
    for spec in specs:
        progress.describe(f"{spec.id} sweep")
        host = wl.build_host(spec)
        n_sets = wl.num_input_sets(host, max_sets=2 if args.tiny else 32)
        batches = [wl.build_arrays(host, jax.random.key(1000 * spec.seed + i)) for i in range(n_sets)]
        subset = None if args.no_check else checks.reference_subset(batches[0])
        tol = checks.tolerance(spec.jnp_dtype)

        def measure(impl, b, opts, sub, t, _tol=tol):
            r = measure_case(impl, b, opts, sub, t, verbose=args.verbose)
            if r.ok and r.rel_err is not None and not (r.rel_err <= _tol):  # wrong (or NaN): not a candidate
                r.error = f"rel_err {r.rel_err:.3g} above {_tol:.3g}"
            return r

        per_workload[spec.id] = sweep.sweep_workload(spec, batches, subset, options, measure, target_s, args.tiny,
                                                     progress=progress.write if args.verbose else None)
        progress.step()
        del batches, subset
        gc.collect()
    progress.close()
    proposals = sweep.propose_tables(specs, per_workload, ctx["device"])

    print()
    for wid, d in per_workload.items():
        w, dflt = d["winner"], d["default"]
        n_ok = sum(e["error"] is None for e in d["results"])
        if w is None:
            print(f"{wid}: no config ran ({len(d['results'])} tried)")
            continue
        speedup = (dflt["median_ms"] / w["median_ms"]) if dflt["median_ms"] else float("nan")
        print(f"{wid}: winner {w['label']}: {w['median_ms']:.4f} ms, {_fmt_metric(w['metric'])} {w['unit']} "
              f"(default {_fmt(dflt['median_ms'], '.4f')} ms, x{speedup:.3f}; {n_ok}/{len(d['results'])} ran)")
    print("\nproposed config.py table entries:")
    for p in proposals:
        print(f"{p['python']}    # from {','.join(p['from'])}, geomean {p['geomean_of_best']:.3f} of best")
    if args.write_tables:
        if args.tiny:
            print("\n--write-tables ignored with --tiny (interpret-mode timings are not tuning data)")
        else:
            import pallas_attn.core.tuned
            for line in sweep.write_tables(proposals, pallas_attn.core.tuned.__file__):
                print(f"wrote pallas_attn/tuned.py: {line}")
    path = results_path(out_dir, ctx["date"], device_slug(ctx["device"]), args.tiny, suffix="-sweep")
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {**ctx, "device_kind": ctx["device"], "target_s": target_s, "tables": proposals,
           "workloads": sweep.strip_private(per_workload)}
    path.write_text(json.dumps(doc, indent=1, default=_json_default) + "\n")
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
