#!/usr/bin/env bash
# Sets up (apt + CMake build with tests), then runs the whole ctest suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh -DKVEVICT_BUILD_TESTS=ON -DKVEVICT_BUILD_EXAMPLES=ON
ctest --test-dir build --output-on-failure -j "$(nproc)"
