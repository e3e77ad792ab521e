"""``--baseline GIT_REV``: the same workloads timed on the ``pallas_attn`` of another revision, rows
``pallas_attn@REV``.

The revision is checked out in a temporary ``git worktree``; a subprocess runs this harness (``benchmarks`` of the
current checkout, so workloads, checks and timing are identical) with ``PYTHONPATH`` pointing first at a folder that
holds only the revision's ``pallas_attn`` (and the ``reference`` package it loads), and times that revision's
``pallas_attn`` row alone (no ceilings, no anchors). The parent adds the rows to its own results, their ratios taken
against its ceilings and anchors. The revision's package must offer the public functions and ``pallas_attn.core``
the harness imports (any revision since the ``ops/``, ``core/`` layout).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("pallas_attn", "reference")  # what the revision contributes; reference/ is loaded by pallas_attn


def _git(*args: str, cwd: pathlib.Path = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()


def resolve(rev: str) -> str:
    """The short commit id of ``rev``; raises ``ValueError`` when git does not know it."""
    try:
        return _git("rev-parse", "--short", f"{rev}^{{commit}}")
    except (subprocess.CalledProcessError, FileNotFoundError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        raise ValueError(f"--baseline {rev!r}: not a revision of {ROOT} ({detail.strip()})") from e


def run(rev: str, harness_args: list[str], budget_s: float | None) -> tuple[list[dict], str]:
    """Runs the harness on revision ``rev`` and returns (its rows named ``pallas_attn@rev``, the commit id).

    ``harness_args``: the workload selection and run options to pass on (``--only``, ``--family``, ``--tiny``,
    ``--target-s``, ``--no-check``); ``budget_s``: the seconds left for it, or None."""
    commit = resolve(rev)
    name = f"pallas_attn@{rev}"
    with tempfile.TemporaryDirectory(prefix="pallas_attn-baseline-") as tmp:
        tmp = pathlib.Path(tmp)
        src, pkgs, out = tmp / "src", tmp / "pkgs", tmp / "out"
        _git("worktree", "add", "--detach", "--quiet", str(src), commit)
        try:
            pkgs.mkdir()
            for pkg in PACKAGES:
                if (src / pkg).exists():
                    (pkgs / pkg).symlink_to(src / pkg, target_is_directory=True)
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(
                [str(pkgs), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
            cmd = [sys.executable, "-m", "benchmarks.run", *harness_args, "--as-baseline", name, "--out", str(out),
                   "--no-plots", "--no-merge"]
            if budget_s is not None:
                cmd += ["--budget", f"{max(budget_s, 0.0):.0f}"]
            print(f"baseline {name} ({commit}): {' '.join(cmd[1:])}", flush=True)
            # cwd=tmp: `python -m` puts the working directory first on sys.path, and it must not hold a pallas_attn
            subprocess.run(cmd, cwd=tmp, env=env, check=False)
            rows = []
            for path in sorted(out.glob("*.json")):
                rows += json.loads(path.read_text())
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(src)], cwd=ROOT, capture_output=True)
    for r in rows:
        r["note"] = "; ".join(x for x in (f"commit {commit}", r.get("note")) if x)
    return rows, commit
