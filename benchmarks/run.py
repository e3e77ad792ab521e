"""The benchmark harness: every standard workload × every implementation available, ceilings in the same run.

    python -m benchmarks.run                       # all workloads, all implementations (GPU; 5 to 10 minutes)
    python -m benchmarks.run --budget 540          # skip what would not finish within 540 s
    python -m benchmarks.run --only P1,D1 --impl pallas_attn,cudnn
    python -m benchmarks.run --only P1-bwd,P2-bwd  # training steps: forward + backward, ours and the anchors
    python -m benchmarks.run --only P1 --variant bn64:backend=triton,config.block_n=64
    python -m benchmarks.run --only P1,P2 --impl pallas_attn --baseline HEAD~1
    python -m benchmarks.run --family split        # decode batch × context, split-KV on / off
    python -m benchmarks.run --only W1,W2,P1,D1 --impl pallas_attn --variant softcap:softcap=50 \
        --variant sinks:sinks=1 --variant alibi:alibi=1   # model-family workloads, each feature's cost
    python -m benchmarks.run --sweep --only D2     # tuning: config grid for our kernels
    PALLAS_ATTN_INTERPRET=1 python -m benchmarks.run --tiny --out /tmp/bench_smoke   # CPU smoke test
    pallas-attn bench [same flags]                 # the package CLI calls main(argv)

Per workload: build the inputs (one set, or several to rotate between when they fit in L2), compute the reference
on a subset of rows (:mod:`benchmarks.checks`), then for each implementation: prepare (layout work, outside the
timing), compile and run once, compare with the reference (``rel_err``), time (:mod:`benchmarks.timing`). An
implementation that raises anywhere gives an ``error`` row; the run goes on.

Output: a table on stdout and ``<out>/<YYYY-MM-DD>-<device-slug>[-tiny].json``, a list of rows
``{workload, impl, median_ms, metric, unit, rel_err, ratio_to_ceiling, ratio_to_best_anchor, device, versions,
date, ...}`` rewritten (atomically) after every measured case, so a run cut short leaves what it measured (rows of
the same workload/impl/unit from an earlier run that day are replaced, the others kept); then the plots of
:mod:`benchmarks.plots`.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import math
import os
import pathlib
import platform
import re
import subprocess
import sys
import tempfile
import time
import traceback

import jax
import numpy as np

from benchmarks import ceilings as ceilings_lib, checks, impls as impls_lib, variants as variants_lib, workloads as wl
from benchmarks.timing import time_fn

RESULTS_DIR = pathlib.Path(__file__).resolve().parent / "results"
STANDARD_IDS = ["P1", "P2", "D1", "D2", "V1", "M1", "S1", "L1", "L2", "P1-bwd", "P2-bwd"]
FEATURE_IDS = ["W1", "W2"]  # model-family workloads, run with --only (each brings its twin: W1-short, P2)
FORMULAS = [
    "TFLOP/s (prefill-like) = 4 · visible (q,k) pairs · head_dim · num_q_heads / t  (a window hides pairs)",
    "P1-bwd/P2-bwd TFLOP/s  = 3.5 · 4 · visible (q,k) pairs · head_dim · num_q_heads / t, t = forward + backward "
    "(jax.vjp, fixed cotangent): forward 1 + backward 2.5 (FlashAttention's five matmuls); not a backward-only figure",
    "GB/s (decode-like)     = (Σ keys read · num_kv_heads · head_dim · 2 (K,V) · 2 B + q bytes + out bytes) / t;"
    "  keys read = seq_len, or min(seq_len, q_len + left) with a left window",
    "S1 TFLOP/s             = Σ tokens · topk · (2·H·576 + 2·H·512) / t;  S1 GB/s = Σ tokens · topk · 576 · 2 B / t",
    "L1/L2 TFLOP/s          = Σ visible (q,k) pairs · H · (2·576 + 2·512) / t (token i of q_len sees seq_len - q_len + "
    "i + 1 keys);  L1/L2 GB/s = Σ seq_len · 576 · 2 B / t",
    "ratio_to_ceiling: TFLOP/s ÷ bf16 matmul TFLOP/s, GB/s ÷ copy GB/s (both measured in this run); "
    "ratio_to_best_anchor: ÷ the best non-pallas_attn row of the same workload and unit",
    "ratio_to_twin (x twin): ÷ the row that differs by one thing, same unit, this run: the same implementation on "
    "the workload's twin (W1 ÷ W1-short: the long context's cost beyond the window, 1 at best; W2 ÷ P2: the "
    "window's), or a --variant ÷ the call without it (a feature variant: 1 - x = the feature's cost)",
]

# --budget's estimates where no earlier results file of the device holds measured ``setup_s`` / ``wall_s``: seconds
# on an H200 at --target-s 0.5 for a workload's setup (inputs, reference subset) and for one case (prepare, compile,
# check, time). P1..S1's add up to the measured 308 s of a full run without L1 and L2 (ceilings about 8 s). The
# training steps' are estimates (a backward compiles two more kernels; the jnp floor's P2 step costs about five of its
# 0.19 s forwards) until a results file of the device holds their measured figures.
SETUP_S = {"P1": 12.0, "P2": 15.0, "D1": 10.0, "D2": 12.0, "V1": 10.0, "M1": 10.0, "S1": 12.0,
           "L1": 10.0, "L2": 10.0, "P1-bwd": 15.0, "P2-bwd": 18.0}
CASE_S = {"P1": 5.0, "P2": 7.0, "D1": 5.0, "D2": 5.0, "V1": 5.0, "M1": 5.0, "S1": 6.0, "L1": 6.0, "L2": 6.0,
          "P1-bwd": 10.0, "P2-bwd": 14.0}
FAMILY_SETUP_S, FAMILY_CASE_S = 5.0, 3.0  # --family grids: small inputs, reference on a few rows
CEILINGS_S = 8.0
BASELINE_START_S = 15.0  # a --baseline subprocess: git worktree, JAX start-up


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
    wall_s: float = 0.0  # the whole case: prepare, compile, check, time

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
    t0 = time.perf_counter()
    try:
        prepared = impl.prepare(batches, options)
        res.note = prepared.note
        out = jax.block_until_ready(prepared.fn(*prepared.args[0]))  # compile + first run
        if subset is not None:
            if prepared.check_args is not None:  # a training step: checked on a cotangent of its own (checks.py)
                del out
                out = prepared.fn(*prepared.check_args)
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
        res.wall_s = time.perf_counter() - t0
    return res


# ------------------------------------------------------------------------------------------------ rows
def _row(workload: str, impl: str, unit: str | None, res: CaseResult | None, *, ctx: dict, anchor: bool,
         kind: str, extra: dict | None = None) -> dict:
    row = {"workload": workload, "impl": impl, "median_ms": None, "metric": None, "unit": unit, "rel_err": None,
           "ratio_to_ceiling": None, "ratio_to_best_anchor": None, "ratio_to_twin": None, "device": ctx["device"],
           "versions": ctx["versions"], "date": ctx["date"], "kind": kind, "anchor": anchor, "note": "",
           "error": None}
    if res is not None:
        row.update(median_ms=res.median_ms, metric=res.metric(unit) if unit else None, rel_err=res.rel_err,
                   note=res.note, error=res.error, rounds_ms=res.rounds_ms, iters=res.iters, input_sets=res.sets,
                   wall_s=round(res.wall_s, 2))
    if extra:
        row.update(extra)
    return row


def add_ratios(rows: list[dict], ceil: dict[str, ceilings_lib.Ceiling]) -> None:
    best: dict[tuple, float] = {}
    metric: dict[tuple, float] = {}
    for r in rows:
        if r["metric"] is not None and r["workload"] != "ceiling":
            metric[(r["workload"], r["impl"], r["unit"])] = r["metric"]
            if r["anchor"]:
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
        twin = r.get("twin")
        t = twin and metric.get((twin["workload"], twin["impl"], r["unit"]))
        if t:
            r["ratio_to_twin"] = r["metric"] / t


def twin_of(spec: wl.Spec, impl, name: str) -> dict | None:
    """The row a row is measured against (``ratio_to_twin``): the same implementation on the workload's twin, else
    the implementation's own twin on the same workload (a ``--variant`` against the call without it)."""
    if spec.twin:
        return {"workload": spec.twin, "impl": name}
    other = impl.twin_impl(spec)
    return {"workload": spec.id, "impl": other} if other else None


