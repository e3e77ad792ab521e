"""``pallas-attn inspect``: one kernel's compiled facts for sm_90 and the fragment maps of its score and output tiles,
as a dataclass (:func:`inspect_kernel`), as text (:func:`render`) and as a picture (:func:`plot`).

    pallas-attn inspect prefill --workload P1 --backend triton --thread 37 --plot s_tile.png

Triton kernels are compiled here (TTGIR → PTX → SASS with the triton wheel's own ptxas: what runs on the device);
Mosaic GPU kernels compile inside the CUDA plugin, so on a machine without a GPU their facts are what the kernel
declares (warpgroups, ``setmaxnreg``, shared memory, the WGMMA layout), and on a GPU the PTX is dumped and read.
Each section of the output says which of the two it shows.
"""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
from collections.abc import Sequence

import numpy as np

from pallas_attn.inspection import compiled, fragments, targets


@dataclasses.dataclass(frozen=True)
class LaunchFacts:
    """One launch's facts for sm_90. ``source`` says where they come from (compiled code or the kernel's
    declaration); a field that could not be known there is None (``notes`` say why). ``mma``: static counts of the
    matrix instructions in the PTX (declared: the instructions of one K/V step); ``mix``: SASS instruction kinds of
    the whole kernel (:data:`compiled.INSTRUCTION_MIX`); ``loops``: the K/V loops (SASS loops with a matrix
    instruction)."""
    launch: compiled.Launch
    source: str
    threads: int | None = None
    registers: int | None = None
    spill_stores: int | None = None
    spill_loads: int | None = None
    stack_frame: int | None = None
    shared: int | None = None
    programs_per_sm: tuple[int, str] | None = None
    mma: dict[str, int] = dataclasses.field(default_factory=dict)
    mix: dict[str, int] | None = None
    loops: tuple[compiled.SassLoop, ...] = ()
    warnings: tuple[str, ...] = ()
    declared: dict[str, str] = dataclasses.field(default_factory=dict)
    notes: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class KernelInspection:
    """What :func:`inspect_kernel` found: the call, each launch's :class:`LaunchFacts`, the fragment maps of the
    attention launch's score tile ``S`` and output accumulator ``O`` (:class:`fragments.FragmentMap`), and the
    chosen thread (None: none)."""
    call: targets.Call
    launches: tuple[LaunchFacts, ...]
    maps: tuple[fragments.FragmentMap, ...]
    attention_launch: int
    thread: int | None = None

    @property
    def threads(self) -> int:
        """Threads of the attention launch's program."""
        facts = self.launches[self.attention_launch]
        return facts.threads if facts.threads is not None else len(self.maps[0].threads_in_program)

    def elements_of(self, thread: int) -> dict[str, list[fragments.Element]]:
        """Per tile name, what ``thread`` holds."""
        return {m.name: m.elements_of(thread) for m in self.maps}


# --------------------------------------------------------------------------------------------- the facts
def _triton_facts(launch: compiled.Launch, value_cols: int) -> tuple[LaunchFacts, list[fragments.FragmentMap]]:
    artifacts = compiled.compile_triton(launch)
    ptxas = compiled.triton_bin("ptxas")
    report, sass = compiled.run_ptxas(artifacts.ptx, ptxas)
    threads = compiled.ptx_threads(artifacts.ptx) or 32 * launch.num_warps
    source = (f"compiled here: triton {artifacts.triton_version} (TTGIR, PTX) and its bundled ptxas "
              f"{compiled.ptxas_release(ptxas)} (SASS), what Triton itself runs on the device")
    facts = LaunchFacts(
        launch, source, threads, report.registers, report.spill_stores, report.spill_loads, report.stack_frame,
        artifacts.shared, compiled.programs_per_sm(report.registers, threads, artifacts.shared),
        compiled.ptx_mma_instructions(artifacts.ptx),
        compiled.instruction_mix(i for _, i in compiled.sass_instructions(sass)),
        tuple(compiled.mma_loops(sass)), report.warnings)
    return facts, _triton_maps(compiled.ttgir_dots(artifacts.ttgir), value_cols)


