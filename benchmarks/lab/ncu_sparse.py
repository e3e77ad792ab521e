"""The sparse MLA kernel on S1, run twice, for a profiler (GPU only):

    ncu --section WarpStateStats --kernel-name regex:sparse --launch-skip 1 --launch-count 1 \\
        python -m benchmarks.lab.ncu_sparse backend=triton,config.block_n=64

The argument: a ``--variant`` body (default: the plain call, which picks the backend).
"""

from __future__ import annotations

import sys

import jax

from benchmarks.lab import common


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    s = common.spec("S1")
    b = common.batch(s)
    prepared = common.ours(b, common.kwargs(argv[0] if argv else "default", s))
    for _ in range(2):
        jax.block_until_ready(prepared.fn(*prepared.args[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
