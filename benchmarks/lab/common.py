"""What the lab scripts share: a workload's inputs and our function on them (the harness's own), variant specs,
interleaved timing, and the JSON they write."""

from __future__ import annotations

import json
import os
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import impls, variants, workloads as wl


def spec(workload_id: str, tiny: bool = False) -> wl.Spec:
    found = wl.find_spec(workload_id, tiny)
    if found is None:
        raise SystemExit(f"unknown workload {workload_id!r}: a standard id (P1, ...) or a family id "
                         f"(python -m benchmarks.run --list)")
    return found


def batch(s: wl.Spec, key: int = 0) -> wl.Batch:
    return wl.build_arrays(wl.build_host(s), jax.random.key(key))


def kwargs(text: str, s: wl.Spec) -> dict:
    """A variant body (``backend=mosaic,config.p_chunks=4``; ``default`` for none) → the call's keyword arguments,
    as ``--variant`` resolves them (model-family keys: :func:`prepared`, which changes the batch too)."""
    if text.strip() in ("", "default"):
        return {}
    variant = variants.parse(f"lab:{text}")
    if variant.features:
        raise SystemExit(f"{text!r}: model-family keys ({', '.join(k for k, _ in variant.features)}) change the "
                         "workload's batch: use common.prepared")
    return variants.resolve(s, variant)


def has_features(text: str) -> bool:
    """The variant body turns a model-family feature on."""
    return text.strip() not in ("", "default") and bool(variants.parse(f"lab:{text}").features)


def prepared(b: wl.Batch, text: str) -> impls.Prepared:
    """Our function on ``b`` with a variant body, model-family keys included (``softcap=50``, ``sinks=1``: the
    batch's own sinks and slopes, as the harness's ``--variant`` runs them); ``.args`` are the call's arguments."""
    if text.strip() in ("", "default"):
        return ours(b, {})
    variant = variants.parse(f"lab:{text}")
    b = wl.with_spec(b, variant.spec_for(b.spec))
    return ours(b, variants.resolve(b.spec, variant))


def ours(b: wl.Batch, kw: dict) -> impls.Prepared:
    """Our public function on the batch with ``kw``, as the harness calls it (compiled on a GPU; interpreted on a
    CPU, which only checks that a script runs)."""
    from pallas_attn.core import backend
    return impls._prepare_ours([b], impls.Options(interpret=backend.resolve_interpret(None)), **kw)


def unrolled(fn, args: tuple, n: int):
    """``fn`` called ``n`` times in one jitted function: GPU time a call without the host's dispatch. The first
    integer array argument gets ``+ zero * i`` (a traced zero), so XLA merges none of the calls."""
    idx = next((i for i, a in enumerate(args) if isinstance(a, jax.Array) and jnp.issubdtype(a.dtype, jnp.integer)),
               None)
    if idx is None:
        raise ValueError("--unroll needs an integer array argument to perturb")

    def run(zero, *a):
        total = jnp.float32(0)
        for i in range(n):
            b = list(a)
            b[idx] = b[idx] + (zero * i).astype(b[idx].dtype)
            total += sum(jnp.sum(x.reshape(-1)[:1].astype(jnp.float32)) for x in jax.tree.leaves(fn(*b)))
        return total

    jitted = jax.jit(run)
    return lambda *a: jitted(jnp.int32(0), *a)


def interleaved(fns, args, *, reps: int = 7, inner: int = 10) -> list[list[float]]:
    """Seconds a call of each of ``fns``, per round: every round times each function in turn (``inner`` calls
    back to back, one wait), so drift of clocks with power and temperature reaches all of them alike. ``args``: one
    tuple for all, or a list of tuples, one per function."""
    per_fn = args if isinstance(args, list) else [args] * len(fns)
    for f, a in zip(fns, per_fn):
        for _ in range(2):
            jax.block_until_ready(f(*a))
    times = [[] for _ in fns]
    for _ in range(reps):
        for f, a, t_f in zip(fns, per_fn, times):
            t0 = time.perf_counter()
            for _ in range(inner):
                out = f(*a)
            jax.block_until_ready(out)
            t_f.append((time.perf_counter() - t0) / inner)
    return times


def median(xs) -> float:
    return float(np.median(xs))


def write_json(name: str, doc: dict) -> pathlib.Path:
    """``doc`` with the device, versions and date, to ``$OUT/<name>`` (``$OUT`` defaults to the working directory)."""
    from benchmarks.run import versions
    path = pathlib.Path(os.environ.get("OUT", "."), name)
    full = {"device": jax.devices()[0].device_kind, "versions": versions(), "date": time.strftime("%Y-%m-%d"), **doc}
    path.write_text(json.dumps(full, indent=1) + "\n")
    print(f"wrote {path}")
    return path