def _triton_maps(dots: list[compiled.TtgirDot], value_cols: int) -> list[fragments.FragmentMap]:
    """S and O of the TTGIR's dots: ``O = P · V`` is the product whose result is ``value_cols`` wide, ``S``
    the first other one (Q Kᵀ comes first in program order: when both have the same shape, the first is S)."""
    if not dots:
        return []
    o_dots = [d for d in dots if d.shape[1] == value_cols]
    s_dots = [d for d in dots if d.shape[1] != value_cols] or dots[:1]
    o_dots = [d for d in o_dots if d is not s_dots[0]] or o_dots
    maps = [fragments.triton_mma_map(s_dots[0].encoding, s_dots[0].shape, "S")]
    if o_dots:
        maps.append(fragments.triton_mma_map(o_dots[-1].encoding, o_dots[-1].shape, "O"))
    return maps


def _mosaic_facts(call: targets.Call, launch: compiled.Launch, ptx_texts: list[str] | None,
                  ptxas: str | None) -> tuple[LaunchFacts, list[fragments.FragmentMap]]:
    declared = targets.mosaic_declared(call)
    launch = dataclasses.replace(launch, name=f"{launch.name}: the Mosaic GPU {call.kernel} kernel")
    if not ptx_texts:
        notes = ("Mosaic GPU compiles inside the CUDA plugin: registers, spills, the instruction mix and the K/V "
                 "loops need its PTX, dumped on a GPU (run inspect there, or pass a dump with --ptx); the program's "
                 "register budget is the setmaxnreg figures above",)
        occupancy = (compiled.programs_per_sm(None, declared.threads, declared.shared)
                     if declared.shared is not None else None)
        return LaunchFacts(launch, "declared by the kernel's source (no compiled code on this machine)",
                           declared.threads, shared=declared.shared, programs_per_sm=occupancy,
                           declared=declared.facts, notes=notes), list(declared.maps)
    ptx = ptx_texts[0]
    ptxas = ptxas or compiled.find_ptxas()
    release = compiled.ptxas_release(ptxas)
    ptx, note = compiled.fit_ptx_version(ptx, release)
    notes = (note,) if note else ()
    report, sass = compiled.run_ptxas(ptx, ptxas)
    threads = compiled.ptx_threads(ptx) or declared.threads
    facts = LaunchFacts(
        launch, f"compiled: the device's PTX (MOSAIC_GPU_DUMP_PTX) through ptxas {release}; the layouts are the "
                "kernel's declared ones", threads, report.registers, report.spill_stores, report.spill_loads,
        report.stack_frame, declared.shared,
        compiled.programs_per_sm(report.registers, threads, declared.shared or 0),
        compiled.ptx_mma_instructions(ptx), compiled.instruction_mix(i for _, i in compiled.sass_instructions(sass)),
        tuple(compiled.mma_loops(sass)), report.warnings, declared.facts, notes)
    return facts, list(declared.maps)


