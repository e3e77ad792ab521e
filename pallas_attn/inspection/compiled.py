"""What the compiler made of a kernel for sm_90, on any machine: lowering, the offline compile, and the parsers of
its outputs (TTGIR, PTX, ``ptxas -v``, SASS).

Pallas Triton kernels lower to Triton IR inside JAX; on a machine without a GPU an abstract H200 gives the lowering
its compute capability, and the ``triton`` package (3.6, the GPU machine's release; its wheel bundles ``ptxas``
12.8, ``cuobjdump`` and ``nvdisasm``) compiles that IR exactly as it does on the device: the same TTGIR, PTX and,
through the same ptxas, SASS. Mosaic GPU kernels compile inside the CUDA plugin, so their PTX exists only on a GPU
(``MOSAIC_GPU_DUMP_PTX=1``); the device's own ptxas (CUDA 13.0, from the ``nvidia-cuda-nvcc`` wheel JAX installs
or ``$PTXAS``) turns it into the device's SASS, an older one places the wgmma waits elsewhere.

The parsers take text, so they run everywhere (tests/fixtures holds a few lines of each format); the compile needs
``triton`` (``pip install triton==3.6.0``) and says so when it is missing.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import shutil
import subprocess
import tempfile

from pallas_attn.inspection.fragments import MmaEncoding

SM90_ARCH = "sm_90a"  # wgmma and setmaxnreg are sm_90a instructions; Triton and Mosaic GPU both target it
H200_DEVICE_KIND = "NVIDIA H200"
H200_NUM_SMS = 132
# Per-SM limits of sm_90 (CUDA C Programming Guide, "Technical Specifications per Compute Capability"): the
# occupancy bounds below follow from them.
REGISTERS_PER_SM = 65536
REGISTER_ALLOC_UNIT = 256  # registers are handed to a warp in units of 256 (8 a thread)
MAX_REGISTERS_PER_THREAD = 255
MAX_WARPS_PER_SM = 64
MAX_BLOCKS_PER_SM = 32
SHARED_PER_SM = 233_472  # 228 KB
SHARED_RESERVED_PER_BLOCK = 1024  # the system's share of each resident block
TRITON_CUSTOM_CALL = "__gpu$xla.gpu.triton"
MOSAIC_CUSTOM_CALL = "mosaic_gpu"  # mosaic_gpu_v2 in jax 0.11: matched as a prefix


# ------------------------------------------------------------------------------------------------- tool chain
def triton_bin(name: str) -> str:
    """Path of a CUDA tool bundled in the triton wheel (ptxas, ptxas-blackwell, cuobjdump, nvdisasm)."""
    import triton

    return str(pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def triton_version() -> str | None:
    """The installed ``triton`` package's version, or None when it cannot be imported."""
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def _cuda13_wheel_bin(name: str) -> str | None:
    """``name`` from the ``nvidia.cu13`` wheels (``nvidia-cuda-nvcc``: ptxas, which jax[cuda13] installs;
    ``nvidia-cuda-cuobjdump``), or None."""
    try:
        import nvidia.cu13
    except ImportError:
        return None
    for root in nvidia.cu13.__path__:
        if (path := pathlib.Path(root, "bin", name)).is_file():
            return str(path)
    return None


def find_ptxas(explicit: str | None = None) -> str:
    """ptxas for a Mosaic GPU PTX: ``explicit`` (``--ptxas``), then ``$PTXAS``, then the CUDA 13 wheel's (the
    device's compiler when jax[cuda13] is installed), then the triton wheel's bundled ``backends/nvidia/bin/ptxas``,
    then ``ptxas`` on PATH; raises ``FileNotFoundError`` saying how to provide one."""
    for source, path in (("--ptxas", explicit), ("$PTXAS", os.environ.get("PTXAS"))):
        if path:
            if not (pathlib.Path(path).is_file() and os.access(path, os.X_OK)):
                raise FileNotFoundError(f"{source} {path}: not an executable file")
            return path
    found = _cuda13_wheel_bin("ptxas")
    if found:
        return found
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


