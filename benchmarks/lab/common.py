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
    as ``--variant`` resolves them."""
    if text.strip() in ("", "default"):
        return {}
    variant = variants.parse(f"lab:{text}")
    if variant.features:  # they change the workload, not the call: the harness's --variant runs them
        raise SystemExit(f"{text!r}: model-family keys ({', '.join(k for k, _ in variant.features)}) are "
                         "benchmarks.run --variant's, not the lab's")
    return variants.resolve(s, variant)


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


def interleaved(fns, args: tuple, *, reps: int = 7, inner: int = 10) -> list[list[float]]:
    """Seconds a call of each of ``fns``, per round: every round times each function in turn (``inner`` calls
    back to back, one wait), so drift of clocks with power and temperature reaches all of them alike."""
    for f in fns:
        for _ in range(2):
            jax.block_until_ready(f(*args))
    times = [[] for _ in fns]
    for _ in range(reps):
        for f, t_f in zip(fns, times):
            t0 = time.perf_counter()
            for _ in range(inner):
                out = f(*args)
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
