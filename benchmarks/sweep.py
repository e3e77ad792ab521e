"""``--sweep``: tuning mode for our kernels. Tries a grid of configs per workload, prints the winners and writes
``<date>-<device>-sweep.json``; with ``--write-tables`` the winners go into :mod:`pallas_attn.core.tuned`, the tables
:mod:`pallas_attn.core.config` reads.

Two stages per workload: stage 1 is the block-size × warps × stages grid at the default split choice; stage 2
varies what only makes sense around the stage-1 winner (prefill: query heads per program; decode, ragged and dense
MLA: ``num_splits``). Every config is checked against the reference subset before it is timed; a config that fails to
compile (shared memory, register limits) or is wrong is recorded with its error and skipped.

Table entries: for each kernel family the config with the best geometric-mean speed-up over the family's
workloads (among configs measured on all of them) is proposed, keyed the way ``pallas_attn/core/config.py`` looks it
up: prefill and decode by ``(device kind, next_pow2(head_dim))``, sparse by ``(device kind, num_q_heads)``. Dense MLA
and the training steps (P1-bwd, P2-bwd: the grid sets ``backward_config``, the backward's tiles, the forward keeping
its default) have no table yet: their winners are printed and kept in the sweep file only.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

from pallas_attn.core import config as config_lib
from pallas_attn.core.config import DecodeConfig, MLAConfig, PrefillConfig, SparseConfig

FAMILY_TABLE = {"prefill": "PREFILL_TABLE", "decode": "DECODE_TABLE", "ragged": "DECODE_TABLE",
                "sparse": "SPARSE_TABLE"}
TUNED_NAMES = {"PREFILL_TABLE": "PREFILL", "DECODE_TABLE": "DECODE", "CHUNK_TABLE": "CHUNK", "SPARSE_TABLE": "SPARSE"}
CONFIG_KEYS = ("config", "backward_config")  # the config arguments a grid entry may set


# --------------------------------------------------------------------------------------------------- grids
def stage1(spec, tiny: bool) -> list[dict]:
    kind = spec.kind
    if kind == "prefill":
        if tiny:
            return [{"config": PrefillConfig(16, 16, None, 4, 2)}, {"config": PrefillConfig(32, 16, None, 4, 1)}]
        return [{"config": PrefillConfig(bm, bn, None, w, s)}
                for bm, bn, w, s in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4))]
    if kind == "prefill-bwd":  # the backward's tiles; its dK/dV program holds two [block_n, D] f32 accumulators
        if tiny:
            return [{"backward_config": PrefillConfig(16, 16, None, 4, 2)},
                    {"backward_config": PrefillConfig(32, 16, None, 4, 1)}]
        return [{"backward_config": PrefillConfig(bm, bn, None, w, s)}
                for bm, bn, w, s in itertools.product((32, 64, 128), (32, 64), (4, 8), (1, 2, 3))]
    if kind == "decode":
        if tiny:
            return [{"config": DecodeConfig(16, None, 4, 2)}, {"config": DecodeConfig(32, None, 4, 1)}]
        return [{"config": DecodeConfig(bn, None, w, s)}
                for bn, w, s in itertools.product((16, 32, 64, 128, 256), (2, 4, 8), (1, 2, 3, 4))]
    if kind == "ragged":
        if tiny:
            return [{"config": DecodeConfig(16, None, 4, 2)}, {"config": DecodeConfig(32, 8, 4, 1)}]
        return [{"config": DecodeConfig(bn, bq, w, s)}
                for bn, bq, w, s in itertools.product((32, 64, 128), (None, 4, 8, 16), (4, 8), (2, 3))]
    if kind == "sparse":
        if tiny:
            return [{"config": SparseConfig(16, 16, 4, 2)}, {"config": SparseConfig(32, 16, 4, 1)}]
        # value_splits 2 with 32-key tiles is the one split variant that compiles for sm_90 without spills and
        # inside shared memory (tools/offline_compile.py); the other splits exceed 227 KB of shared memory.
        return ([{"config": SparseConfig(bn, bh, w, s)}
                 for bn, bh, w, s in itertools.product((32, 64, 128), (32, 64, 128), (4, 8), (1, 2, 3))]
                + [{"config": SparseConfig(32, 64, 8, s, value_splits=2)} for s in (1, 2)])
    if kind == "mla":
        if tiny:
            return [{"config": MLAConfig(block_n=16, block_h=16, num_warps=4, num_stages=2)},
                    {"config": MLAConfig(block_n=32, block_h=16, num_warps=4, num_stages=1)}]
        heads = [h for h in (16, 32, 64) if h <= config_lib.next_pow2(spec.num_q_heads)]
        return [{"config": MLAConfig(block_n=bn, block_h=bh, num_warps=w, num_stages=s)}
                for bn, bh, w, s in itertools.product((32, 64, 128), heads, (4, 8), (1, 2, 3))]
    raise ValueError(f"no sweep grid for kind {kind!r}")


def stage2(spec, winner: dict, tiny: bool) -> list[dict]:
    cfg = winner.get("config")
    if spec.kind == "prefill":
        group = spec.num_q_heads // spec.num_kv_heads
        return [{"config": dataclasses.replace(cfg, heads_per_program=h)}
                for h in (1, 2, 4, 8) if group % h == 0 and h <= cfg.block_m and h != cfg.heads_per_program]
    if spec.kind in ("decode", "ragged", "mla"):
        splits = (1, 2) if tiny else (1, 2, 4, 8, 16, 32, 64)
        return [{"config": cfg, "num_splits": s} for s in splits]
    return []


def label(overrides: dict) -> str:
    parts = []
    for key in CONFIG_KEYS:
        cfg = overrides.get(key)
        if cfg is not None:
            fields = ", ".join(f"{f.name}={getattr(cfg, f.name)}" for f in dataclasses.fields(cfg))
            parts.append(fields if key == "config" else f"{key}: {fields}")
    if "num_splits" in overrides:
        parts.append(f"num_splits={overrides['num_splits']}")
    return "; ".join(parts) or "default"


def to_json(overrides: dict) -> dict:
    out = {}
    for key in CONFIG_KEYS:
        cfg = overrides.get(key)
        if cfg is not None:
            out[f"{key}_class"] = type(cfg).__name__
            out[key] = dataclasses.asdict(cfg)
    if "num_splits" in overrides:
        out["num_splits"] = overrides["num_splits"]
    return out


# --------------------------------------------------------------------------------------------------- runner
def sweep_workload(spec, batches, subset, options, measure, target_s: float, tiny: bool, progress=None) -> dict:
    """Returns {"default", "winner", "results"}; ``measure(impl, batches, options, subset, target_s)`` is
    :func:`benchmarks.run.measure_case`."""
    from benchmarks.impls import OUR_IMPLS
    impl = OUR_IMPLS[0]
    unit = spec.units[0]
    results = []

    def run(overrides: dict, stage: str) -> dict:
        opts = dataclasses.replace(options, overrides=overrides)
        r = measure(impl, batches, opts, subset, target_s)
        entry = {"stage": stage, "label": label(overrides), **to_json(overrides), "median_ms": r.median_ms,
                 "metric": r.metric(unit), "unit": unit, "rel_err": r.rel_err, "error": r.error, "note": r.note,
                 "_overrides": overrides}
        results.append(entry)
        if progress is not None:
            progress(f"{spec.id} {entry['label']}: " + (f"{entry['median_ms']:.4f} ms" if r.ok else f"({r.error})"))
        return entry

    default = run({}, "default")
    for ov in stage1(spec, tiny):
        run(ov, "1")
    ok = [e for e in results if e["error"] is None and e["stage"] == "1"]
    if ok:
        best1 = min(ok, key=lambda e: e["median_ms"])
        for ov in stage2(spec, best1["_overrides"], tiny):
            run(ov, "2")
    good = [e for e in results if e["error"] is None]
    winner = min(good, key=lambda e: e["median_ms"]) if good else None
    return {"default": default, "winner": winner, "results": results}


def propose_tables(specs, per_workload: dict, device_kind: str) -> list[dict]:
    """One proposed table entry per kernel family: the config (split counts aside, they are not config fields)
    with the best geometric-mean speed-up over the family's workloads, among configs measured on all of them."""
    families: dict[str, list] = {}
    for spec in specs:
        if spec.id in per_workload:
            families.setdefault(spec.kind, []).append(spec)
    proposals = []
    for kind, fam in families.items():
        if kind not in FAMILY_TABLE:  # a kernel without a tuned table: its winners stay in the sweep file
            continue
        timings: dict[str, dict[str, float]] = {}  # label -> workload -> ms
        configs: dict[str, object] = {}
        for spec in fam:
            for e in per_workload[spec.id]["results"]:
                if e["error"] is None and e["stage"] != "default" and "num_splits" not in e["_overrides"]:
                    timings.setdefault(e["label"], {})[spec.id] = e["median_ms"]
                    configs[e["label"]] = e["_overrides"]["config"]
        best = {s.id: min((t[s.id] for t in timings.values() if s.id in t), default=None) for s in fam}
        scored = []
        for lab, t in timings.items():
            if len(t) == len(fam) and all(best[w] for w in t):
                geo = math.exp(sum(math.log(best[w] / t[w]) for w in t) / len(t))
                scored.append((geo, lab))
        if not scored:
            continue
        geo, lab = max(scored)
        cfg = configs[lab]
        spec = fam[0]
        key = (device_kind, spec.num_q_heads if kind == "sparse" else config_lib.next_pow2(spec.head_dim))
        table = FAMILY_TABLE[kind]
        line = f"{table}[{key!r}] = {cfg!r}"
        if kind == "ragged":
            line = "# ragged kernel (paged_attention) winner; config.py shares DECODE_TABLE today:\n# " + line
        proposals.append({"kernel": kind, "table": table, "key": list(key), "from": [s.id for s in fam],
                          "config_class": type(cfg).__name__, "config": dataclasses.asdict(cfg),
                          "geomean_of_best": geo, "python": line})
    return proposals