def feature_fields(spec: wl.Spec) -> dict:
    """The model-family features of the call, for the row: ``{"features": {"window_size": [127, 0], ...}}``."""
    kw = spec.feature_kwargs({"alibi_slopes": True, "sinks": True, "k_scale": spec.kv_dtype, "v_scale": spec.kv_dtype})
    return {"features": kw} if kw else {}


def results_path(out_dir: pathlib.Path, date: str, slug: str, tiny: bool, suffix: str = "") -> pathlib.Path:
    return out_dir / f"{date}-{slug}{'-tiny' if tiny else ''}{suffix}.json"


class ResultsWriter:
    """Keeps ``path`` a valid results file while a run goes on: :meth:`write` rewrites it with the rows so far
    (through a temporary file and ``os.replace``, so a reader or a kill never sees half a file). With ``merge``,
    rows of the existing file whose (workload, impl, unit) this run has not (yet) measured are kept."""

    def __init__(self, path: pathlib.Path, merge: bool):
        self.path = path
        self.old: list[dict] = []
        if merge and path.exists():
            try:
                self.old = json.loads(path.read_text())
            except Exception:  # noqa: BLE001 - an unreadable old file is replaced
                self.old = []

    def write(self, rows: list[dict]) -> list[dict]:
        new_keys = {(r["workload"], r["impl"], r["unit"]) for r in rows}
        allrows = [r for r in self.old if (r.get("workload"), r.get("impl"), r.get("unit")) not in new_keys] + rows
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(allrows, indent=1, default=_json_default) + "\n")
            os.replace(tmp, self.path)
        except BaseException:
            pathlib.Path(tmp).unlink(missing_ok=True)
            raise
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
    headers = ["workload", "impl", "median ms", "metric", "unit", "x ceiling", "x best anchor", "x twin", "rel_err",
               "note"]
    body = []
    for r in rows:
        if r["error"]:
            body.append([r["workload"], r["impl"], "-", "-", r["unit"] or "", "-", "-", "-", "-",
                         f"error: {r['error']}"])
            continue
        err = r["rel_err"]
        flag = ""
        tol = tol_by_workload.get(r["workload"])
        if err is not None and (math.isnan(err) or (tol is not None and err > tol)):
            flag = " (!)"
        body.append([r["workload"], r["impl"], _fmt(r["median_ms"], ".4f"), _fmt_metric(r["metric"]), r["unit"],
                     _fmt(r["ratio_to_ceiling"], ".3f"), _fmt(r["ratio_to_best_anchor"], ".3f"),
                     _fmt(r.get("ratio_to_twin"), ".3f"), _fmt(err, ".2e") + flag, r.get("note") or ""])
    try:
        from rich.console import Console
        from rich.table import Table
        table = Table(show_lines=False, header_style="bold")
        for h in headers:
            table.add_column(h, justify="right" if h in ("median ms", "metric", "x ceiling", "x best anchor",
                                                        "x twin", "rel_err") else "left", overflow="fold")
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


