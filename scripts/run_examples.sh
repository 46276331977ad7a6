#!/usr/bin/env bash
# Sets up (apt + CMake), builds the examples, then runs the smoke test, the 1000-step
# validation (CSV in build/validate_eviction.csv) and the memory table.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh smoke_test validate_eviction memory_table
./build/examples/smoke_test
./build/examples/validate_eviction --out-csv build/validate_eviction.csv
./build/examples/memory_table