def ptxas_release(ptxas: str) -> str | None:
    """The CUDA release of a ptxas (``ptxas --version``: "... release 13.0, V13.0.88" → "13.0"), or None."""
    out = subprocess.run([ptxas, "--version"], capture_output=True, text=True).stdout
    m = re.search(r"release (\d+\.\d+)", out)
    return m[1] if m else None


# The newest PTX ISA each CUDA release's ptxas reads (PTX ISA document, "Release notes").
PTX_ISA_OF_RELEASE = {"12.4": "8.4", "12.5": "8.5", "12.6": "8.5", "12.8": "8.7", "12.9": "8.8", "13.0": "9.0",
                      "13.1": "9.1"}


def fit_ptx_version(ptx: str, release: str | None) -> tuple[str, str | None]:
    """``(ptx, note)``: ``ptx`` with its ``.version`` lowered to the newest ISA the ptxas of CUDA ``release``
    reads (the kernels use no instruction newer than ISA 8.0, so only the header changes), and a note saying so,
    or ``ptx`` unchanged and None. The triton wheel's ptxas (CUDA 12.8, ISA 8.7) must read the device's PTX
    (ISA 8.8 under jax 0.11, 9.0 under jax 0.12); its SASS may then place the wgmma waits unlike the device's."""
    declared = re.search(r"^\s*\.version (\d+)\.(\d+)", ptx, re.M)
    readable = PTX_ISA_OF_RELEASE.get(release or "")
    if not (declared and readable):
        return ptx, None
    top = tuple(int(x) for x in readable.split("."))
    if (int(declared[1]), int(declared[2])) <= top:
        return ptx, None
    lowered = ptx[:declared.start()] + ptx[declared.start():].replace(declared[0].strip(), f".version {readable}", 1)
    return lowered, (f"ptxas {release} reads PTX ISA {readable} at most: the PTX's .version "
                     f"{declared[1]}.{declared[2]} was lowered to it, so its SASS may place the wgmma waits unlike "
                     "the device's CUDA 13.0 ptxas")


def cuobjdump() -> str:
    """cuobjdump from PATH, the ``nvidia-cuda-cuobjdump`` wheel (``pip install nvidia-cuda-cuobjdump``) or the
    triton wheel, whichever is found first."""
    return shutil.which("cuobjdump") or _cuda13_wheel_bin("cuobjdump") or triton_bin("cuobjdump")


# ---------------------------------------------------------------------------------------------------- lowering
@dataclasses.dataclass(frozen=True)
class Launch:
    """One kernel launch of a lowered function, in program order: ``backend`` "triton" (with its Triton IR,
    ``num_warps``, ``num_stages`` and grid from the launch's config) or "mosaic" (nothing readable on a CPU)."""
    index: int
    name: str
    backend: str
    num_warps: int | None = None
    num_stages: int | None = None
    grid: tuple[int, int, int] | None = None
    ttir: str | None = None


def abstract_h200():
    """An abstract one-device H200 mesh: lowering for sm_90 without a GPU (``jax.sharding.use_abstract_mesh``)."""
    from jax._src.mesh import AbstractDevice
    from jax.sharding import AbstractMesh

    device = AbstractDevice(device_kind=H200_DEVICE_KIND, num_cores=H200_NUM_SMS, platform="cuda")
    return AbstractMesh((1,), ("x",), abstract_device=device)


def lower_launches(fn, args) -> list[Launch]:
    """Every Pallas launch of ``jax.jit(fn)(*args)`` (``args``: ``jax.ShapeDtypeStruct`` pytrees) lowered for an
    H200, read from the custom calls of the lowered module: nothing global is patched."""
    import jax
    from jax._src.lib.mlir import ir
    from jax._src.pallas.triton import lowering as triton_lowering

    with jax.sharding.use_abstract_mesh(abstract_h200()):
        module = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).compiler_ir("stablehlo")
    launches: list[Launch] = []

    def visit(op):
        for region in op.regions:
            for block in region.blocks:
                for child in block.operations:
                    if child.operation.name == "stablehlo.custom_call":
                        add(child.operation)
                    visit(child.operation)

    def add(op):
        target = ir.StringAttr(op.attributes["call_target_name"]).value
        if target == TRITON_CUSTOM_CALL:
            config = ir.DictAttr(op.attributes["mhlo.backend_config"])
            # the Triton IR travels as MLIR bytecode; JAX's own context (with the tt dialect) prints it as text
            ttir = ir.Module.parse(ir.StringAttr(config["ir"]).value_bytes, context=triton_lowering._new_ir_context())
            value = lambda key: ir.IntegerAttr(config[key]).value  # noqa: E731
            launches.append(Launch(len(launches), ir.StringAttr(config["name"]).value, "triton", value("num_warps"),
                                   value("num_stages"), (value("grid_x"), value("grid_y"), value("grid_z")),
                                   ttir.operation.get_asm(enable_debug_info=False)))
        elif target.startswith(MOSAIC_CUSTOM_CALL):
            launches.append(Launch(len(launches), target, "mosaic"))

    visit(module.operation)
    return launches


