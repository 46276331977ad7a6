#!/usr/bin/env bash
# Sets up (apt + CMake build with the benchmark and the examples), then measures, in one run:
#   1. kvevict_bench at DeepSeek-V3 layer dims with 64 heads (qk 192, v 128, fp32, CPU, one
#      thread) for capacity 1,024 / 4,612 / 16,384, expanded and latent (ckv 512 + kpe 64)
#      layouts: update+evict, observe, attend, naive gather;
#   2. what the decode loops ask of LibTorch per step and layer on the tensor path (the path
#      CUDA takes; kvevict_bench --count-ops: kernels, views, copies, syncs, allocations);
#   3. the small configuration (4 layers, 4 heads, budget 64, n_sink 4, n_recent 16, random
#      scores): validate_eviction's cache_us_per_step against bench/gather_baseline.py (the
#      gather-per-step baseline in PyTorch), run alternately (3 each, medians);
# then prints the ratios from those numbers.
# Results: build/bench/{kvevict_bench.csv,kvevict_bench.json,op_count.txt,gather_comparison.txt}.
# Usage: scripts/bench.sh [extra kvevict_bench options, e.g. --reps 9 --min-time 0.5]
#   KVEVICT_BUILD_DIR=DIR scripts/bench.sh  reuses an already configured build directory DIR
#   (configured with -DKVEVICT_BUILD_BENCH=ON -DKVEVICT_BUILD_EXAMPLES=ON) instead of setup.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${KVEVICT_BUILD_DIR:-build}
if [ "$build" = build ]; then
  scripts/setup.sh kvevict_bench validate_eviction
else
  cmake --build "$build" -j "$(nproc)" --target kvevict_bench validate_eviction
fi

out=$build/bench
mkdir -p "$out"
echo "== machine: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), $(nproc) CPUs, load average $(cut -d' ' -f1-3 /proc/loadavg)"

echo "== kvevict_bench: expanded and latent layouts, 64 heads, fp32, CPU, one thread"
"$build/bench/kvevict_bench" --layout expanded,latent --heads 64 --qk-dim 192 --v-dim 128 --dtype fp32 --device cpu \
  --capacity 1024,4612,16384 --threads 1 --out-csv "$out/kvevict_bench.csv" --out-json "$out/kvevict_bench.json" "$@"

echo "== ATen ops per decode step and layer on the tensor path (latent, 128 heads, bf16, capacity 4,612)"
"$build/bench/kvevict_bench" --count-ops --layout latent --heads 128 --dtype bf16 --capacity 4612 \
  --check-observations off | tee "$out/op_count.txt"

echo "== small configuration: validate_eviction --scores random --threads 1 vs bench/gather_baseline.py (3 runs each, alternating)"
gather=bench/gather_baseline.py
python=${KVEVICT_VENV:-$HOME/.cache/kvevict/venv}/bin/python  # the project venv (setup.sh)
[ -x "$python" ] || python=python3
have_gather=1
if ! "$python" -c 'import torch' 2>/dev/null; then
  echo "note: $python cannot import torch (scripts/setup.sh makes the venv): no gather comparison"
  have_gather=0
fi
field() { sed -n "s|^$1: ||p" | tail -n1; }
median() { sort -g | awk '{v[NR] = $1} END {print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2}'; }
: > "$out/gather_runs.txt"
for run in 1 2 3; do
  if ! ours=$("$build/examples/validate_eviction" --scores random --threads 1) || ! grep -q '^PASS' <<<"$ours"; then
    echo "validate_eviction did not pass:"; echo "$ours"; exit 1
  fi
  echo "kvevict $(field cache_us_per_step <<<"$ours") $(field steps/sec <<<"$ours")" >> "$out/gather_runs.txt"
  if [ "$have_gather" = 1 ]; then
    theirs=$("$python" "$gather")
    echo "gather $(field cache_us_per_step <<<"$theirs") $(field steps/sec <<<"$theirs")" >> "$out/gather_runs.txt"
  fi
done
k_us=$(awk '$1 == "kvevict" {print $2}' "$out/gather_runs.txt" | median)
k_sps=$(awk '$1 == "kvevict" {print $3}' "$out/gather_runs.txt" | median)
{
  echo "kvevict validate_eviction (C++, 4 layers): cache_us_per_step $k_us, steps/sec $k_sps (medians of 3)"
  if [ "$have_gather" = 1 ]; then
    s_us=$(awk '$1 == "gather" {print $2}' "$out/gather_runs.txt" | median)
    s_sps=$(awk '$1 == "gather" {print $3}' "$out/gather_runs.txt" | median)
    echo "gather_baseline.py (PyTorch gather):         cache_us_per_step $s_us, steps/sec $s_sps (medians of 3)"
    awk -v k="$k_us" -v s="$s_us" -v ks="$k_sps" -v ss="$s_sps" 'BEGIN {
      printf "cache_us_per_step: gather / kvevict = %.1fx; whole loop steps/sec: kvevict / gather = %.1fx\n",
             s / k, ks / ss }'
  fi
} | tee "$out/gather_comparison.txt"

echo "== ratios (64 heads, fp32, CPU, one thread; from $out/kvevict_bench.csv)"
awk -F, 'NR == 1 {for (i = 1; i <= NF; ++i) col[$i] = i; next}
  $col["layout"] == "expanded" && $col["heads"] == 64 && $col["dtype"] == "fp32" && $col["batch"] == 1 {
    ue[$col["capacity"]] = $col["update_evict_us"]; uoe_r[$col["capacity"]] = $col["uoe_over_attend"]
    ue_r[$col["capacity"]] = $col["ue_over_attend"]; naive[$col["capacity"]] = $col["naive_us"] }
  $col["layout"] == "latent" && $col["heads"] == 64 && $col["dtype"] == "fp32" && $col["batch"] == 1 {
    lue[$col["capacity"]] = $col["update_evict_us"] }
  END {
    if (1024 in lue && 16384 in lue)
      printf "latent layout: update+evict, capacity 1,024 -> 16,384: x%.2f (%.1f -> %.1f us: the same O(capacity) score scan as the expanded layout, on a base without large row copies)\n",
           lue[16384] / lue[1024], lue[1024], lue[16384]
    if (1024 in ue && 16384 in ue) {
      x = ue[16384] / ue[1024]
      printf "update+evict, capacity 1,024 -> 16,384: x%.2f; naive gather: x%.1f\n", x, naive[16384] / naive[1024]
    }
    if (4612 in ue) {
      printf "capacity 4,612: update+evict = %.4f%% of attend, update+observe+evict = %.4f%% of attend\n",
             100 * ue_r[4612], 100 * uoe_r[4612]
    }
  }' "$out/kvevict_bench.csv"
echo "wrote $out/kvevict_bench.csv, $out/kvevict_bench.json, $out/op_count.txt, $out/gather_comparison.txt"
