"""`pallas-attn inspect` (pallas_attn.inspection): the fragment layouts against the PTX ISA, their ownership
property, the parsers of compiled output on committed excerpts, the compile where the triton wheel is installed,
and the command line in-process.

The expected tables below are written from the PTX ISA (docs.nvidia.com/cuda/parallel-thread-execution):
"Matrix Fragments for mma.m16n8k16 with floating point type", accumulators C/D with .f32 (#mma-16816-c):
    groupID = %laneid >> 2, threadID_in_group = %laneid % 4
    row = groupID for c0, c1; groupID + 8 for c2, c3;  col = threadID_in_group * 2 + (i & 0x1)
"Matrix Fragments for wgmma.mma_async.m64nNk16", Figure "WGMMA .m64nNk16 register fragment layout for accumulator
matrix D" (#wgmma-64n16-d): the 64 rows are four 16-row slices, one per warp of the warpgroup (warp w: rows
16w..16w+15); in each, d0..d3 repeat c0..c3 of the m16n8 figure on columns 0..7, d4..d7 on columns 8..15, and so
on: d[4j + i] sits in column block j. Mosaic GPU's WGMMA_LAYOUT comment cites the same figure.
"""

from __future__ import annotations

import itertools
import pathlib

import numpy as np
import pytest

from benchmarks.lab import fragment_probe
from pallas_attn import __main__ as cli
from pallas_attn.inspection import compiled, fragments, inspect_kernel, plot, render, targets
from pallas_attn.inspection.fragments import MmaEncoding

FIXTURES = pathlib.Path(__file__).resolve().parent / "fixtures" / "inspect"
HAS_TRITON = compiled.triton_version() is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="the offline compile needs triton (pip install triton==3.6.0)")

# (lane, register i) -> (row, col) of mma.m16n8k16's f32 accumulator c{i}
MMA_M16N8K16_TABLE = {
    (0, 0): (0, 0), (0, 1): (0, 1), (0, 2): (8, 0), (0, 3): (8, 1),
    (1, 0): (0, 2), (1, 1): (0, 3), (1, 2): (8, 2), (1, 3): (8, 3),
    (5, 0): (1, 2), (5, 1): (1, 3), (5, 2): (9, 2), (5, 3): (9, 3),  # groupID 1, threadID_in_group 1
    (14, 0): (3, 4), (14, 1): (3, 5), (14, 2): (11, 4), (14, 3): (11, 5),  # groupID 3, threadID_in_group 2
    (31, 0): (7, 6), (31, 1): (7, 7), (31, 2): (15, 6), (31, 3): (15, 7),
}
# N -> {(thread of the warpgroup, register i of d{i}) -> (row, col)} of wgmma.m64nNk16's f32 accumulator
WGMMA_TABLES = {
    8: {(0, 0): (0, 0), (0, 1): (0, 1), (0, 2): (8, 0), (0, 3): (8, 1),
        (37, 0): (17, 2), (37, 1): (17, 3), (37, 2): (25, 2), (37, 3): (25, 3),  # warp 1, lane 5
        (127, 0): (55, 6), (127, 3): (63, 7)},  # warp 3, lane 31
    64: {(0, 4): (0, 8), (0, 5): (0, 9), (0, 6): (8, 8), (0, 7): (8, 9),  # column block 1
         (37, 31): (25, 59), (127, 31): (63, 63), (64, 28): (32, 56)},
    128: {(64, 0): (32, 0), (64, 63): (40, 121), (37, 33): (17, 67), (100, 62): (57, 120)},  # 100: warp 3, lane 4
    256: {(96, 127): (56, 249), (5, 126): (9, 250), (31, 64): (7, 134), (0, 127): (8, 249)},
}


# ------------------------------------------------------------------------------------ documented layouts
def test_mma_m16n8k16_matches_the_ptx_isa():
    layout = fragments.mma_m16n8k16_map()
    for (lane, i), expected in MMA_M16N8K16_TABLE.items():
        assert fragments.mma_m16n8k16_element(lane, i) == expected
        assert tuple(layout.table[lane, i]) == expected