# ------------------------------------------------------------------------------------------- Triton's compile
@dataclasses.dataclass(frozen=True)
class TritonArtifacts:
    """What ``triton.compile`` made of one launch for sm_90: TTGIR (the layouts), PTX, and the dynamic shared
    memory the launch asks for."""
    ttgir: str
    ptx: str
    shared: int
    triton_version: str


def compile_triton(launch: Launch) -> TritonArtifacts:
    """``launch``'s Triton IR compiled for sm_90 with its own ``num_warps`` / ``num_stages``; raises ImportError
    naming the wheel when ``triton`` is not installed."""
    try:
        import triton
        from triton.backends.compiler import GPUTarget
    except ImportError as e:
        raise ImportError("the offline compile needs the triton package: pip install triton==3.6.0 (the GPU "
                          "machine's release; its wheel bundles ptxas)") from e
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp, "kernel.ttir")
        path.write_text(launch.ttir)
        compiled = triton.compile(str(path), target=GPUTarget("cuda", 90, 32),
                                  options=dict(num_warps=launch.num_warps, num_stages=launch.num_stages))
    return TritonArtifacts(compiled.asm["ttgir"], compiled.asm["ptx"], int(compiled.metadata.shared),
                           triton.__version__)


# ------------------------------------------------------------------------------------------------------ ptxas
@dataclasses.dataclass(frozen=True)
class PtxasReport:
    """``ptxas -v``'s account of one kernel: registers a thread, spill traffic (bytes a thread), stack frame,
    named barriers, and its performance warnings (``C7xxx``, e.g. C7513: wgmma serialised)."""
    registers: int
    spill_stores: int
    spill_loads: int
    stack_frame: int
    barriers: int
    warnings: tuple[str, ...] = ()
    log: str = dataclasses.field(default="", repr=False, compare=False)  # the whole log, for tools that print it


def parse_ptxas_log(log: str) -> PtxasReport:
    """The first kernel's figures in a ``ptxas -v`` log; ValueError when the log has none."""
    regs = re.search(r"Used (\d+) registers", log)
    frame = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if regs is None or frame is None:
        raise ValueError("not a ptxas -v log: no 'Used N registers' and 'bytes stack frame' lines")
    barriers = re.search(r"used (\d+) barriers", log)
    warnings = tuple(line.strip() for line in log.splitlines() if re.search(r"\bC7\d\d\d\b", line))
    return PtxasReport(int(regs[1]), int(frame[2]), int(frame[3]), int(frame[1]),
                       int(barriers[1]) if barriers else 0, warnings, log)


def run_ptxas(ptx: str, ptxas: str, *, arch: str = SM90_ARCH) -> tuple[PtxasReport, str]:
    """``(report, sass)`` of ``ptx`` compiled by ``ptxas -v -O3`` for ``arch`` (Triton's own invocation) and
    disassembled by :func:`cuobjdump`; RuntimeError with ptxas's message when it fails."""
    with tempfile.TemporaryDirectory() as tmp:
        src, cubin = pathlib.Path(tmp, "k.ptx"), pathlib.Path(tmp, "k.cubin")
        src.write_text(ptx)
        log = subprocess.run([ptxas, "-v", "-O3", f"--gpu-name={arch}", str(src), "-o", str(cubin)],
                             capture_output=True, text=True)
        if log.returncode:
            raise RuntimeError(f"{ptxas} failed:\n{log.stderr}")
        tool = cuobjdump()  # it runs nvdisasm, which the wheels install next to it
        env = dict(os.environ, PATH=os.pathsep.join([str(pathlib.Path(tool).parent), os.environ.get("PATH", "")]))
        sass = subprocess.run([tool, "-sass", str(cubin)], capture_output=True, text=True, check=True,
                              env=env).stdout
    return parse_ptxas_log(log.stderr + log.stdout), sass


