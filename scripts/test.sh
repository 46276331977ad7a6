#!/usr/bin/env bash
# Sets up (apt, the project venv with torch and transformers from PyPI, pip install of kvevict,
# CMake against the venv's torch: see scripts/setup.sh), builds the programs the ctests run
# (the target kvevict_test_programs: not the examples, benchmarks and quality tools, which
# `scripts/setup.sh` with no target builds, as CI does), then runs the whole ctest suite (C++
# and the pytest suite against the installed package).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh kvevict_test_programs
ctest --test-dir build --output-on-failure -j "$(nproc)"
