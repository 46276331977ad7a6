#!/usr/bin/env bash
# Measures what eviction does to the shipped quality model's answers (examples/quality/):
# retrieval by needle depth and context, held-out perplexity and attention-output error, for
# every policy at budgets 10, 25 and 50% of the context (and the full cache), under two
# protocols (one passkey question; four questions in turn), in both cache layouts; then the
# speed table.
#   scripts/eval_quality.sh [extra eval_quality flags]
# Installs what it needs (scripts/setup.sh, with gnuplot-nox for the plots and nodejs for the
# corpus, scripts/fetch_corpus.sh) and builds into build/.
# Output, in build-quality/eval/: quality.csv, summary.txt (the printed table), gnuplot data,
# plots.gp and *.png, speed.md.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
# Idle OpenMP workers sleep instead of spinning: on 2 shared cores a spinning worker steals
# the core OpenBLAS computes on (measured: ~half the trainer's CPU time went to spinning).
export OMP_WAIT_POLICY=PASSIVE
# apt (nodejs for the corpus, unless some node is on the PATH; gnuplot for the plots), then build/
extra=gnuplot-nox; command -v node >/dev/null || extra+=" nodejs"
KVEVICT_EXTRA_PKGS="$extra" scripts/setup.sh eval_quality speed_quality
scripts/fetch_corpus.sh build-quality/data
(cd examples/quality && sha256sum -c weights.pt.sha256)
mkdir -p build-quality/eval
build/examples/quality/eval_quality --weights examples/quality/weights.pt --data build-quality/data \
  --out build-quality/eval "$@" | tee build-quality/eval/summary.txt
build/examples/quality/speed_quality --weights examples/quality/weights.pt | tee build-quality/eval/speed.md
