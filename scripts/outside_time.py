"""GPU time of the Mosaic prefill's parts outside the kernel (work list, K/V staging), each run N times inside one
jitted fori_loop so that dispatch does not count (GPU only). JSON to $OUT/outside_time.json.

    python scripts/outside_time.py [P1,P2]
"""
import functools
import json
import os
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
from jax import lax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from pallas_attn import prefill_mosaic as pm  # noqa: E402
from probe_prefill_mosaic import WORKLOADS, inputs, timeit  # noqa: E402

N = int(os.environ.get("N", 200))


def looped(part):
    """``part(cu')`` N times, cu' = cu + i // 2**30 (zero, but not provably so: nothing is hoisted)."""
    def run(cu, *args):
        def body(i, acc):
            out = part(cu + i // (1 << 30), *args)
            return acc + sum(jnp.sum(x[:1].astype(jnp.float32)) for x in jax.tree.leaves(out))
        return lax.fori_loop(0, N, body, jnp.float32(0))
    return jax.jit(run)


def main() -> int:
    rows = []
    for name in (sys.argv[1].split(",") if len(sys.argv) > 1 else ["P1", "P2"]):
        lens, d, causal = WORKLOADS[name]
        q, k, v, cu, _ = inputs(lens, d, causal)
        num_tokens, hq, _ = q.shape
        group, wgs = hq // k.shape[1], pm.COMPUTE_WGS
        num_slots = pm.num_work_slots(num_tokens, len(lens), max(lens), group, wgs)
        interpret = jax.default_backend() == "cpu"  # a smoke run here; the numbers mean something on the GPU
        parts = {"work list": looped(lambda cu: pm._work_list(cu, num_slots, causal, max(lens), group, wgs)),
                 "K/V staging": looped(lambda cu, k, v: pm._stage_kv(k, v, cu, pm.BLOCK_KV, interpret=interpret)),
                 "empty loop": looped(lambda cu: cu)}
        args = {"work list": (cu,), "K/V staging": (cu, k, v), "empty loop": (cu,)}
        ts = timeit([functools.partial(f, *args[p]) for p, f in parts.items()], reps=5, inner=2)
        for part, t in zip(parts, ts):
            rows.append(dict(workload=name, part=part, us_per_call=t / N * 1e6, num_slots=num_slots))
            print(f"{name} {part:12s} {t / N * 1e6:8.2f} us a call (num_slots {num_slots})", flush=True)
    pathlib.Path(os.environ.get("OUT", "/tmp"), "outside_time.json").write_text(json.dumps(dict(
        device=jax.devices()[0].device_kind, jax=jax.__version__, date=time.strftime("%Y-%m-%d"), rows=rows),
        indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
