"""Our varlen prefill on one causal request, run twice, for a profiler or a PTX dump (GPU only):

    ncu --section WarpStateStats --section SourceCounters --kernel-name regex:mosaic --launch-skip 1 \\
        --launch-count 1 -o prefill python -m benchmarks.lab.ncu_prefill 8192
    MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_TO=dump python -m benchmarks.lab.ncu_prefill 4096  # tools/ptx_schedule.py

The second argument: a ``--variant`` body (default ``backend=mosaic``; e.g. ``backend=triton,config.block_n=64``).
"""

from __future__ import annotations

import dataclasses
import sys

import jax

from benchmarks import workloads as wl
from benchmarks.lab import common


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    n = int(argv[0]) if argv else 8192
    s = dataclasses.replace(wl.WORKLOADS["P2"], id=f"one-{n}", groups=(wl.Group((n,)),))
    b = common.batch(s)
    prepared = common.ours(b, common.kwargs(argv[1] if len(argv) > 1 else "backend=mosaic", s))
    for _ in range(2):
        jax.block_until_ready(prepared.fn(*prepared.args[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
