#!/usr/bin/env bash
# Set up a virtual environment (.venv, or $VENV) on a Python >= 3.12 and install pallas_attn with its test extra,
# JAX pinned to the GPU machine's 0.11.2 (constraints.txt). Used by the README's first command and by .ci/run.
# JAX_VERSION=X.Y.Z pins jax and jaxlib to X.Y.Z instead (the other pins stay), e.g.
#   VENV=.venv-jax012 JAX_VERSION=0.12.0.1 bash scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."

find_python() {
  local cand
  for cand in "${PYTHON:-}" python3.12 python3.13 python3.14 python3; do
    [ -n "$cand" ] && command -v "$cand" >/dev/null 2>&1 || continue
    if "$cand" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
      command -v "$cand"; return 0
    fi
  done
  # pyenv installs that are not on PATH (the CPU machines have 3.12 there)
  local root
  root=$( (command -v pyenv >/dev/null 2>&1 && pyenv root) || echo "$HOME/.pyenv")
  for cand in "$root"/versions/3.1[2-9]*/bin/python3; do
    [ -x "$cand" ] && { echo "$cand"; return 0; }
  done
  return 1
}

PY=$(find_python) || { echo "setup: no Python >= 3.12 found (set PYTHON=/path/to/python3.12)" >&2; exit 1; }
VENV=${VENV:-.venv}
echo "setup: $PY ($("$PY" --version)) -> $VENV"
"$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
CONSTRAINTS=constraints.txt
if [ -n "${JAX_VERSION:-}" ]; then
  CONSTRAINTS=$(mktemp)
  trap 'rm -f "$CONSTRAINTS"' EXIT
  grep -vE '^(jax|jaxlib)==' constraints.txt >"$CONSTRAINTS"
  printf 'jax==%s\njaxlib==%s\n' "$JAX_VERSION" "$JAX_VERSION" >>"$CONSTRAINTS"
fi
echo "setup: $(grep -E '^(jax|jaxlib)==' "$CONSTRAINTS" | tr '\n' ' ')"
"$VENV/bin/python" -m pip install -q -c "$CONSTRAINTS" -e ".[test,bench]"
