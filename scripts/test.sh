#!/usr/bin/env bash
# Sets up (apt + CMake), builds everything, then runs the whole ctest suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
ctest --test-dir build --output-on-failure -j "$(nproc)"
