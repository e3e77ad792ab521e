"""Run pallas_attn/prefill_mosaic.py against the reference: interpreted on a CPU, compiled on an H200.

    python scripts/check_prefill_mosaic.py 64,70,1,0 [--causal 0|1] [--hq 4 --hkv 2 --d 128] [--wgs 3]

Prints the relative L2 error of the output (and LSE) for the packed batch of the given request lengths. On the
CPU a watchdog dumps the threads and exits after --timeout seconds (the interpreter sometimes blocks; see the
module's status note).
"""

from __future__ import annotations

import argparse
import faulthandler
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_attn import prefill_mosaic  # noqa: E402
from pallas_attn import reference  # noqa: E402
from pallas_attn.testing import random_packed, relative_l2  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("lens", help="comma-separated request lengths")
    ap.add_argument("--causal", type=int, default=1)
    ap.add_argument("--hq", type=int, default=2)
    ap.add_argument("--hkv", type=int, default=1)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--wgs", type=int, default=prefill_mosaic.COMPUTE_WGS, help="compute warpgroups (2 or 3)")
    ap.add_argument("--timeout", type=float, default=60.0)
    args = ap.parse_args()
    interpret = jax.default_backend() == "cpu"
    if interpret:
        faulthandler.dump_traceback_later(args.timeout, exit=True)
    lens = [int(x) for x in args.lens.split(",")]
    rng = np.random.default_rng(0)
    pad_to = sum(lens) + 3
    q, cu = random_packed(rng, lens, args.hq, args.d, jnp.bfloat16, pad_to=pad_to)
    k, _ = random_packed(rng, lens, args.hkv, args.d, jnp.bfloat16, pad_to=pad_to)
    v, _ = random_packed(rng, lens, args.hkv, args.d, jnp.bfloat16, pad_to=pad_to)
    t = time.time()
    out, lse = prefill_mosaic.varlen_attention_mosaic(q, k, v, cu, max_seqlen=max(lens), causal=bool(args.causal),
                                                   scale=args.d ** -0.5, return_lse=True, interpret=interpret,
                                                   compute_wgs=args.wgs)
    ref, ref_lse = reference.varlen_attention(q, k, v, cu, causal=bool(args.causal), return_lse=True)
    n = int(cu[-1])
    out = np.asarray(out, np.float32)
    err = relative_l2(out[:n], np.asarray(ref, np.float32)[:n])
    fin = np.isfinite(np.asarray(ref_lse))
    lse_err = float(np.max(np.abs(np.asarray(lse)[fin] - np.asarray(ref_lse)[fin]))) if fin.any() else 0.0
    ok = err < 1e-2 and np.all(out[n:] == 0) and not np.isnan(out).any()
    print(f"{'interpreted' if interpret else 'compiled'} {time.time() - t:.1f}s: out rel L2 {err:.3g}, "
          f"max |lse - ref| {lse_err:.3g}, padding rows zero {bool(np.all(out[n:] == 0))} -> {'OK' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
