"""Context-parallel decode of D2's longest request over 2 devices vs one device.

One request of 131072 keys (bf16, Hq 32, Hkv 8, D 128, block 16): its pages are cut into 2 contiguous halves, each
device decodes its half with ``paged_decode_attention(..., return_lse=True)`` and the two partial states are merged
across devices (all-gather + ``merge_attention_states``). Prints time and GB/s per device for both runs, the merge's
share of the context-parallel time (the merge timed alone, on the same partial states), and checks that the results
agree. Each row is timed twice: per call, host dispatch included (a multi-device call costs ~100 us to launch), and
per step with ``--reps`` steps chained in one program, which is what a jitted serving step pays.

    python examples/multi_gpu.py                       # >= 2 GPUs, compiled
    XLA_FLAGS=--xla_force_host_platform_device_count=2 python examples/multi_gpu.py --small    # CPU, interpreted
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import time

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):  # CPU: 2 host devices
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip()
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # a source checkout works uninstalled

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from pallas_attn import paged_decode_attention, parallel, reference  # noqa: E402
from pallas_attn.testing import relative_l2  # noqa: E402


def timeit(fn, *args, target_s: float, repeats: int = 5) -> float:
    """Median seconds per call: warm-up, then ``repeats`` rounds of back-to-back calls waited for once.

    On CPU every call is waited for: several multi-device programs in flight at once can starve XLA's CPU
    collectives of threads (an all-gather rendezvous that never completes), and interpreted timings are only
    indicative anyway."""
    sync_each = jax.default_backend() == "cpu"
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    per = max(time.perf_counter() - t0, 1e-6)
    iters = max(1, int(target_s / repeats / per))
    rounds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
            if sync_each:
                jax.block_until_ready(out)
        jax.block_until_ready(out)
        rounds.append((time.perf_counter() - t0) / iters)
    return statistics.median(rounds)


def chained(step, reps: int):
    """``step`` run ``reps`` times inside one program, each run's first input nudged by the last run's output times
    a runtime zero, so that XLA can neither hoist nor merge the runs. Timing it and dividing by ``reps`` gives the
    device time of one step: a multi-device call costs ~100 us of host dispatch, more than the step itself, which
    a jitted serving step (many layers per dispatch) does not pay per attention call."""
    def run(zero, x, *rest):
        def body(_, carry):
            y = step(x + (carry * zero).astype(x.dtype), *rest)
            return jax.tree.leaves(y)[0].ravel()[0].astype(jnp.float32)
        return jax.lax.fori_loop(0, reps, body, jnp.float32(0))
    return run


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="CPU-sized: 1000 keys, Hq 4, Hkv 2, D 32 (interpreted)")
    ap.add_argument("--ctx", type=int, help="keys of the request (default 131072; --small: 1000)")
    ap.add_argument("--devices", type=int, default=2, help="devices of the context-parallel axis")
    ap.add_argument("--merge", choices=("all_gather", "psum"), default="all_gather")
    ap.add_argument("--target-s", type=float, default=None, help="time budget per measurement")
    ap.add_argument("--reps", type=int, default=None, help="steps chained in one program for the device-time rows")
    ap.add_argument("--json", help="also write the measurements to this JSON file")
    args = ap.parse_args()

    n = args.devices
    if len(jax.devices()) < n:
        print(f"needs {n} devices, found {jax.devices()}; on CPU set "
              f"XLA_FLAGS=--xla_force_host_platform_device_count={n}")
        return 1
    if args.small:
        ctx, hq, hkv, d, bs, dtype = args.ctx or 1000, 4, 2, 32, 16, jnp.bfloat16
    else:
        ctx, hq, hkv, d, bs, dtype = args.ctx or 131072, 32, 8, 128, 16, jnp.bfloat16
    target_s = args.target_s or (0.2 if args.small else 1.0)
    reps = args.reps or (2 if args.small else 50)
    itemsize = jnp.dtype(dtype).itemsize
    devices = jax.devices()[:n]
    print(f"{jax.default_backend()} × {n}: {devices[0].device_kind}; one request, ctx {ctx}, "
          f"Hq {hq}, Hkv {hkv}, D {d}, block {bs}, {jnp.dtype(dtype).name}, merge {args.merge}")

    # one global paged cache on device 0, pages in a shuffled order
    pages = -(-ctx // bs)
    rng = np.random.default_rng(0)
    table = rng.permutation(pages).astype(np.int32)[None, :]
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    with jax.default_device(devices[0]):
        q = jax.random.normal(kq, (1, hq, d), jnp.float32).astype(dtype)
        k_cache = jax.random.normal(kk, (pages, bs, hkv, d), jnp.float32).astype(dtype)
        v_cache = jax.random.normal(kv, (pages, bs, hkv, d), jnp.float32).astype(dtype)
        tables, lens = jnp.asarray(table), jnp.asarray([ctx], jnp.int32)

    # one device
    single = jax.jit(paged_decode_attention)
    out_one = single(q, k_cache, v_cache, tables, lens)
    t_one = timeit(single, q, k_cache, v_cache, tables, lens, target_s=target_s)
    zero = jnp.float32(0)
    single_steps = jax.jit(chained(paged_decode_attention, reps))
    s_one = timeit(single_steps, zero, q, k_cache, v_cache, tables, lens, target_s=target_s) / reps

    # n devices: each holds a contiguous half of the pages in its own pool
    mesh = jax.make_mesh((n,), ("cp",), devices=devices)
    shards = parallel.split_context_pages(table, [ctx], bs, n)
    kc = parallel.shard_paged_cache(k_cache, shards.page_map, mesh=mesh, axis="cp")
    vc = parallel.shard_paged_cache(v_cache, shards.page_map, mesh=mesh, axis="cp")
    del k_cache, v_cache  # keep only the per-device pools (the reference below rebuilds from them)
    bt = jax.device_put(jnp.asarray(shards.block_tables), jax.sharding.NamedSharding(mesh, P("cp")))
    cl = jax.device_put(jnp.asarray(shards.seq_lens), jax.sharding.NamedSharding(mesh, P("cp")))
    q_rep = jax.device_put(q, jax.sharding.NamedSharding(mesh, P()))

    def cp(q, kc, vc, bt, cl):
        return parallel.context_parallel_decode(q, kc, vc, bt, cl, mesh=mesh, axis="cp", merge=args.merge)

    out_cp = cp(q_rep, kc, vc, bt, cl)
    t_cp = timeit(cp, q_rep, kc, vc, bt, cl, target_s=target_s)
    s_cp = timeit(jax.jit(chained(cp, reps)), zero, q_rep, kc, vc, bt, cl, target_s=target_s) / reps

    # the merge alone, on the devices' real partial states
    def partial_states(q, kc, vc, bt, cl):
        o, lse = paged_decode_attention(q, kc[0], vc[0], bt[0], cl[0], return_lse=True)
        return o[None], lse[None]

    local = jax.jit(jax.shard_map(partial_states, mesh=mesh, in_specs=(P(), P("cp"), P("cp"), P("cp"), P("cp")),
                                  out_specs=(P("cp"), P("cp")), check_vma=False))
    outs, lses = local(q_rep, kc, vc, bt, cl)
    t_local = timeit(local, q_rep, kc, vc, bt, cl, target_s=target_s)
    local_steps = jax.jit(jax.shard_map(chained(partial_states, reps), mesh=mesh,
                                        in_specs=(P(), P(), P("cp"), P("cp"), P("cp"), P("cp")), out_specs=P(),
                                        check_vma=False))
    s_local = timeit(local_steps, zero, q_rep, kc, vc, bt, cl, target_s=target_s) / reps

    def merge_only(o, lse):
        m, _ = parallel.cross_device_merge(o[0], lse[0], "cp", merge=args.merge)
        return m.astype(dtype)

    merge = jax.jit(jax.shard_map(merge_only, mesh=mesh, in_specs=(P("cp"), P("cp")), out_specs=P(), check_vma=False))
    t_merge = timeit(merge, outs, lses, target_s=target_s)
    merge_steps = jax.jit(jax.shard_map(chained(merge_only, reps), mesh=mesh, in_specs=(P(), P("cp"), P("cp")),
                                        out_specs=P(), check_vma=False))
    s_merge = timeit(merge_steps, zero, outs, lses, target_s=target_s) / reps

    # bytes: K and V of the keys each device reads, plus q and out
    kv_bytes = lambda keys: keys * hkv * d * 2 * itemsize  # noqa: E731
    qo_bytes = 2 * hq * d * itemsize
    keys_per_dev = shards.seq_lens[:, 0]
    gbs = lambda t, keys: (kv_bytes(int(keys)) + qo_bytes) / t / 1e9  # noqa: E731
    rows = {}
    print(f"{'':22s}{'per call (dispatch incl.)':>40s}{f'per step ({reps} in one program)':>40s}")
    print(f"{'':22s}{'time':>12s}{'GB/s per device':>28s}{'time':>12s}{'GB/s per device':>28s}")
    for name, t, s, keys in [("1 device", t_one, s_one, [ctx]), (f"{n} devices (cp)", t_cp, s_cp, keys_per_dev),
                             ("  local kernels only", t_local, s_local, keys_per_dev),
                             ("  merge only", t_merge, s_merge, None)]:
        g = lambda t: " / ".join(f"{gbs(t, k):.0f}" for k in keys) if keys is not None else "-"  # noqa: E731
        print(f"{name:22s}{t * 1e6:10.1f}us{g(t):>28s}{s * 1e6:10.1f}us{g(s):>28s}")
        rows[name.strip()] = dict(call_us=t * 1e6, step_us=s * 1e6)
    print(f"per step: cp speed-up {s_one / s_cp:.2f}x over one device, merge {100 * s_merge / s_cp:.0f}% of the cp "
          f"time; keys per device {keys_per_dev.tolist()}")
    gbs_one, per_dev = gbs(s_one, ctx), [gbs(s_cp, k) for k in keys_per_dev]

    # correctness: cp vs one device vs the reference
    pools = np.asarray(kc.astype(jnp.float32))
    k_glob = np.zeros((pages, bs, hkv, d), np.float32)
    v_glob = np.zeros_like(k_glob)
    vpools = np.asarray(vc.astype(jnp.float32))
    for dev in range(n):
        used = shards.page_map[dev] >= 0
        k_glob[shards.page_map[dev][used]] = pools[dev][used]
        v_glob[shards.page_map[dev][used]] = vpools[dev][used]
    ref = reference.paged_decode_attention(q.astype(jnp.float32), jnp.asarray(k_glob), jnp.asarray(v_glob),
                                           tables, lens)
    err_one = relative_l2(out_cp, out_one)
    err_ref = relative_l2(out_cp, ref)
    err_one_ref = relative_l2(out_one, ref)
    tol = 1e-2  # bf16 (pallas_attn.testing.TOLERANCES)
    ok = err_one < tol and err_ref < tol
    print(f"relative L2: cp vs 1 device {err_one:.2e}, cp vs reference {err_ref:.2e}, "
          f"1 device vs reference {err_one_ref:.2e}  ->  {'OK' if ok else 'MISMATCH'}")
    if args.json:
        import datetime
        import json
        pathlib.Path(args.json).write_text(json.dumps(dict(
            date=datetime.date.today().isoformat(), device=f"{n} x {devices[0].device_kind}",
            versions=dict(jax=jax.__version__), workload=f"D2 longest request: ctx {ctx}, Hq {hq}, Hkv {hkv}, D {d}, "
            f"block {bs}, {jnp.dtype(dtype).name}", merge=args.merge, keys_per_device=keys_per_dev.tolist(),
            reps_per_program=reps, one_device_us=s_one * 1e6, one_device_gbs=gbs_one, cp_us=s_cp * 1e6,
            cp_gbs_per_device=per_dev, speedup=s_one / s_cp, local_kernels_us=s_local * 1e6,
            merge_us=s_merge * 1e6, merge_share=s_merge / s_cp, per_call_dispatch_included=rows,
            rel_l2_cp_vs_one=err_one, rel_l2_cp_vs_reference=err_ref, ok=bool(ok)),
            indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
