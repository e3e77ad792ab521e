"""Where ptxas puts a Mosaic GPU kernel's wgmma waits, from a PTX dumped on the device, on a CPU-only machine.

The Mosaic GPU pipeline (MLIR → LLVM → PTX) runs inside the CUDA plugin, so the PTX comes from the device
(``MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_TO=dir``, e.g. with ``python -m benchmarks.lab.ncu_prefill``). The SASS
is only the device's if it comes from the device's own ptxas: jax-cuda13-plugin compiles with CUDA 13.0's, whose
SASS matches ncu's source view instruction for instruction, where the ptxas 12.x of the ``triton`` wheel places the
waits elsewhere. Give that ptxas with ``--ptxas`` or ``$PTXAS``; without either, the CUDA 13 wheel's
(``nvidia-cuda-nvcc``, which jax[cuda13] installs), then the triton wheel's bundled ptxas, then one on ``PATH`` (an
older ptxas reads an older PTX ISA, so the PTX's ``.version`` is lowered to it, with a warning). Prints
ptxas's performance warnings (C7513: wgmma serialised), registers and spills, and for every ``wait_group 1``
(``WARPGROUP.DEPBAR.LE gsb0, 0x1``) how many MUFU.EX2 instructions run before the next full wait: in an
intra-warpgroup overlap the softmax's exp2s belong there, under the in-flight P · V; and per K/V step loop (a loop
with HGMMAs) its instructions and the spill loads/stores ptxas put in it. Costs no device time. cuobjdump comes from
PATH, the ``nvidia-cuda-cuobjdump`` wheel (with ``nvidia-cuda-nvdisasm``) or the triton wheel. The tool chain and
the SASS parsers are :mod:`pallas_attn.inspection.compiled`'s (``pallas-attn inspect`` reads the same PTX with
``--ptx``).

    python tools/ptx_schedule.py entry_0.ptx [--sass out.sass] [--ptxas PATH]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # pallas_attn from the checkout

from pallas_attn.inspection.compiled import find_ptxas, fit_ptx_version, mma_loops, ptxas_release, run_ptxas  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("ptx", type=pathlib.Path)
    ap.add_argument("--sass", type=pathlib.Path, default=None, help="also write the SASS here")
    ap.add_argument("--ptxas", default=None,
                    help="ptxas to run (default: $PTXAS, the CUDA 13 wheel's, the triton wheel's, PATH's); the "
                         "device's CUDA 13.0 ptxas gives the device's SASS")
    args = ap.parse_args(argv)
    ptx = args.ptx.read_text()
    try:
        ptxas = find_ptxas(args.ptxas)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    ptx, note = fit_ptx_version(ptx, ptxas_release(ptxas))
    if note:
        print(f"warning: {note}", file=sys.stderr)
    try:
        report, sass = run_ptxas(ptx, ptxas)
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 1
    for line in report.log.splitlines():
        if re.search(r"C7\d\d\d|registers|spill", line):
            print(line.strip())
    if args.sass:
        args.sass.write_text(sass)
    lines = sass.splitlines()
    for i, line in enumerate(lines):
        if "WARPGROUP.DEPBAR.LE gsb0, 0x1" not in line:
            continue
        exp2 = 0
        for later in lines[i + 1:]:
            if "WARPGROUP.DEPBAR.LE gsb0, 0x0" in later:
                break
            exp2 += "MUFU.EX2" in later
        print(f"{line.split('*/')[0].strip()}*/ wait_group 1: {exp2} MUFU.EX2 before the next full wait")
    for loop in mma_loops(sass):
        print(loop.describe())
    return 0


if __name__ == "__main__":
    sys.exit(main())
