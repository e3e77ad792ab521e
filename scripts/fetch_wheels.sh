#!/usr/bin/env bash
# Download the wheels the GPU machine lacks (it has no internet) into .whl/ (git-ignored; name it in the device
# call's `carry`). The GPU scripts install them when present. jax-triton 0.3.1 is the release that accepts the
# machine's triton 3.6 (0.4.x wants triton >= 3.7); it is pure Python and needs nothing else the machine lacks.
# tokamax (the tokamax_mosaic anchor of the backward workloads) comes with what its attention ops import, without
# the rest of its declared dependencies (orbax, tensorstore, optax: flax's, unused by these imports); 5.7 MB in all.
set -euo pipefail
cd "$(dirname "$0")/.."
download() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl "$@"
}
download "jax-triton==0.3.1"
download "tokamax==0.0.12" "qwix==0.1.8" "flax==0.12.12" "treescope==0.1.10" "msgpack==1.2.4" "PyYAML==6.0.4" \
  "einshape==1.0" "immutabledict==4.3.1" "jaxtyping==0.3.11" "wadler_lindig==0.1.8" "typeguard==2.13.3" \
  "pydantic==2.14.4" "pydantic_core==2.50.5" "annotated_types==0.8.0" "typing_inspection==0.4.5" \
  "tensorboardX==2.6.5"
ls .whl
