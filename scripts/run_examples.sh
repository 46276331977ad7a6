#!/usr/bin/env bash
# Sets up (apt + CMake build), then runs the smoke test and the 1000-step validation.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh -DKVEVICT_BUILD_TESTS=OFF -DKVEVICT_BUILD_EXAMPLES=ON
./build/examples/smoke_test