# ------------------------------------------------------------------------------------------------------- SASS
# The instructions that say how an attention kernel runs, by SASS opcode prefix.
INSTRUCTION_MIX: dict[str, tuple[str, ...]] = {
    "wgmma (HGMMA)": ("HGMMA",),
    "mma.sync (HMMA)": ("HMMA",),
    "exp2 (MUFU.EX2)": ("MUFU.EX2",),
    "shuffles (SHFL)": ("SHFL",),
    "barriers (BAR, SYNCS)": ("BAR", "SYNCS"),
    "wgmma waits (WARPGROUP.DEPBAR)": ("WARPGROUP.DEPBAR",),
    "TMA (UTMALDG, UTMASTG, UBLKCP)": ("UTMALDG", "UTMASTG", "UBLKCP"),
    "cp.async (LDGSTS)": ("LDGSTS",),
    "ldmatrix (LDSM)": ("LDSM",),
    "spill stores (STL)": ("STL",),
    "spill loads (LDL)": ("LDL",),
}
MMA_OPCODES = ("HGMMA", "HMMA")


def sass_instructions(sass: str) -> list[tuple[int, str]]:
    """``(address, instruction)`` of every instruction in ``cuobjdump -sass`` text (without the ``;``)."""
    return [(int(m[1], 16), m[2].strip()) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]


def opcode(instruction: str) -> str:
    """The opcode of a SASS instruction, past a ``@P0`` / ``@!P0`` predicate."""
    words = instruction.split()
    return words[1] if words and words[0].startswith("@") and len(words) > 1 else (words[0] if words else "")


def instruction_mix(instructions) -> dict[str, int]:
    """Static counts of :data:`INSTRUCTION_MIX`'s kinds among ``instructions`` (strings), in the code, not as
    executed."""
    ops = [opcode(i) for i in instructions]
    return {kind: sum(op.startswith(prefixes) for op in ops) for kind, prefixes in INSTRUCTION_MIX.items()}


@dataclasses.dataclass(frozen=True)
class SassLoop:
    """A loop of the SASS (a backward branch's span) holding matrix instructions: the K/V step loops. ``mix``:
    :func:`instruction_mix` of its body; ``spills``: its local-memory stores and loads with their addresses."""
    start: int
    end: int
    instructions: int
    mix: dict[str, int]
    spills: tuple[str, ...]

    def describe(self) -> str:
        mma = ", ".join(f"{self.mix[k]} {k.split()[-1].strip('()')}" for k in ("wgmma (HGMMA)", "mma.sync (HMMA)")
                        if self.mix[k])
        return (f"loop {self.start:#x}-{self.end:#x}: {self.instructions} instructions, {mma}, "
                f"{self.mix['exp2 (MUFU.EX2)']} MUFU.EX2, spills: {', '.join(self.spills) or 'none'}")


def mma_loops(sass: str) -> list[SassLoop]:
    """Every loop of ``sass`` with an HGMMA or HMMA in it, in address order."""
    body = sass_instructions(sass)
    loops = []
    for n, (addr, ins) in enumerate(body):
        branch = re.search(r"\bBRA (0x[0-9a-f]+)", ins)
        if not branch or int(branch[1], 16) >= addr:
            continue
        if any("SYNCS.PHASECHK" in i for _, i in body[max(n - 4, 0):n]):
            continue  # a barrier wait's out-of-line retry, jumping back into the code it came from: not a loop
        start = int(branch[1], 16)
        span = [i for a, i in body if start <= a <= addr]
        if not any(opcode(i).startswith(MMA_OPCODES) for i in span):
            continue
        spills = tuple(f"{op} @{a:#x}" for a, i in body if start <= a <= addr
                       for op in ("STL", "LDL") if opcode(i).startswith(op))
        loops.append(SassLoop(start, addr, len(span), instruction_mix(span), spills))
    return loops