# ------------------------------------------------------------------------------------------------ budget
class Estimates:
    """Expected seconds of a workload's setup and of one case, for ``--budget``: what the newest results files of
    this device measured at the same ``--target-s`` (``setup_s``, ``wall_s`` of each row), else the defaults
    above scaled to ``--target-s``."""

    def __init__(self, target_s: float, measured_setup: dict | None = None, measured_case: dict | None = None):
        self.target_s = target_s
        self.setup_s = measured_setup or {}
        self.case_s = measured_case or {}

    @classmethod
    def load(cls, out_dir: pathlib.Path, slug: str, tiny: bool, target_s: float) -> Estimates:
        setup, case = {}, {}
        for path in sorted(out_dir.glob(f"*-{slug}{'-tiny' if tiny else ''}.json")):  # oldest first: newest wins
            try:
                rows = json.loads(path.read_text())
            except Exception:  # noqa: BLE001 - an unreadable file teaches nothing
                continue
            for r in rows if isinstance(rows, list) else []:
                if not isinstance(r, dict) or r.get("target_s") != target_s:
                    continue
                if r.get("setup_s") is not None:
                    setup[r["workload"]] = float(r["setup_s"])
                if r.get("wall_s") is not None:
                    case[(r["workload"], r["impl"])] = float(r["wall_s"])
        return cls(target_s, setup, case)

    def setup(self, spec: wl.Spec) -> float:
        if spec.id in self.setup_s:
            return self.setup_s[spec.id]
        return FAMILY_SETUP_S if spec.family else SETUP_S.get(spec.id, FAMILY_SETUP_S)

    def case(self, spec: wl.Spec, impl_name: str) -> float:
        if (spec.id, impl_name) in self.case_s:
            return self.case_s[(spec.id, impl_name)]
        base = FAMILY_CASE_S if spec.family else CASE_S.get(spec.id, FAMILY_CASE_S)
        return max(0.5, base + 1.2 * (self.target_s - 0.5))  # timing takes about 1.2 × target_s of it


