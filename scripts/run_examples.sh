#!/usr/bin/env bash
# Sets up (apt + CMake build), then runs the smoke test, the 1000-step validation and the memory table.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh -DKVEVICT_BUILD_TESTS=OFF -DKVEVICT_BUILD_EXAMPLES=ON
./build/examples/smoke_test
./build/examples/validate_eviction --out-csv build/validate_eviction.csv
./build/examples/memory_table
