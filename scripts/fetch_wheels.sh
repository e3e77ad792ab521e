#!/usr/bin/env bash
# Download the wheels the GPU machine lacks (it has no internet) into .whl/ (git-ignored; name it in the device
# call's `carry`). The GPU scripts install them when present. jax-triton 0.3.1 is the release that accepts the
# machine's triton 3.6 (0.4.x wants triton >= 3.7); it is pure Python and needs nothing else the machine lacks.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl "jax-triton==0.3.1"
ls .whl
