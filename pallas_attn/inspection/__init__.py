"""The thread layer made visible: which thread of a kernel's program holds which element of its score tile ``S``
and output accumulator ``O``, and what the compiler made of the kernel for sm_90 (docs/threads.md).

Block sizes, warps and stages are tuning knobs; who holds what inside a tile is the compiler's choice, fixed by the
matrix instruction it picks (``mma.sync.m16n8k16`` or ``wgmma.m64nNk16``) and that instruction's documented
accumulator layout. This package reads the choice from the compiled kernel (Triton: its TTGIR) or from the kernel's
declared layout (Mosaic GPU), and lays the PTX ISA's fragment figures over it.

* :func:`inspect_kernel` → :class:`KernelInspection`: per launch, registers, spills, shared memory, programs per
  SM, the matrix instructions and the instruction mix of each K/V loop; the :class:`FragmentMap` of ``S`` and ``O``.
* :func:`render` (text), :func:`plot` (a PNG), :func:`draw` (a figure of any maps); on the command line
  ``pallas-attn inspect KERNEL ...``.
* :mod:`.fragments`: the layouts (PTX ISA formulas, Triton's MMA encoding, Mosaic GPU's WGMMA layout).
* :mod:`.compiled`: lowering for an abstract H200, the offline Triton compile, parsers of TTGIR, PTX, ptxas and SASS.
* :mod:`.targets`: kernels × workloads → the public call on abstract shapes; Mosaic GPU's declared facts.

Example::

    from pallas_attn.inspection import inspect_kernel, render
    report = inspect_kernel("decode", "D1", thread=37)   # needs triton==3.6.0 for the compile (CPU is fine)
    print(render(report))
"""

from pallas_attn.inspection import compiled, fragments, targets
from pallas_attn.inspection.fragments import Element, FragmentMap
from pallas_attn.inspection.report import KernelInspection, LaunchFacts, draw, inspect_kernel, main, plot, render

__all__ = ["Element", "FragmentMap", "KernelInspection", "LaunchFacts", "compiled", "draw", "fragments",
           "inspect_kernel", "main", "plot", "render", "targets"]