class Budget:
    """``--budget SECONDS``: a case runs only if the time since the start plus its expected cost stays within."""

    def __init__(self, seconds: float | None, t_start: float):
        self.seconds = seconds
        self.t_start = t_start
        self.skipped: list[str] = []

    def elapsed(self) -> float:
        return time.perf_counter() - self.t_start

    def left(self) -> float | None:
        return None if self.seconds is None else self.seconds - self.elapsed()

    def fits(self, cost: float) -> bool:
        return self.seconds is None or self.elapsed() + cost <= self.seconds

    def skip(self, workload: str, impl: str) -> None:
        self.skipped.append(f"{workload}/{impl}")
        print(f"skipped {workload}/{impl}: budget", flush=True)


# ------------------------------------------------------------------------------------------------ main
def parse_args(argv):
    p = argparse.ArgumentParser(prog="pallas-attn bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default=None,
                   help=f"comma-separated workload ids (default: all of {','.join(STANDARD_IDS)} unless --family is "
                        f"given; 'none' for none); the model-family workloads {','.join(FEATURE_IDS)} (each with its "
                        "twin) and family ids (e.g. one-512) are accepted too")
    p.add_argument("--family", "--grid", dest="family", default=None,
                   help=f"comma-separated workload grids to add: {', '.join(wl.FAMILIES)} (--grid is the same)")
    p.add_argument("--impl", default=None,
                   help="comma-separated implementations (a name selects its /variants too; 'none' for none)")
    p.add_argument("--variant", action="append", default=None, metavar="NAME:key=value,...",
                   help="add a pallas_attn/NAME row: the public function with these keyword arguments and config "
                        "fields (backend=mosaic, num_splits=4, config.block_n=64); repeatable")
    p.add_argument("--baseline", default=None, metavar="GIT_REV",
                   help="also time pallas_attn as of GIT_REV (a temporary git worktree), rows pallas_attn@GIT_REV")
    p.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                   help="skip a workload/implementation when the time so far plus its expected cost would pass this")
    p.add_argument("--tiny", action="store_true", help="tiny shapes: a CPU smoke test of the harness (interpret mode)")
    p.add_argument("--sweep", action="store_true", help="tuning mode: config grid for our kernels")
    p.add_argument("--write-tables", action="store_true",
                   help="with --sweep: write the winners into pallas_attn/core/tuned.py (the tables config.py reads)")
    p.add_argument("--split-sweep", action="store_true", help="same as --family split")
    p.add_argument("--out", default=None, help=f"results directory (default {RESULTS_DIR})")
    p.add_argument("--target-s", type=float, default=None,
                   help="seconds of timing per case (default 0.5; 0.2 in --sweep; 0.02 with --tiny)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNGs")
    p.add_argument("--no-merge", action="store_true", help="overwrite the day's results file instead of merging")
    p.add_argument("--no-check", action="store_true", help="skip the reference check (rel_err = null)")
    p.add_argument("--list", action="store_true", help="list workloads and implementations, then exit")
    p.add_argument("-v", "--verbose", action="store_true", help="print tracebacks of failing cases")
    p.add_argument("--as-baseline", default=None, help=argparse.SUPPRESS)  # the --baseline subprocess: its row name
    args = p.parse_args(argv)
    if args.split_sweep:
        args.family = ",".join(x for x in [args.family, "split"] if x)
    return args