def strip_private(per_workload: dict) -> dict:
    def strip(e):
        return None if e is None else {k: v for k, v in e.items() if not k.startswith("_")}

    clean = {}
    for wid, d in per_workload.items():
        clean[wid] = {"default": strip(d["default"]), "winner": strip(d["winner"]),
                      "results": [strip(e) for e in d["results"]]}
    return clean


def write_tables(proposals: list[dict], path) -> list[str]:
    """Merge the proposals into the generated module ``pallas_attn/core/tuned.py`` at ``path`` (entries for other
    devices and head dims are kept) and rewrite it; returns the entries written. The ragged family's winner is
    not written: it shares DECODE_TABLE with the decode kernel, whose own sweep decides that entry."""
    import ast
    import pathlib
    path = pathlib.Path(path)
    tables = {name: {} for name in TUNED_NAMES.values()}
    header = '"""Measured launch configs."""\n'
    if path.exists():
        tree = ast.parse(path.read_text())
        doc = ast.get_docstring(tree, clean=False)
        if doc is not None:
            header = '"""' + doc + '"""\n'
        for node in tree.body:
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id in tables:
                tables[node.target.id] = ast.literal_eval(node.value)
    written = []
    for p in proposals:
        if p["kernel"] == "ragged":
            continue
        name = TUNED_NAMES[p["table"]]
        key = tuple(p["key"])
        tables[name][key] = dict(p["config"])
        written.append(f"{name}[{key!r}] = {p['config']!r}")
    lines = [header]
    for name, entries in tables.items():
        if not entries:
            lines.append(f"{name}: dict[tuple[str, int], dict] = {{}}")
            continue
        lines.append(f"{name}: dict[tuple[str, int], dict] = {{")
        for key in sorted(entries):
            lines.append(f"    {key!r}: {entries[key]!r},")
        lines.append("}")
    path.write_text("\n".join(lines) + "\n")
    return written
