#!/usr/bin/env bash
# Installs what kvevict needs on Debian 12 (apt), configures build/ once (tests, examples and
# benchmark all on, Release; the Python module too, into build/python), then builds the given
# targets (all when none are given). KVEVICT_EXTRA_PKGS: more Debian packages to install
# (e.g. gnuplot-nox for scripts/eval_quality.sh's plots).
# Usage: [KVEVICT_EXTRA_PKGS="pkg ..."] scripts/setup.sh [target ...]
set -euo pipefail
cd "$(dirname "$0")/.."

pkgs=(cmake g++ make libtorch-dev libopenblas0-pthread catch2 libfmt-dev libbenchmark-dev
      libgloo-dev   # Gloo headers: c10d groups for tensor parallelism (LibTorch links libgloo)
      python3-torch python3-dev pybind11-dev python3-pybind11 python3-pytest  # the Python module
      ${KVEVICT_EXTRA_PKGS:-})
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "== installing: ${missing[*]}"
  sudo_cmd=""
  [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq "${missing[@]}"
fi

cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DKVEVICT_BUILD_TESTS=ON -DKVEVICT_BUILD_EXAMPLES=ON \
  -DKVEVICT_BUILD_BENCH=ON
targets=()
for t in "$@"; do targets+=(--target "$t"); done
cmake --build build -j "$(nproc)" "${targets[@]}"