def inspect_kernel(kernel: str, workload: str | None = None, *, backend: str | None = None,
                   thread: int | None = None, tiny: bool = False, ptx: Sequence[str] | None = None,
                   ptxas: str | None = None) -> KernelInspection:
    """The compiled facts (sm_90) and fragment maps of ``kernel`` ("prefill", "decode", "paged", "sparse_mla") on
    ``workload``'s shapes (default: its standard workload; ``tiny``: the harness's ``--tiny`` twin).

    ``backend``: "triton" or "mosaic" (default: what an H200 picks for these shapes). ``thread``: a thread of the
    attention launch's program whose elements to list (ValueError when out of range). ``ptx``: Mosaic GPU PTX
    texts dumped on a device; None (default): dumped here when this machine has a GPU, else none; ``()``: none,
    the declared facts only. ``ptxas``: the ptxas for them (default :func:`compiled.find_ptxas`).

    Example::

        report = inspect_kernel("decode", "D1", thread=37)
        report.maps[0].instruction          # 'mma.sync.m16n8k16'
        report.elements_of(37)["S"][0]      # Element(row=1, col=10, register=0, fragment='c0', instance=0)
    """
    call = targets.build_call(kernel, workload, backend, tiny=tiny)
    launches = compiled.lower_launches(call.fn, call.args)
    dump_failed = None
    if call.backend == "mosaic":
        _check_thread(thread, targets.mosaic_declared(call).threads, "the Mosaic GPU kernel")  # before a dump
        from pallas_attn.core import backend as backend_lib

        if ptx is None and backend_lib.on_gpu():
            try:
                ptx = targets.dump_mosaic_ptx(call)
            except (RuntimeError, subprocess.SubprocessError) as e:  # the declared facts still stand
                dump_failed = f"the PTX dump failed: {str(e).strip()[-300:]}"
    facts, maps, attention, missing = [], [], None, None
    for launch in launches:
        if launch.backend == "triton":
            try:
                f, m = _triton_facts(launch, call.value_cols)
            except ImportError as e:  # no triton wheel: this launch's facts and layouts stay unknown
                missing = e
                f, m = LaunchFacts(launch, "not compiled", 32 * launch.num_warps, notes=(str(e),)), []
        else:
            f, m = _mosaic_facts(call, launch, list(ptx) if ptx else None, ptxas)
            if dump_failed:
                f = dataclasses.replace(f, notes=(*f.notes, dump_failed))
        facts.append(f)
        if m and attention is None:  # the first launch with matrix products: the attention kernel
            maps, attention = m, launch.index
    if attention is None and missing is not None:
        raise missing
    if attention is None:
        raise RuntimeError(f"no launch of {kernel} on {call.workload} has a matrix product: nothing to map")
    report = KernelInspection(call, tuple(facts), tuple(maps), attention, thread)
    _check_thread(thread, report.threads, launches[attention].name)
    return report


def _check_thread(thread: int | None, threads: int, launch: str) -> None:
    if thread is not None and not 0 <= thread < threads:
        raise ValueError(f"--thread {thread} is outside the program's threads [0, {threads}) of {launch}")


# ------------------------------------------------------------------------------------------------- text
def _thread_place(thread: int) -> str:
    warp, lane = divmod(thread, fragments.WARP_SIZE)
    return (f"warp {warp} (warpgroup {thread // fragments.WARPGROUP_THREADS}, warp {warp % 4} in it), lane {lane}: "
            f"groupID {lane >> 2}, threadID_in_group {lane % 4}")


def _warp_blocks(m: fragments.FragmentMap) -> list[str]:
    """The owning warp of each 8×8 block, one character each (hex; ``*``: a block of several warps)."""
    owner = m.owner() // fragments.WARP_SIZE
    rows, cols = m.shape
    sep = " " if cols // 8 <= 32 else ""
    lines = []
    for r in range(0, rows, 8):
        cells = []
        for c in range(0, cols, 8):
            block = np.unique(owner[r:r + 8, c:c + 8])
            cells.append(f"{int(block[0]):x}" if block.size == 1 else "*")
        lines.append(f"    rows {r:3d}-{r + 7:<3d} " + sep.join(cells))
    return lines


def _lane_pattern(m: fragments.FragmentMap) -> list[str]:
    lanes = m.owner()[:8, :8] % fragments.WARP_SIZE
    return ["    " + " ".join(f"{int(x):2d}" for x in row) for row in lanes]


