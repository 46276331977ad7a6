#!/usr/bin/env bash
# Measures what eviction does to the shipped quality model's answers (examples/quality/):
# retrieval by needle depth and context, held-out perplexity and attention-output error, for
# every policy at budgets 10, 25 and 50% of the context (and the full cache), under two
# protocols (one passkey question; four questions in turn), in both cache layouts; then the
# speed table.
#   scripts/eval_quality.sh [extra eval_quality flags]
# Output: build-quality/eval/quality.csv and *.png (gnuplot), build-quality/eval/speed.md.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
# Idle OpenMP workers sleep instead of spinning: on 2 shared cores a spinning worker steals
# the core OpenBLAS computes on (measured: ~half the trainer's CPU time went to spinning).
export OMP_WAIT_POLICY=PASSIVE
scripts/fetch_corpus.sh build-quality/data
(cd examples/quality && sha256sum -c weights.pt.sha256)
command -v gnuplot >/dev/null || echo "no gnuplot (apt-get install gnuplot-nox): CSV only" >&2
cmake -S . -B build-quality/build -DCMAKE_BUILD_TYPE=Release -DKVEVICT_BUILD_TESTS=OFF >/dev/null
cmake --build build-quality/build --target eval_quality speed_quality -j2
mkdir -p build-quality/eval
plots=(); command -v gnuplot >/dev/null || plots=(--no-plots)
build-quality/build/examples/quality/eval_quality --weights examples/quality/weights.pt --data build-quality/data \
  --out build-quality/eval "${plots[@]}" "$@" | tee build-quality/eval/summary.txt
build-quality/build/examples/quality/speed_quality --weights examples/quality/weights.pt | tee build-quality/eval/speed.md