def _ids(text: str | None) -> list[str]:
    return [s.strip() for s in (text or "").split(",") if s.strip()]


def _selected_specs(args) -> list[wl.Spec]:
    families = _ids(args.family)
    if args.only is None:
        ids = [] if families else list(STANDARD_IDS)
    elif args.only.strip().lower() in ("", "none"):
        ids = []
    else:
        ids = _ids(args.only)
    specs = []
    for i in ids:
        spec = (wl.find_spec(i, args.tiny) or wl.find_spec(i.upper(), args.tiny)
                or wl.find_spec(i.upper().replace("-BWD", "-bwd"), args.tiny))  # p1-bwd
        if spec is None:
            raise ValueError(f"unknown workload id {i!r}; standard: {', '.join(STANDARD_IDS)}; "
                             f"families (--family): {', '.join(wl.FAMILIES)}")
        specs.append(spec)
    specs += [s for s in wl.family_specs(families, tiny=args.tiny) if s not in specs]
    return with_twins(specs, args.tiny)


def with_twins(specs: list[wl.Spec], tiny: bool) -> list[wl.Spec]:
    """The selection with each workload's twin before it (``ratio_to_twin`` needs both rows of one run)."""
    out: list[wl.Spec] = []
    for spec in specs:
        twin = wl.find_spec(spec.twin, tiny) if spec.twin else None
        for s in (twin, spec):
            if s is not None and s not in out:
                out.append(s)
    return out


def _list(tiny: bool) -> None:
    table = wl.TINY_WORKLOADS if tiny else wl.WORKLOADS
    for spec in table.values():
        names = [i.name for i in impls_lib.all_impls() if i.serves(spec)]
        unsupported = [f"{i.name} ({', '.join(sorted(i.unsupported(spec)))})" for i in impls_lib.all_impls()
                       if i.applies(spec) and i.unsupported(spec)]
        features = ", ".join(f"{k}={v}" for k, v in feature_fields(spec).get("features", {}).items())
        print(f"{spec.id}  {spec.what}  [{', '.join(spec.units)}]" + (f"  {features}" if features else "")
              + (f"  twin {spec.twin}" if spec.twin else "") + f"\n    {', '.join(names)}"
              + (f"\n    unsupported: {', '.join(unsupported)}" if unsupported else ""))
    for name in wl.FAMILIES:
        print(f"--family {name}: {', '.join(s.id for s in wl.family_specs([name], tiny))}")


def _select_impls(args) -> list[impls_lib.Impl]:
    known = impls_lib.all_impls()
    if args.as_baseline:  # the revision's default row alone
        return [i for i in known if i.name == impls_lib.OURS]
    picked = impls_lib.select(known, _ids(args.impl) or None)
    extra = variants_lib.make_impls(args.variant, {i.name for i in known})
    ours = [i for i in picked if i.ours]
    return ours + extra + [i for i in picked if not i.ours]