# -------------------------------------------------------------------------------------------------------- PTX
def ptx_mma_instructions(ptx: str) -> dict[str, int]:
    """Static counts of the matrix instructions in ``ptx``, by shape: ``{"wgmma.m64n128k16": 32}``,
    ``{"mma.sync.m16n8k16": 128}``."""
    counts: dict[str, int] = {}
    for m in re.finditer(r"\b(wgmma\.mma_async|mma\.sync)(?:\.aligned|\.sync)*\.(m\d+n\d+k\d+)", ptx):
        name = f"{'wgmma' if m[1].startswith('wgmma') else 'mma.sync'}.{m[2]}"
        counts[name] = counts.get(name, 0) + 1
    return counts


def ptx_threads(ptx: str) -> int | None:
    """Threads a block of the PTX's first kernel (``.reqntid`` / ``.maxntid``), or None."""
    m = re.search(r"\.(?:reqntid|maxntid)\s+(\d+)(?:\s*,\s*(\d+))?(?:\s*,\s*(\d+))?", ptx)
    if m is None:
        return None
    return int(m[1]) * int(m[2] or 1) * int(m[3] or 1)


# ------------------------------------------------------------------------------------------------------ TTGIR
@dataclasses.dataclass(frozen=True)
class TtgirDot:
    """A matrix product of the TTGIR: ``op`` (``tt.dot``: mma.sync; ``ttng.warp_group_dot``: wgmma), its
    float32 result's ``shape`` and the ``#ttg.nvidia_mma`` ``encoding`` of that result."""
    op: str
    shape: tuple[int, int]
    alias: str
    encoding: MmaEncoding


def parse_mma_encodings(ttgir: str) -> dict[str, MmaEncoding]:
    """The ``#alias = #ttg.nvidia_mma<{...}>`` attributes of a TTGIR module."""
    found = {}
    for m in re.finditer(r"^#(\w+) = #ttg\.nvidia_mma<\{([^}]*)\}>", ttgir, re.MULTILINE):
        fields = dict(re.findall(r"(\w+) = (\[[^\]]*\]|\d+)", m[2]))
        ints = lambda key: tuple(int(x) for x in re.findall(r"\d+", fields[key]))  # noqa: E731
        found[m[1]] = MmaEncoding(int(fields["versionMajor"]), ints("warpsPerCTA"), ints("instrShape"))
    return found


def ttgir_dots(ttgir: str) -> list[TtgirDot]:
    """Every matrix product of a TTGIR module, in program order."""
    encodings = parse_mma_encodings(ttgir)
    dots = []
    for m in re.finditer(r"= (tt\.dot|ttng\.warp_group_dot) .*?-> tensor<(\d+)x(\d+)xf32, #(\w+)>", ttgir):
        if m[4] in encodings:
            dots.append(TtgirDot(m[1], (int(m[2]), int(m[3])), m[4], encodings[m[4]]))
    return dots


# -------------------------------------------------------------------------------------------------- occupancy
def programs_per_sm(registers: int | None, threads: int, shared: int) -> tuple[int, str]:
    """``(resident programs per SM, what bounds it: "registers", "shared memory", ..., ties joined by "and")`` for a
    launch of ``threads`` threads using ``registers`` a thread (None: unknown, left out) and ``shared`` bytes of
    shared memory, by sm_90's allocation rules: registers
    in units of 256 a warp, 64 warps, 32 blocks and 228 KB of shared memory an SM (1 KB of it reserved a block).
    A bound from the compiled figures, not a measurement."""
    warps = -(-threads // 32)
    bounds = {"warps": MAX_WARPS_PER_SM // warps, "blocks": MAX_BLOCKS_PER_SM,
              "shared memory": SHARED_PER_SM // (shared + SHARED_RESERVED_PER_BLOCK)}
    if registers is not None:
        per_warp = -(-registers * 32 // REGISTER_ALLOC_UNIT) * REGISTER_ALLOC_UNIT
        bounds["registers"] = (REGISTERS_PER_SM // per_warp) // warps
    least = min(bounds.values())
    return least, " and ".join(k for k, v in bounds.items() if v == least)
