"""Is a kernel power-bound? SM clock, board power and throttle reasons sampled by nvidia-smi every 100 ms while one
kernel runs back to back for a few seconds: a bf16 matmul (the ceiling), then P2 through the Mosaic and the Triton
prefill, and any ``--variant`` of ours on P2. GPU only (needs nvidia-smi). JSON to ``$OUT/power_probe.json``.

    python -m benchmarks.lab.power [seconds per kernel] [--variant NAME:backend=mosaic,config.p_chunks=4 ...]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import variants
from benchmarks.lab import common

FIELDS = "clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active"


def sample(fn, args, seconds: float) -> dict:
    for _ in range(3):
        jax.block_until_ready(fn(*args))
    smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={FIELDS}", "--format=csv,noheader,nounits", "-lms", "100"],
                           stdout=subprocess.PIPE, text=True)
    calls, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(5):
            out = fn(*args)
        jax.block_until_ready(out)
        calls += 5
    elapsed = time.perf_counter() - t0
    smi.terminate()
    rows = [line.split(", ") for line in smi.communicate()[0].splitlines() if line.count(",") == 3]
    rows = rows[len(rows) // 4:]  # the first quarter: clocks still settling from the warm-up
    clock, power, temp = (np.array([float(r[i]) for r in rows]) for i in range(3))
    return dict(ms_per_call=elapsed / calls * 1e3, sm_clock_mhz_median=float(np.median(clock)),
                sm_clock_mhz_min=float(clock.min()), power_w_median=float(np.median(power)),
                temp_c_max=float(temp.max()), throttle_reasons=sorted({r[3] for r in rows}), samples=len(rows))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("seconds", type=float, nargs="?", default=8.0)
    p.add_argument("--variant", action="append", default=[], metavar="NAME:key=value,...")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    key = jax.random.key(0)
    a, b = (jax.random.normal(jax.random.fold_in(key, i), (8192, 8192), jnp.bfloat16) for i in range(2))
    s = common.spec("P2")
    batch = common.batch(s)
    kernels = {"matmul_8192": (jax.jit(lambda a, b: a @ b), (a, b), 2 * 8192 ** 3)}
    for name, kw in [("P2_mosaic", {"backend": "mosaic"}), ("P2_triton", {"backend": "triton"})] + [
            (f"P2/{v.name}", variants.resolve(s, v)) for v in map(variants.parse, args.variant)]:
        prepared = common.ours(batch, kw)
        kernels[name] = (prepared.fn, prepared.args[0], batch.host.flops())
    rows = []
    for name, (fn, fargs, flops) in kernels.items():
        r = dict(kernel=name, **sample(fn, fargs, args.seconds))
        r["tflops"] = flops / (r["ms_per_call"] * 1e-3) / 1e12
        rows.append(r)
        print(r, flush=True)
    common.write_json("power_probe.json", dict(seconds_per_kernel=args.seconds, rows=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
