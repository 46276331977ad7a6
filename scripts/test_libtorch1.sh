#!/usr/bin/env bash
# Builds kvevict and runs its C++ ctest suite against Debian 12's LibTorch 1.13 (libtorch-dev,
# GCC 12, C++17), the oldest LibTorch kvevict supports, into build-libtorch1/: only what ctest
# runs (no benchmarks, no examples ctest does not run), no Python (the pytest suite runs against
# PyPI's torch in scripts/test.sh). Installs the Debian packages it needs (apt; as root or with
# sudo). Exits non-zero when anything fails.
# Usage: scripts/test_libtorch1.sh
set -euo pipefail
cd "$(dirname "$0")/.."
# OpenBLAS matters: Debian's LibTorch uses whatever libblas.so.3 is installed, and falls back to
# the reference BLAS without it (fp32 matmul ~8 GFLOP/s instead of ~250 on 2 cores).
scripts/apt_install.sh cmake g++ make libtorch-dev libopenblas0-pthread catch2 libfmt-dev libgloo-dev
echo "== $(dpkg-query -W -f='libtorch-dev ${Version}, ' libtorch-dev)$(g++ --version | head -n 1)"

build=build-libtorch1
# Debian's LibTorch from the system paths, whatever CMAKE_PREFIX_PATH the shell has.
mkdir -p $build
env -u CMAKE_PREFIX_PATH cmake -S . -B $build -DCMAKE_BUILD_TYPE=Release -DKVEVICT_BUILD_TESTS=ON \
  -DKVEVICT_BUILD_EXAMPLES=ON -DKVEVICT_BUILD_BENCH=OFF -DKVEVICT_PYTHON_TESTS=OFF \
  -DTorch_DIR=/usr/lib/x86_64-linux-gnu/cmake/Torch > $build/configure.log 2>&1 || { cat $build/configure.log >&2; exit 1; }
grep -E "kvevict:|Catch2" $build/configure.log || true
# The executables ctest runs (the tensor-parallel tests exist only where Gloo's headers were found).
cmake --build $build -j "$(nproc)" --target kvevict_test_programs  # what the ctests run
ctest --test-dir $build --output-on-failure -j "$(nproc)"
