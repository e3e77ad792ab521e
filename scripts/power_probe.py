"""Is the prefill power-bound? SM clock, board power and throttle reasons sampled by nvidia-smi while one kernel runs
back to back for a few seconds: a bf16 matmul (the ceiling), then P2 through the Mosaic and the Triton kernels.
JSON to $OUT/power_probe.json. GPU only.

    python scripts/power_probe.py [seconds per kernel]
    VARIANTS="wgs=2,bkv=64" python scripts/power_probe.py   # also P2 through Mosaic kernel variants (probe knobs)
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_attn import varlen_attention  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from probe_prefill_mosaic import VARIANTS, WORKLOADS, inputs, variant_impl  # noqa: E402

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
    reasons = sorted({r[3] for r in rows})
    return dict(ms_per_call=elapsed / calls * 1e3, sm_clock_mhz_median=float(np.median(clock)),
                sm_clock_mhz_min=float(clock.min()), power_w_median=float(np.median(power)),
                temp_c_max=float(temp.max()), throttle_reasons=reasons, samples=len(rows))


def main() -> int:
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 8.0
    key = jax.random.key(0)
    a, b = (jax.random.normal(jax.random.fold_in(key, i), (8192, 8192), jnp.bfloat16) for i in range(2))
    q, k, v, cu, p2_flops = inputs(*WORKLOADS["P2"])
    n = q.shape[0]
    kernels = {
        "matmul_8192": (jax.jit(lambda a, b: a @ b), (a, b), 2 * 8192 ** 3),
        "P2_mosaic": (jax.jit(lambda *x: varlen_attention(*x, max_seqlen=n, backend="mosaic")), (q, k, v, cu),
                      p2_flops),
        "P2_triton": (jax.jit(lambda *x: varlen_attention(*x, max_seqlen=n, backend="triton")), (q, k, v, cu),
                      p2_flops),
    }
    for variant in VARIANTS:
        kernels[f"P2_mosaic/{variant}"] = (jax.jit(lambda *x, impl=variant_impl(variant): impl(
            *x, max_seqlen=n, causal=True, scale=128 ** -0.5, return_lse=False, interpret=False)[0]),
            (q, k, v, cu), p2_flops)
    rows = []
    for name, (fn, args, flops) in kernels.items():
        r = dict(kernel=name, **sample(fn, args, seconds))
        r["tflops"] = flops / (r["ms_per_call"] * 1e-3) / 1e12
        rows.append(r)
        print(json.dumps(r), flush=True)
    pathlib.Path(os.environ.get("OUT", "/tmp"), "power_probe.json").write_text(json.dumps(dict(
        device=jax.devices()[0].device_kind, jax=jax.__version__, date=time.strftime("%Y-%m-%d"),
        commit=os.environ.get("COMMIT", "?"), rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
