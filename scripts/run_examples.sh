#!/usr/bin/env bash
# Sets up (apt, the project venv with torch from PyPI, pip install of kvevict, CMake: see
# scripts/setup.sh), builds the examples, then runs the smoke test, the 1000-step validation
# (CSV in build/validate_eviction.csv), the memory table, continuous batching (16 requests
# through a batch of 4, each bit-identical to its solo run) and tensor parallelism (2 ranks,
# then 4 lazy, on loopback: every rank's kept-positions digest must be equal), then the Python
# example (the smoke test and a short generation from Python, with the venv's python and the
# kvevict installed there).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh smoke_test validate_eviction memory_table continuous_batching tensor_parallel
./build/examples/smoke_test
./build/examples/validate_eviction --out-csv build/validate_eviction.csv
./build/examples/memory_table
./build/examples/continuous_batching
./build/examples/tensor_parallel --world 2
./build/examples/tensor_parallel --world 4 --lazy
"${KVEVICT_VENV:-$HOME/.cache/kvevict/venv}/bin/python" examples/python/smoke_test.py
