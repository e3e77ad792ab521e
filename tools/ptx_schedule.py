"""Where ptxas puts a Mosaic GPU kernel's wgmma waits, from a PTX dumped on the device, on a CPU-only machine.

The Mosaic GPU pipeline (MLIR → LLVM → PTX) runs inside the CUDA plugin, so the PTX comes from the device
(``MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_TO=dir``, e.g. with ``python -m benchmarks.lab.ncu_prefill``). The SASS
is only the device's if it comes from the device's own ptxas: jax-cuda13-plugin compiles with CUDA 13.0's, whose
SASS matches ncu's source view instruction for instruction, where the ptxas 12.x of the ``triton`` wheel places the
waits elsewhere. Give that ptxas with ``--ptxas`` or ``$PTXAS``; without either, the triton wheel's bundled ptxas,
then one on ``PATH`` (an older ptxas reads PTX ISA 8.8 at most, so the PTX's ``.version 9.0`` is lowered to 8.8,
with a warning). Prints ptxas's performance warnings (C7513: wgmma serialised), registers and spills, and for every
``wait_group 1`` (``WARPGROUP.DEPBAR.LE gsb0, 0x1``) how many MUFU.EX2 instructions run before the next full wait:
in an intra-warpgroup overlap the softmax's exp2s belong there, under the in-flight P · V; and per K/V step loop
(a loop with HGMMAs) its instructions and the spill loads/stores ptxas put in it. Costs no device time. cuobjdump
comes from PATH, the ``nvidia-cuda-cuobjdump`` wheel (with ``nvidia-cuda-nvdisasm``) or the triton wheel.

    python tools/ptx_schedule.py entry_0.ptx [--sass out.sass] [--ptxas PATH]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile


def triton_bin(name: str) -> str:
    """Path of a CUDA tool bundled in the triton wheel (ptxas, ptxas-blackwell, cuobjdump, nvdisasm)."""
    import triton

    return str(pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def find_ptxas(explicit: str | None = None) -> str:
    """ptxas to run: ``explicit`` (``--ptxas``), then ``$PTXAS``, then the triton wheel's bundled
    ``backends/nvidia/bin/ptxas``, then ``ptxas`` on PATH; raises ``FileNotFoundError`` saying how to provide one."""
    for source, path in (("--ptxas", explicit), ("$PTXAS", os.environ.get("PTXAS"))):
        if path:
            if not (pathlib.Path(path).is_file() and os.access(path, os.X_OK)):
                raise FileNotFoundError(f"{source} {path}: not an executable file")
            return path
    try:
        bundled = triton_bin("ptxas")
        if pathlib.Path(bundled).is_file():
            return bundled
    except ImportError:
        pass
    found = shutil.which("ptxas")
    if found:
        return found
    raise FileNotFoundError("no ptxas: pass --ptxas or set $PTXAS (the device's CUDA 13.0 ptxas gives the device's "
                            "SASS), or pip install triton==3.6.0 (it bundles one), or put ptxas on PATH")


def ptxas_major(ptxas: str) -> int | None:
    """The CUDA release of a ptxas (``ptxas --version``: "... release 13.0, V13.0.88"), or None."""
    out = subprocess.run([ptxas, "--version"], capture_output=True, text=True).stdout
    m = re.search(r"release (\d+)\.", out)
    return int(m[1]) if m else None


def cuobjdump() -> str:
    """cuobjdump from PATH, the ``nvidia-cuda-cuobjdump`` wheel (``pip install nvidia-cuda-cuobjdump``) or the
    triton wheel, whichever is found first."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        import nvidia.cu13  # the nvidia-cuda-cuobjdump wheel's namespace package

        for root in nvidia.cu13.__path__:
            if (path := pathlib.Path(root, "bin", "cuobjdump")).exists():
                return str(path)
    except ImportError:
        pass
    return triton_bin("cuobjdump")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("ptx", type=pathlib.Path)
    ap.add_argument("--sass", type=pathlib.Path, default=None, help="also write the SASS here")
    ap.add_argument("--ptxas", default=None,
                    help="ptxas to run (default: $PTXAS, the triton wheel's, PATH's); the device's CUDA 13.0 "
                         "ptxas gives the device's SASS")
    args = ap.parse_args(argv)
    ptx = args.ptx.read_text()
    try:
        ptxas = find_ptxas(args.ptxas)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    major = ptxas_major(ptxas)
    if major is not None and major < 13 and ".version 9.0" in ptx:  # ptxas 12.x reads PTX ISA 8.8 at most
        print(f"warning: {ptxas} is CUDA {major}: PTX lowered to ISA 8.8; it places the waits unlike the device's "
              "CUDA 13.0 ptxas", file=sys.stderr)
        ptx = ptx.replace(".version 9.0", ".version 8.8", 1)
    with tempfile.TemporaryDirectory() as tmp:
        src, cubin = pathlib.Path(tmp, "k.ptx"), pathlib.Path(tmp, "k.cubin")
        src.write_text(ptx)
        log = subprocess.run([ptxas, "-arch=sm_90a", "-O3", "-v", str(src), "-o", str(cubin)],
                             capture_output=True, text=True)
        if log.returncode:
            print(log.stderr, file=sys.stderr)
            return 1
        tool = cuobjdump()  # it runs nvdisasm, which the wheels install next to it
        env = dict(os.environ, PATH=os.pathsep.join([str(pathlib.Path(tool).parent), os.environ.get("PATH", "")]))
        sass = subprocess.run([tool, "-sass", str(cubin)], capture_output=True, text=True, check=True,
                              env=env).stdout
    for line in log.stderr.splitlines():
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
    for row in matmul_loops(sass):
        print(row)
    return 0


def matmul_loops(sass: str) -> list[str]:
    """One line per loop with an HGMMA (a backward branch's span: the K/V step loops): its instructions, HGMMAs,
    MUFU.EX2s and the local-memory spill traffic ptxas put there (STL / LDL, each address), per trip."""
    body = [(int(m[1], 16), m[2]) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    rows = []
    for n, (addr, ins) in enumerate(body):
        branch = re.search(r"\bBRA (0x[0-9a-f]+)", ins)
        if not branch or int(branch[1], 16) >= addr:
            continue
        if any("SYNCS.PHASECHK" in i for _, i in body[max(n - 4, 0):n]):
            continue  # a barrier wait's out-of-line retry, jumping back into the code it came from: not a loop
        loop = [i for a, i in body if int(branch[1], 16) <= a <= addr]
        if not _count(loop, "HGMMA"):
            continue
        spills = [f"{op} @{a:#x}" for a, i in body if int(branch[1], 16) <= a <= addr
                  for op in ("STL", "LDL") if f" {op}" in f" {i}"]
        rows.append(f"loop {int(branch[1], 16):#x}-{addr:#x}: {len(loop)} instructions, {_count(loop, 'HGMMA')} "
                    f"HGMMA, {_count(loop, 'MUFU.EX2')} MUFU.EX2, spills: {', '.join(spills) or 'none'}")
    return rows


def _count(instructions: list[str], op: str) -> int:
    """Instructions whose opcode starts with ``op`` (past a ``@P`` predicate)."""
    return sum(i.split()[1 if i.startswith("@") else 0].startswith(op) for i in instructions)


if __name__ == "__main__":
    sys.exit(main())
