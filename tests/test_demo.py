"""The demo and the command line: the README's main command must stay green, and must fail when a kernel is wrong.

The full demo runs once (`test_demo_passes`, about 20 s interpreted on CPU); the other tests swap its cases or
the benchmark module for fakes, so they cost no kernel call.
"""

from __future__ import annotations

import re
import types

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_attn import __main__ as cli, demo
from pallas_attn.core.config import default_decode_config


def test_demo_passes(capsys):
    assert demo.main([]) == 0  # float32 on CPU, bfloat16 on GPU
    out = capsys.readouterr().out
    for kernel in ("varlen_attention", "paged_decode_attention", "paged_attention", "merge_attention_states"):
        assert kernel in out
    assert "FAIL" not in out and "ERROR" not in out


def _case(run, ref):
    return demo.Case("fake_kernel", "fake case", "x[4,2,8]", run=run, ref=ref)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_split_size_fits_every_dtype(dtype):
    """The demo runs in float32 here and in bfloat16 on a GPU: its fixed split size must be a multiple of the decode
    tile of each (a split size that is not one is refused, and that case would report an error)."""
    cfg = default_decode_config(demo.HEAD_DIM, demo.BLOCK_SIZE, jnp.dtype(dtype).itemsize)
    assert demo.SPLIT_SIZE % cfg.block_n == 0


def test_run_case_flags_wrong_nan_and_raising_kernels():
    ref = jnp.ones((4, 2, 8), jnp.float32)
    ok = demo.run_case(_case(lambda: ref + 1e-7, lambda: ref), jnp.float32, "interpret", repeats=1)
    wrong = demo.run_case(_case(lambda: ref * 1.01, lambda: ref), jnp.float32, "interpret", repeats=1)
    nan = demo.run_case(_case(lambda: ref.at[0, 0, 0].set(jnp.nan), lambda: ref), jnp.float32, "interpret",
                        repeats=1)

    def broken():
        raise ValueError("no kernel today")

    raised = demo.run_case(_case(broken, lambda: ref), jnp.float32, "interpret", repeats=1)
    assert [r.status for r in (ok, wrong, nan, raised)] == ["PASS", "FAIL", "FAIL", "ERROR"]
    assert ok.tol == 1e-5 and ok.ms is not None
    assert "no kernel today" in raised.error


def test_demo_returns_1_when_a_check_fails(monkeypatch, capsys):
    ref = jnp.ones((4, 2, 8), jnp.float32)
    monkeypatch.setattr(demo, "collect_cases",
                        lambda *args: ([_case(lambda: ref, lambda: ref), _case(lambda: 2 * ref, lambda: ref)], []))
    assert demo.main(["--plain"]) == 1
    out = capsys.readouterr().out
    assert "PASS" in out and "FAIL" in out and "1/2 checks passed" in out


def test_plain_table_lines_up():
    rows = [demo.Result("k", "a case", "q[1]", "float32", "interpret", ms=1.0, err=1e-7, tol=1e-5),
            demo.Result("kernel_two", "b", "q[2,2]", "float32", "interpret", err=np.nan, tol=1e-5)]
    lines = demo.format_plain(rows, "ms (interpret)").splitlines()
    assert len(lines) == 4 and "ms (interpret)" in lines[0]
    assert lines[2].split()[-1] == "PASS" and lines[3].split()[-1] == "FAIL"
    assert lines[0].index("result") == lines[2].index("PASS") == lines[3].index("FAIL")


def test_cli_dispatches_demo(monkeypatch):
    seen = []
    monkeypatch.setattr(demo, "main", lambda argv: seen.append(argv) or 0)
    assert cli.main(["demo", "--seed", "3", "--dtype", "float32"]) == 0
    assert seen == [["--seed", "3", "--dtype", "float32"]]


def test_cli_dispatches_bench(monkeypatch):
    seen = []
    fake = types.SimpleNamespace(main=lambda argv: seen.append(argv) or 0)
    monkeypatch.setattr(cli, "_load_benchmarks", lambda: fake)
    assert cli.main(["bench", "--only", "D1"]) == 0
    assert seen == [["--only", "D1"]]


def test_cli_bench_outside_a_checkout(monkeypatch, capsys):
    monkeypatch.setattr(cli, "_load_benchmarks", lambda: None)
    assert cli.main(["bench"]) == 2
    assert "source checkout" in capsys.readouterr().err


def test_cli_rejects_unknown_commands(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve"])
    assert exit_info.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_cli_version(capsys):
    import pallas_attn

    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"pallas-attn {pallas_attn.__version__}"


@pytest.mark.parametrize("argv, prog", [(["--bogus"], "pallas-attn"), (["--bogus", "demo"], "pallas-attn"),
                                        (["demo", "--bogus"], "pallas-attn demo")])
def test_cli_rejects_unknown_flags(argv, prog, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    assert f"{prog}: error: unrecognized arguments: --bogus" in capsys.readouterr().err


def test_cli_without_a_command_prints_help(capsys):
    assert cli.main([]) == 2
    err = capsys.readouterr().err
    assert "usage: pallas-attn" in err and "demo" in err and "bench" in err


@pytest.mark.parametrize("repeats", ["0", "-3", "two"])
def test_demo_rejects_repeats_below_one(repeats, capsys, monkeypatch):
    monkeypatch.setattr(demo, "build_batch", lambda *a: pytest.fail("the demo ran past its argument check"))
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["demo", "--repeats", repeats])
    assert exit_info.value.code == 2
    assert "argument --repeats: must be an integer >= 1" in capsys.readouterr().err


def test_cli_help_points_at_the_documents(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    assert exit_info.value.code == 0
    cited = re.findall(r"[\w./-]+\.md", capsys.readouterr().out)
    assert sorted(set(cited)) == ["benchmarks/README.md", "docs/performance.md", "docs/threads.md"]