def _baseline_args(args, specs: list[wl.Spec], target_s: float) -> list[str]:
    out = ["--only", ",".join(s.id for s in specs) or "none", "--target-s", str(target_s)]
    if args.tiny:
        out.append("--tiny")
    if args.no_check:
        out.append("--no-check")
    return out


def main(argv=None) -> int:
    t_start = time.perf_counter()
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.list:
        _list(args.tiny)
        return 0
    from pallas_attn.core import backend
    interpret = backend.resolve_interpret(None)
    target_s = args.target_s or (0.02 if args.tiny else (0.2 if args.sweep else 0.5))
    specs = _selected_specs(args)
    impls = _select_impls(args)
    options = impls_lib.Options(interpret=interpret, tiny=args.tiny)
    out_dir = pathlib.Path(args.out) if args.out else RESULTS_DIR
    kind = device_kind()
    ctx = {"device": kind, "versions": versions(), "date": datetime.date.today().isoformat()}
    print(f"device: {kind} ({jax.default_backend()}, interpret={interpret}); versions: "
          + ", ".join(f"{k} {v}" for k, v in ctx["versions"].items()), flush=True)
    if args.as_baseline:
        import pallas_attn
        print(f"{args.as_baseline}: pallas_attn from {pathlib.Path(pallas_attn.__file__).parent}", flush=True)

    if args.sweep:
        return _main_sweep(args, specs, options, out_dir, ctx, target_s)

    path = results_path(out_dir, ctx["date"], device_slug(kind), args.tiny)
    writer = ResultsWriter(path, merge=not args.no_merge)
    budget = Budget(args.budget, t_start)
    est = Estimates.load(out_dir, device_slug(kind), args.tiny, target_s)
    reserve = 0.0  # kept for the --baseline run at the end
    if args.baseline:
        reserve = BASELINE_START_S + sum(est.setup(s) + est.case(s, impls_lib.OURS) for s in specs)

    cases = [(s, i) for s in specs for i in impls if i.serves(s)]
    progress = Progress(total=len(cases) + (0 if args.as_baseline else 2))
    rows: list[dict] = []
    ceil: dict[str, ceilings_lib.Ceiling] = {}
    if not args.as_baseline:
        progress.describe("ceilings")
        ceil = ceilings_lib.measure_all(tiny=args.tiny, target_s=target_s)
        progress.step(2)
        rows += [_row("ceiling", c.name, c.unit, None, ctx=ctx, anchor=False, kind="ceiling",
                      extra={"median_ms": c.median_ms, "metric": c.value, "ratio_to_ceiling": 1.0, "note": c.what})
                 for c in ceil.values()]
        writer.write(rows)
    tol_by_workload = {}
    for spec in specs:
        applicable = [i for i in impls if i.serves(spec)]
        if not applicable:
            continue
        cheapest = min(est.case(spec, i.name) for i in applicable)
        if not budget.fits(est.setup(spec) + cheapest + reserve):
            for impl in applicable:
                budget.skip(spec.id, impl.name)
                progress.step()
            continue
        progress.describe(f"{spec.id} inputs")
        t_setup = time.perf_counter()
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
        extra = {"setup_s": round(time.perf_counter() - t_setup, 2), "target_s": target_s}
        if spec.family == "split":
            extra.update(batch=host.num_seqs, ctx=int(host.seq_lens.max()), family="split")
        elif spec.family:
            extra["family"] = spec.family
        featured = {}  # a spec a --variant turned a feature on in -> (batches, subset, subset error)
        for impl in applicable:
            if not budget.fits(est.case(spec, impl.name) + reserve):
                budget.skip(spec.id, impl.name)
                progress.step()
                continue
            progress.describe(f"{spec.id} {impl.name}")
            run_spec = impl.spec_for(spec)
            impl_batches, impl_subset, impl_subset_error = batches, subset, subset_error
            if run_spec != spec:
                if run_spec not in featured:
                    featured[run_spec] = _featured_inputs(batches, run_spec, args.no_check, progress)
                impl_batches, impl_subset, impl_subset_error = featured[run_spec]
            res = measure_case(impl, impl_batches, options, impl_subset, target_s, verbose=args.verbose)
            if impl_subset_error and res.ok:
                res.note = (res.note + "; " if res.note else "") + "no reference check"
            name = args.as_baseline or impl.name
            twin = twin_of(spec, impl, name)
            row_extra = {**extra, **feature_fields(run_spec), **({"twin": twin} if twin else {})}
            for unit in spec.units:
                rows.append(_row(spec.id, name, unit, res, ctx=ctx, anchor=impl.anchor and not args.as_baseline,
                                 kind=spec.kind, extra=row_extra))
            add_ratios(rows, ceil)
            writer.write(rows)
            progress.write(f"{spec.id} {name}: " + (f"error: {res.error}" if res.error else
                           f"{_fmt(res.median_ms, '.4f')} ms, {_fmt_metric(res.metric(spec.units[0]))} "
                           f"{spec.units[0]}") + f" ({res.wall_s:.1f} s)")
            progress.step()
        del batches, subset, featured
        gc.collect()
    progress.close()

    baseline_note = ""
    if args.baseline:
        from benchmarks import baseline as baseline_lib
        left = budget.left()
        if left is not None and left < BASELINE_START_S:
            budget.skip("*", f"pallas_attn@{args.baseline}")
        else:
            base_rows, commit = baseline_lib.run(args.baseline, _baseline_args(args, specs, target_s), left)
            rows += base_rows
            add_ratios(rows, ceil)
            writer.write(rows)
            baseline_note = f"baseline pallas_attn@{args.baseline} = {commit}: {len(base_rows)} rows"

    print()
    for line in FORMULAS:
        print(line)
    print_table(rows, tol_by_workload)
    allrows = writer.write(rows)
    kept = len(allrows) - len(rows)
    print(f"\nwrote {len(rows)} rows to {path}" + (f" ({kept} kept from earlier)" if kept else ""))
    if baseline_note:
        print(baseline_note)
    if budget.skipped:
        print(f"skipped for the budget ({args.budget:.0f} s): {len(budget.skipped)} case(s): "
              + ", ".join(budget.skipped))
    if not args.no_plots:
        try:
            from benchmarks import plots
            for png in plots.make_plots(allrows, out_dir, stem=path.stem):
                print(f"wrote {png}")
        except Exception as e:  # noqa: BLE001 - plots are a convenience
            print(f"plots skipped: {_short_error(e)}")
    print(f"total {time.perf_counter() - t_start:.1f} s")
    return 0


def _featured_inputs(batches, spec: wl.Spec, no_check: bool, progress) -> tuple[list, object, str | None]:
    """The workload's arrays under a spec with other features (a --variant's), and its own reference subset."""
    featured = [wl.with_spec(b, spec) for b in batches]
    if no_check:
        return featured, None, None
    try:
        return featured, checks.reference_subset(featured[0]), None
    except Exception as e:  # noqa: BLE001 - time anyway, rel_err stays null
        progress.write(f"{spec.id} ({', '.join(sorted(spec.features))}): reference check unavailable: "
                       f"{_short_error(e)}")
        return featured, None, _short_error(e)


def _main_sweep(args, specs, options, out_dir, ctx, target_s) -> int:
    from benchmarks import sweep
    specs = [s for s in specs if s.family != "split"]
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
                print(f"wrote pallas_attn/core/tuned.py: {line}")
    path = results_path(out_dir, ctx["date"], device_slug(ctx["device"]), args.tiny, suffix="-sweep")
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {**ctx, "device_kind": ctx["device"], "target_s": target_s, "tables": proposals,
           "workloads": sweep.strip_private(per_workload)}
    path.write_text(json.dumps(doc, indent=1, default=_json_default) + "\n")
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