def _facts_lines(f: LaunchFacts) -> list[str]:
    launch = f.launch
    head = f"[{launch.index}] {launch.name} ({launch.backend}"
    if launch.backend == "triton":
        head += f", num_warps {launch.num_warps}, num_stages {launch.num_stages}, grid {launch.grid}"
    lines = [head + ")", f"  source: {f.source}"]
    known = []
    if f.threads is not None:
        known.append(f"threads {f.threads}")
    if f.registers is not None:
        known.append(f"registers a thread {f.registers}")
    if f.spill_stores is not None:
        known.append(f"spills {f.spill_stores} B stored / {f.spill_loads} B loaded, stack frame {f.stack_frame} B")
    if f.shared is not None:
        known.append(f"shared memory {f.shared:,} B" + (" (the kernel's buffers, barriers aside)"
                                                         if launch.backend == "mosaic" else ""))
    if f.programs_per_sm is not None:
        count, limiter = f.programs_per_sm
        known.append(f"programs per SM {count} (bound by {limiter}; from the figures, not measured)")
    lines += [f"  {x}" for x in known]
    for key, value in f.declared.items():
        lines.append(f"  {key}: {value}")
    if f.mma:
        lines.append("  matrix instructions (PTX, static): " + ", ".join(f"{n} × {k}" for k, n in f.mma.items()))
    if f.mix is not None:
        lines.append("  instruction mix (SASS, static counts in the code, not executed counts):")
        heads = [k for k, v in f.mix.items() if v or any(loop.mix[k] for loop in f.loops)]
        if not heads:
            lines[-1] += " none of the kinds tracked (matrix, exp2, shuffles, barriers, async copies, spills)"
        width = max(len(k) for k in heads) if heads else 0
        cols = ["whole kernel"] + [f"loop {loop.start:#x}" for loop in f.loops]
        lines += [f"    {'':{width}s}  " + "  ".join(f"{c:>14s}" for c in cols)] if heads else []
        for k in heads:
            values = [f.mix[k]] + [loop.mix[k] for loop in f.loops]
            lines.append(f"    {k:{width}s}  " + "  ".join(f"{v:>14d}" for v in values))
        for loop in f.loops:
            lines.append(f"    K/V {loop.describe()}")
    for w in f.warnings:
        lines.append(f"  ptxas: {w}")
    lines += [f"  not known here: {n}" for n in f.notes]
    return lines


def _thread_lines(m: fragments.FragmentMap, thread: int) -> list[str]:
    elements = m.elements_of(thread)
    if not elements:
        return [f"  {m.name}: thread {thread} holds none of it"]
    base = m.base_thread(thread)
    mirror = f" (the registers thread {base} has for its warpgroup's own item)" if base != thread else ""
    out = [f"  {m.name}: {len(elements)} elements in {len(elements)} float32 registers{mirror}"]
    for i in range(0, len(elements), 4):
        cells = []
        for e in elements[i:i + 4]:
            name = e.fragment + (f"#{e.instance}" if m.num_registers > m.fragment_registers else "")
            cells.append(f"{name:>7s} ({e.row:3d}, {e.col:3d})")
        out.append("   " + "   ".join(cells))
    return out


