"""Command line: ``pallas-attn demo [...]``, ``pallas-attn bench [...]``, ``pallas-attn inspect KERNEL [...]`` and
``pallas-attn --version`` (also ``python -m pallas_attn``).

* ``demo``: one mixed batch through every kernel, each checked against the reference, a table
  (:mod:`pallas_attn.demo`; interpreted on CPU, compiled on GPU).
* ``bench``: the benchmark harness, ``benchmarks.run.main(argv)``. ``benchmarks/`` is a top-level folder of the
  source checkout, not part of the installed package: run it from a checkout (editable installs work too). How to
  read its numbers: ``benchmarks/README.md``; the results and what each design choice bought:
  ``docs/performance.md``.
* ``inspect``: one kernel's compiled facts for sm_90 (registers, spills, shared memory, programs per SM, the
  instruction mix of its K/V loops) and which thread holds which element of its score and output tiles
  (:mod:`pallas_attn.inspection`, docs/threads.md). ``--workload`` reads the harness's workloads from a source
  checkout; the Triton compile needs the triton wheel (``pip install triton==3.6.0``), a GPU does not.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

COMMANDS = {
    "demo": "mixed batch through every kernel, checked against the reference, printed as a table",
    "bench": "benchmark harness of a source checkout (benchmarks/README.md; results: docs/performance.md)",
    "inspect": "a kernel's compiled facts for sm_90 and the threads that hold its tiles (docs/threads.md)",
}


def _load_benchmarks():
    """`benchmarks.run` from the current directory or from the checkout this package lives in, else None; one that
    exists but needs something missing (e.g. the `bench` extra) raises, saying what."""
    from pallas_attn.inspection.targets import checkout_module

    return checkout_module("benchmarks.run")


def bench(argv: Sequence[str]) -> int:
    module = _load_benchmarks()
    if module is None:
        print(
            "pallas-attn bench: cannot import benchmarks.run. The benchmark harness lives in the top-level "
            "benchmarks/ folder of the repository and is not installed with the package: run it from a source "
            "checkout (in the repository root: pip install -e '.[bench]', then pallas-attn bench).",
            file=sys.stderr,
        )
        return 2
    return int(module.main(list(argv)) or 0)


def main(argv: Sequence[str] | None = None) -> int:
    from pallas_attn import __version__

    parser = argparse.ArgumentParser(
        prog="pallas-attn",
        description="Pallas GPU attention kernels for JAX: demo, benchmarks and kernel inspection.",
        epilog="commands:\n" + "\n".join(f"  {name:<7} {text}" for name, text in COMMANDS.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    # optional here so that an unknown flag before any command gets argparse's "unrecognized arguments" error
    parser.add_argument("command", nargs="?", choices=sorted(COMMANDS), help="demo, bench or inspect")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="options of the command (COMMAND --help)")
    args = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    if args.command == "demo":
        from pallas_attn import demo

        return demo.main(args.args)
    if args.command == "inspect":
        from pallas_attn import inspection

        return inspection.main(args.args)
    return bench(args.args)


if __name__ == "__main__":
    sys.exit(main())
