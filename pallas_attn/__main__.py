"""Command line: ``pallas-attn demo [...]``, ``pallas-attn bench [...]`` and ``pallas-attn --version`` (also
``python -m pallas_attn``).

* ``demo``: one mixed batch through every kernel, each checked against the reference, a table
  (:mod:`pallas_attn.demo`; interpreted on CPU, compiled on GPU).
* ``bench``: the benchmark harness, ``benchmarks.run.main(argv)``. ``benchmarks/`` is a top-level folder of the
  source checkout, not part of the installed package: run it from a checkout (editable installs work too). How to
  read its numbers: ``benchmarks/README.md``; the results and what each design choice bought:
  ``docs/performance.md``.
"""

from __future__ import annotations

import argparse
import importlib
import pathlib
import sys
from collections.abc import Sequence

COMMANDS = {
    "demo": "mixed batch through every kernel, checked against the reference, printed as a table",
    "bench": "benchmark harness of a source checkout (benchmarks/README.md; results: docs/performance.md)",
}


def _load_benchmarks():
    """`benchmarks.run` from the current directory or from the checkout this package lives in, else None."""
    checkout = pathlib.Path(__file__).resolve().parent.parent
    for extra in (None, checkout):
        if extra is not None and (extra / "benchmarks").is_dir() and str(extra) not in sys.path:
            sys.path.insert(0, str(extra))
        try:
            return importlib.import_module("benchmarks.run")
        except ModuleNotFoundError as exc:
            if exc.name not in ("benchmarks", "benchmarks.run"):
                raise  # benchmarks.run exists but needs something missing (e.g. the `bench` extra): say so
    return None


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
        description="Pallas GPU attention kernels for JAX: demo and benchmarks.",
        epilog="commands:\n" + "\n".join(f"  {name:<6} {text}" for name, text in COMMANDS.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    # optional here so that an unknown flag before any command gets argparse's "unrecognized arguments" error
    parser.add_argument("command", nargs="?", choices=sorted(COMMANDS), help="demo or bench")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="options of the command (COMMAND --help)")
    args = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    if args.command == "demo":
        from pallas_attn import demo

        return demo.main(args.args)
    return bench(args.args)


if __name__ == "__main__":
    sys.exit(main())