def render(report: KernelInspection) -> str:
    """The report as text: the call, each launch's facts, the fragment maps and the chosen thread's elements."""
    call = report.call
    lines = [f"pallas-attn inspect: {call.kernel} ({targets.KERNELS[call.kernel].function}), backend {call.backend}, "
             f"for sm_90 (H200)", f"workload {call.describe()}", "", "== launches: compiled facts =="]
    for f in report.launches:
        lines += _facts_lines(f) + [""]
    attention = report.launches[report.attention_launch].launch
    lines.append(f"== fragment maps: the accumulators of one program of [{attention.index}] {attention.name} ==")
    for m in report.maps:
        copies = m.holders()
        lines += [f"{m.name} [{m.shape[0]}, {m.shape[1]}] float32"
                  + (f" (columns {m.col_offset}..{m.col_offset + m.shape[1] - 1} of O)" if m.col_offset else "")
                  + f": {m.instruction}, {m.fragment_registers} accumulator registers a thread per instruction",
                  f"  layout: {m.source}"]
        if m.note:
            lines.append(f"  {m.note}")
        if (copies > 1).any():
            lines.append(f"  each element is held by {int(copies.max())} threads (warps past the tile repeat it)")
        lines.append("  owning warp of each 8x8 block (rows down, columns across in blocks of 8):")
        lines += _warp_blocks(m)
    lines += ["inside each 8x8 block, the lane holding each element (the instruction's pattern: two adjacent "
              "columns a lane, four lanes a row):"] + _lane_pattern(report.maps[0])
    if report.thread is not None:
        lines += ["", f"== thread {report.thread}: {_thread_place(report.thread)} ==",
                  "  register (row, col) of the tile; c0..c3 / d0..: the instruction's accumulator registers, "
                  "#k: the thread's k-th instruction tile"]
        for m in report.maps:
            lines += _thread_lines(m, report.thread)
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- picture
def draw(maps: Sequence[fragments.FragmentMap], thread: int | None = None, title: str = ""):
    """A matplotlib figure: each tile of ``maps`` coloured by owning warp, ``thread``'s elements marked."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap

    # tab20 reordered so neighbouring warps get unlike colours (its pairs are light/dark shades of one hue)
    palette = [plt.get_cmap("tab20")(i) for i in (*range(0, 20, 2), *range(1, 20, 2))]
    fig, axes = plt.subplots(1, len(maps), figsize=(4.6 * len(maps), 4.8), squeeze=False)
    for ax, m in zip(axes[0], maps):
        warps = m.owner() // fragments.WARP_SIZE
        count = int(warps.max()) + 1
        image = ax.imshow(warps, cmap=ListedColormap(palette[:count]), vmin=-0.5, vmax=count - 0.5,
                          interpolation="nearest", aspect="auto",
                          extent=(m.col_offset - 0.5, m.col_offset + m.shape[1] - 0.5, m.shape[0] - 0.5, -0.5))
        fig.colorbar(image, ax=ax, ticks=range(count), label="warp", shrink=0.8)
        label = f"{m.name} [{m.shape[0]}, {m.shape[1]}]: {m.instruction}, colour: owning warp"
        if thread is not None:
            held = m.elements_of(thread)
            if held:
                ax.scatter([e.col for e in held], [e.row for e in held], s=7, c="black", marker="s")
            label += f"\n■ thread {thread}: {len(held)} elements"
        ax.set_title(label, fontsize=8)
        ax.set_xlabel("column")
        ax.set_ylabel("row")
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig


def plot(report: KernelInspection, path: str) -> None:
    """:func:`draw` of the report's tiles and thread, written to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig = draw(report.maps, report.thread, f"{report.call.kernel} {report.call.workload} ({report.call.backend}): "
                                           "who holds the accumulators")
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------- command
def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="pallas-attn inspect", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="One kernel's compiled facts for sm_90 and which thread holds which element of its score and "
                    "output tiles (docs/threads.md).",
        epilog="examples:\n  pallas-attn inspect prefill --workload P1 --backend triton --thread 37 --plot s.png\n"
               "  pallas-attn inspect decode --workload D1 --tiny")
    ap.add_argument("kernel", help=f"one of {', '.join(targets.KERNELS)}")
    ap.add_argument("--workload", default=None, help="a workload id (P1, D1, V1, S1, ...; default: the kernel's)")
    ap.add_argument("--backend", default=None, choices=("triton", "mosaic"),
                    help="default: what an H200 runs for these shapes")
    ap.add_argument("--thread", type=int, default=None, help="list the elements and registers of this thread")
    ap.add_argument("--plot", default=None, metavar="PNG", help="write a picture of the tiles here")
    ap.add_argument("--tiny", action="store_true", help="the workload's --tiny twin (seconds on a CPU)")
    ap.add_argument("--ptx", action="append", default=None, metavar="FILE",
                    help="Mosaic GPU PTX dumped on a device (MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_TO=dir)")
    ap.add_argument("--ptxas", default=None, help="ptxas for --ptx (default: $PTXAS, the CUDA 13 wheel's, ...)")
    return ap.parse_args(list(argv))


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        ptx = [open(p).read() for p in args.ptx] if args.ptx else None
        report = inspect_kernel(args.kernel, args.workload, backend=args.backend, thread=args.thread,
                                tiny=args.tiny, ptx=ptx, ptxas=args.ptxas)
    except (ValueError, LookupError, ImportError, FileNotFoundError, OSError) as e:
        print(f"pallas-attn inspect: {e}", file=sys.stderr)
        return 2
    print(render(report))
    if args.plot:
        plot(report, args.plot)
        print(f"\nwrote {args.plot}")
    return 0