@pytest.mark.parametrize("n", sorted(WGMMA_TABLES))
def test_wgmma_m64nNk16_matches_the_ptx_isa(n):
    layout = fragments.wgmma_m64nNk16_map(n)
    assert layout.table.shape == (128, n // 2, 2)
    for (thread, i), expected in WGMMA_TABLES[n].items():
        assert fragments.wgmma_m64nNk16_element(thread, i, n) == expected
        assert tuple(layout.table[thread, i]) == expected
        assert layout.fragment_name(i) == (f"d{i}", 0)


@pytest.mark.parametrize("bad", [dict(lane=32, i=0), dict(lane=0, i=4)])
def test_mma_element_rejects_out_of_range(bad):
    with pytest.raises(ValueError, match="lane="):
        fragments.mma_m16n8k16_element(**bad)


@pytest.mark.parametrize("n, thread, i", [(12, 0, 0), (264, 0, 0), (64, 128, 0), (64, 0, 32)])
def test_wgmma_element_rejects_out_of_range(n, thread, i):
    with pytest.raises(ValueError, match="n=|thread="):
        fragments.wgmma_m64nNk16_element(thread, i, n)


@pytest.mark.parametrize("n", [8, 16, 64, 128, 256])
def test_the_formulas_are_linear(n):
    """The tile layouts are built from the formulas' values at the unit vectors: that is exact only if every
    (lane, register) is the XOR of them, which holds for every lane and register."""
    wgmma_regs, lanes = fragments._instruction_bases(n // 2)
    mma_regs, _ = fragments._instruction_bases(4)
    table = fragments._table_from_bases(wgmma_regs, lanes, [(16, 0), (32, 0)])
    assert np.array_equal(table, fragments.wgmma_m64nNk16_map(n).table)
    assert np.array_equal(fragments._table_from_bases(mma_regs, lanes, []), fragments.mma_m16n8k16_map().table)


def test_mosaic_declared_layout_is_the_ptx_wgmma_layout():
    """Mosaic GPU's WGMMA layout object, evaluated, gives the PTX ISA's accumulator layout register for register."""
    for n in (8, 64, 128, 256):
        mosaic = fragments.mosaic_wgmma_map(n, "S")
        assert np.array_equal(mosaic.table, fragments.wgmma_m64nNk16_map(n).table), n


# ------------------------------------------------------------------------------------ ownership property
def _encodings():
    for warps in [(1, 4), (4, 1), (2, 2), (1, 8), (8, 1), (2, 4), (4, 2), (1, 1), (1, 2)]:
        yield MmaEncoding(2, warps, (16, 8))
    for warps, n in itertools.product([(4, 1), (8, 1), (4, 2), (16, 1)], [16, 32, 64, 128, 256]):
        yield MmaEncoding(3, warps, (16, n, 16))


def test_every_element_has_exactly_one_holder_per_copy():
    """For every encoding and tile shape: each (thread, register) holds one element of the tile, and every element
    is held equally often: once when the warps fit in the tile, else once per copy the extra warps make."""
    checked = 0
    for enc, rows, cols in itertools.product(_encodings(), [16, 32, 64, 128, 256], [16, 32, 64, 128, 256]):
        if enc.version == 3 and (rows < 64 or cols < enc.instr_cols):
            continue  # wgmma needs a warpgroup's 64 rows and its own N
        m = fragments.triton_mma_map(enc, (rows, cols))
        holders = m.holders()
        copies = max(1, 16 * enc.warps_per_cta[0] // rows) * max(1, enc.instr_cols * enc.warps_per_cta[1] // cols)
        assert m.num_threads * m.num_registers == rows * cols * copies, (enc, rows, cols)
        assert (holders == copies).all(), (enc, rows, cols)  # with the count above: a cover, each element once
        checked += 1
    assert checked > 200
    for m in [fragments.mma_m16n8k16_map()] + [fragments.wgmma_m64nNk16_map(n) for n in (8, 24, 136, 256)]:
        assert (m.holders() == 1).all()


def test_elements_of_a_thread_and_its_mirrors():
    m = fragments.mosaic_wgmma_map(64, "S", warpgroups=(0, 1, 2))
    own, mirror = m.elements_of(37), m.elements_of(128 + 37)
    assert [(e.row, e.col, e.fragment) for e in own] == [(e.row, e.col, e.fragment) for e in mirror]
    assert own[0] == fragments.Element(17, 2, 0, "d0", 0)
    assert m.elements_of(3 * 128) == []  # the memory warpgroup holds no accumulator
    o = fragments.mosaic_wgmma_map(64, "O[:, 192:256]", col_offset=192)
    assert o.elements_of(0)[0].col == 192


@needs_triton
@pytest.mark.parametrize("enc, shape", [(MmaEncoding(3, (8, 1), (16, 128, 16)), (128, 128)),
                                        (MmaEncoding(3, (4, 2), (16, 64, 16)), (128, 256)),
                                        (MmaEncoding(2, (1, 4), (16, 8)), (16, 128)),
                                        (MmaEncoding(2, (2, 2), (16, 8)), (64, 64)),
                                        (MmaEncoding(2, (4, 2), (16, 8)), (32, 32))])
def test_triton_layout_matches_tritons_own(enc, shape):
    """triton_mma_map agrees with Triton's linear layout of the same #ttg.nvidia_mma, register order included."""
    from triton._C.libtriton import gluon_ir, ir
    from triton.experimental.gluon import language as ttgl

    ctx = ir.context()
    ir.load_dialects(ctx)
    builder = gluon_ir.GluonOpBuilder(ctx)
    layout = ttgl.NVMMADistributedLayout(version=[enc.version, 0], warps_per_cta=list(enc.warps_per_cta),
                                         instr_shape=list(enc.instr_shape))
    theirs = builder.to_linear_layout(layout._to_ir(builder), list(shape))
    expected = fragments._table_from_bases(theirs.reg_bases, theirs.lane_bases, theirs.warp_bases)
    assert np.array_equal(fragments.triton_mma_map(enc, shape).table, expected)


# ---------------------------------------------------------------------------------- parsers on fixtures
def test_parse_ptxas_log():
    report = compiled.parse_ptxas_log((FIXTURES / "prefill_ptxas_v.log").read_text())
    assert report == compiled.PtxasReport(registers=255, spill_stores=92, spill_loads=92, stack_frame=88,
                                          barriers=1, warnings=())
    with pytest.raises(ValueError, match="not a ptxas -v log"):
        compiled.parse_ptxas_log("ptxas fatal: unresolved extern")
    warned = compiled.parse_ptxas_log("ptxas info    : Used 90 registers, used 2 barriers\n"
                                      "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
                                      "ptxas warning : (C7513) Potential Performance Loss: wgmma.mma_async "
                                      "instructions are serialized\n")
    assert (warned.registers, warned.barriers, len(warned.warnings)) == (90, 2, 1)


def test_sass_mix_and_kv_loops():
    sass = (FIXTURES / "prefill_excerpt.sass").read_text()
    instructions = compiled.sass_instructions(sass)
    assert instructions[0] == (0x2350, "DEPBAR.LE SB0, 0x2")
    assert compiled.opcode("@P0 BRA 0x2350") == "BRA"
    mix = compiled.instruction_mix(i for _, i in instructions)
    assert mix["wgmma (HGMMA)"] == 1 and mix["exp2 (MUFU.EX2)"] == 1 and mix["shuffles (SHFL)"] == 1
    assert mix["barriers (BAR, SYNCS)"] == 1 and mix["wgmma waits (WARPGROUP.DEPBAR)"] == 1
    assert mix["spill stores (STL)"] == 1 and mix["spill loads (LDL)"] == 2 and mix["mma.sync (HMMA)"] == 0
    [loop] = compiled.mma_loops(sass)
    assert (loop.start, loop.end, loop.instructions) == (0x2350, 0x4750, 9)
    assert loop.spills == ("STL @0x23b0", "LDL @0x3ce0")  # the LDL after the loop is not in it
    assert loop.describe() == ("loop 0x2350-0x4750: 9 instructions, 1 HGMMA, 1 MUFU.EX2, spills: STL @0x23b0, "
                               "LDL @0x3ce0")


def test_a_barrier_retry_is_not_a_loop():
    sass = """
        /*0100*/                   HMMA.16816.F32.BF16 R4, R8, R12, RZ ;
        /*0110*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R3 ;
        /*0120*/              @!P0 BRA 0x100 ;
    """
    assert compiled.mma_loops(sass) == []


def test_ttgir_and_ptx_parsers():
    ttgir = (FIXTURES / "excerpt.ttgir").read_text()
    encodings = compiled.parse_mma_encodings(ttgir)
    assert encodings == {"mma": MmaEncoding(3, (8, 1), (16, 128, 16)), "mma1": MmaEncoding(2, (1, 4), (16, 8))}
    dots = compiled.ttgir_dots(ttgir)
    assert [(d.op, d.shape, d.alias) for d in dots] == [("ttng.warp_group_dot", (128, 128), "mma")] * 2 + [
        ("tt.dot", (16, 128), "mma1")]
    ptx = (FIXTURES / "excerpt.ptx").read_text()
    assert compiled.ptx_mma_instructions(ptx) == {"wgmma.m64n128k16": 2, "mma.sync.m16n8k16": 3}
    assert compiled.ptx_threads(ptx) == 256  # the first kernel's .reqntid


def test_s_and_o_from_the_dots():
    s = compiled.TtgirDot("ttng.warp_group_dot", (128, 64), "mma", MmaEncoding(3, (8, 1), (16, 64, 16)))
    o = compiled.TtgirDot("ttng.warp_group_dot", (128, 128), "mma1", MmaEncoding(3, (8, 1), (16, 128, 16)))
    from pallas_attn.inspection.report import _triton_maps
    maps = _triton_maps([s, o, s, o], value_cols=128)
    assert [(m.name, m.shape, m.instruction) for m in maps] == [("S", (128, 64), "wgmma.m64n64k16"),
                                                                ("O", (128, 128), "wgmma.m64n128k16")]
    same = _triton_maps([o, o], value_cols=128)  # Q Kᵀ and P V of one shape: the first is S
    assert [m.name for m in same] == ["S", "O"]


@pytest.mark.parametrize("declared, release, expected", [
    ("8.8", "12.8", "8.7"), ("9.0", "12.9", "8.8"), ("8.8", "13.0", "8.8"), ("8.7", "12.8", "8.7"),
    ("9.0", None, "9.0"), ("9.0", "99.9", "9.0")])
def test_ptx_version_fits_the_ptxas(declared, release, expected):
    ptx = f"//\n// Generated\n.version {declared}\n.target sm_90a\n.address_size 64\n"
    fitted, note = compiled.fit_ptx_version(ptx, release)
    assert fitted == ptx.replace(f".version {declared}", f".version {expected}")
    assert (note is None) == (declared == expected)
    if note:
        assert release in note and declared in note


@pytest.mark.parametrize("registers, threads, shared, expected", [
    (255, 256, 229_376, (1, "shared memory and registers")),  # the Triton prefill at P1 (fixture figures)
    (128, 128, 0, (4, "registers")),  # 4096 registers a warp: 16 warps, 4 programs of 4
    (None, 512, 90_112, (2, "shared memory")),  # registers unknown (a Mosaic GPU kernel on a CPU)
    (32, 32, 0, (32, "blocks")),  # one warp a program: the 32-block limit
])
def test_programs_per_sm(registers, threads, shared, expected):
    assert compiled.programs_per_sm(registers, threads, shared) == expected


# -------------------------------------------------------------------------------------- compile and CLI
@needs_triton
@pytest.mark.parametrize("kernel, instruction", [("decode", "mma.sync.m16n8k16"), ("prefill", "wgmma.m64n")])
def test_compiled_facts_on_a_small_shape(kernel, instruction):
    """Triton on sm_90 picks wgmma for the prefill's 128-row tiles and mma.sync for decode's 16-row ones; the PTX
    holds the instruction the TTGIR's layout says, and the facts come from the compile."""
    report = inspect_kernel(kernel, tiny=True, backend="triton" if kernel == "prefill" else None, thread=37)
    facts = report.launches[report.attention_launch]
    assert facts.source.startswith("compiled here: triton")
    assert 0 < facts.registers <= compiled.MAX_REGISTERS_PER_THREAD and facts.shared > 0
    assert facts.programs_per_sm[0] >= 1 and facts.mix is not None
    for m in report.maps:
        assert m.instruction.startswith(instruction)
        assert m.instruction in facts.mma, (m.instruction, facts.mma)
        assert (m.holders() >= 1).all()
    assert [m.name for m in report.maps] == ["S", "O"]
    assert report.elements_of(37)["S"]


@pytest.fixture(scope="module")
def mosaic_report():
    """The Mosaic GPU prefill on tiny P1: lowered here, declared facts (no compiler needed; no PTX dump on a GPU)."""
    return inspect_kernel("prefill", "P1", backend="mosaic", tiny=True, thread=300, ptx=())


def test_mosaic_report_is_declared_and_mapped(mosaic_report, tmp_path):
    facts = mosaic_report.launches[mosaic_report.attention_launch]
    assert facts.source.startswith("declared") and facts.registers is None and facts.threads == 512
    assert "setmaxnreg" in " ".join(facts.declared) and facts.notes
    s, o = mosaic_report.maps
    assert (s.shape, o.shape) == ((64, 128), (64, 64))  # block_kv 128; head dim 32 runs padded to 64
    assert s.thread_offsets == (0, 128, 256)
    held = mosaic_report.elements_of(300)["S"]  # warpgroup 2, the registers thread 44 has
    assert (held[0].row, held[0].col) == fragments.wgmma_m64nNk16_element(44, 0, 128)
    text = render(mosaic_report)
    assert "thread 300: warp 9 (warpgroup 2, warp 1 in it), lane 12" in text
    assert "the registers thread 44 has" in text
    plot(mosaic_report, str(tmp_path / "tiles.png"))
    assert (tmp_path / "tiles.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_prints_the_sections(capsys, tmp_path):
    png = tmp_path / "p.png"
    assert cli.main(["inspect", "prefill", "--workload", "P1", "--tiny", "--backend", "mosaic", "--thread", "400",
                     "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    for section in ("pallas-attn inspect: prefill (varlen_attention), backend mosaic", "== launches: compiled facts",
                    "== fragment maps", "owning warp of each 8x8 block", "inside each 8x8 block",
                    "== thread 400: warp 12 (warpgroup 3", "S: thread 400 holds none of it", f"wrote {png}"):
        assert section in out, section
    assert png.is_file()


@pytest.mark.parametrize("argv, named", [
    (["inspect", "attention"], "kernel 'attention'"),
    (["inspect", "prefill", "--workload", "Z9", "--tiny"], "--workload 'Z9'"),
    (["inspect", "prefill", "--workload", "D1", "--tiny"], "--workload D1 is a decode workload"),
    (["inspect", "decode", "--backend", "mosaic", "--tiny"], "--backend 'mosaic'"),
    (["inspect", "prefill", "--tiny", "--backend", "mosaic", "--thread", "512"], "--thread 512"),
    (["inspect", "prefill", "--tiny", "--backend", "mosaic", "--thread", "-1"], "--thread -1"),
])
def test_cli_bad_arguments_name_the_argument(argv, named, capsys):
    assert cli.main(argv) == 2
    assert named in capsys.readouterr().err


def test_cli_rejects_an_unknown_backend(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["inspect", "prefill", "--backend", "cuda"])
    assert exit_info.value.code == 2
    assert "--backend" in capsys.readouterr().err


# ------------------------------------------------------------------------- the probe: observed on the device
PROBE_CASES = (*fragment_probe.TRITON_CASES, *fragment_probe.MOSAIC_CASES)


@pytest.mark.gpu
@pytest.mark.parametrize("case", PROBE_CASES, ids=[c.name for c in PROBE_CASES])
def test_probe_observes_the_inspected_map(case):
    """Every thread of a Pallas Triton and a Mosaic GPU kernel writes its own id into the accumulator elements it
    holds; what they wrote is the fragment map ``inspect`` derives (benchmarks/lab/fragment_probe.py)."""
    row = fragment_probe.observe(case)
    assert row["verdict"] == "PASS", row["mismatches"]


def test_probes_lower_for_sm90(capsys):
    """On a CPU: both kinds of probe lower for sm_90 (and the Triton ones compile where the triton wheel is)."""
    assert fragment_probe.check_offline() == 0
    assert capsys.readouterr().out.count("mosaic-wgmma") == len(fragment_probe.MOSAIC_CASES)


@pytest.mark.parametrize("workload, scale_shape", [("D1-fp8", "tensor"), ("D1-fp8-token", "token")])
@pytest.mark.parametrize("kernel", ["decode", "paged"])
def test_fp8_workloads_build_an_fp8_call(kernel, workload, scale_shape):
    """An FP8 workload inspects the kernel over an FP8 cache with its scales, not the bf16 one."""
    import jax
    import jax.numpy as jnp

    call = targets.build_call(kernel, workload, tiny=True)
    cache, scales = call.args[1], call.args[-1]
    assert cache.dtype == jnp.float8_e4m3fn and call.args[2].dtype == jnp.float8_e4m3fn
    expected = () if scale_shape == "tensor" else cache.shape[:3]
    assert scales["k_scale"].shape == scales["v_scale"].shape == expected
    out = jax.eval_shape(call.fn, *call.args)  # the public function accepts them (its checks run at trace time)
    assert out.shape == call.args[0].shape
