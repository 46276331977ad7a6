#!/usr/bin/env bash
# Builds kvevict's tests with AddressSanitizer and UndefinedBehaviorSanitizer
# (-fsanitize=address,undefined, GCC 12) against Debian 12's LibTorch 1.13 into
# build-sanitize/, and runs the host tier's tests ([tier]: both paths, recall, lazy_reduction
# and LseRing with recall) and, where Gloo's headers are installed, the 2-rank tensor-parallel
# tests with a tier ([tensor_parallel][agree][tier]). Any sanitizer report fails the run.
#
# Not part of CI (.ci/run): the sanitized build of kvevict_tests alone takes longer than the
# ~10 minutes CI has left (see docs/building.md, "Sanitizers"). Run it by hand after changing
# the tier, the paths or the slot moves.
#
# Only kvevict is instrumented: LibTorch is Debian's uninstrumented build, so ASan sees our
# reads and writes of tensor memory (allocated by LibTorch's malloc, which ASan intercepts) but
# not what happens inside ATen kernels. Options set, and why:
#   ASAN_OPTIONS=detect_leaks=0          LibTorch keeps process-lifetime allocations (operator
#                                        registry, thread pools); leaks are not checked (a
#                                        leak-checked run has not been tried)
#   ASAN_OPTIONS=...:abort_on_error=1    a report fails the test (and ctest) at once
#   UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
#                                        plus -fno-sanitize-recover=undefined: UB fails the run
#   -fno-sanitize=vptr                   a precaution, not a measured need: vptr checks our casts
#                                        of LibTorch's polymorphic objects against RTTI from
#                                        another DSO; left off so that a report is ours to fix
# KVEVICT_SANITIZE_JOBS (default 2) sets the build's -j. Measured on the 2-core machine
# (2026-12-04, shared with other builds, load 5-9): the build 35 min (2,078 s), [tier] 43 s,
# the tensor-parallel tier tests 2 min 50 s (see docs/building.md, "Sanitizers").
# Usage: scripts/test_sanitizers.sh [extra Catch2 test spec for kvevict_tests, default "[tier]~[cuda]"]
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/apt_install.sh cmake g++ make libtorch-dev libopenblas0-pthread catch2 libfmt-dev libgloo-dev
spec=${1:-"[tier]~[cuda]"}
build=build-sanitize
jobs=${KVEVICT_SANITIZE_JOBS:-2}
flags="-fsanitize=address,undefined -fno-sanitize=vptr -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
mkdir -p $build
env -u CMAKE_PREFIX_PATH cmake -S . -B $build -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVEVICT_BUILD_TESTS=ON \
  -DKVEVICT_BUILD_EXAMPLES=OFF -DKVEVICT_BUILD_BENCH=OFF -DKVEVICT_PYTHON_TESTS=OFF \
  "-DCMAKE_CXX_FLAGS=$flags" "-DCMAKE_EXE_LINKER_FLAGS=-fsanitize=address,undefined" \
  -DTorch_DIR=/usr/lib/x86_64-linux-gnu/cmake/Torch > $build/configure.log 2>&1 || { cat $build/configure.log >&2; exit 1; }
known=$(cmake --build $build --target help)
targets=(--target kvevict_tests)
tp=0
if grep -qE "^\.\.\. kvevict_tp_tests( |$)" <<<"$known"; then targets+=(--target kvevict_tp_tests); tp=1; fi
start=$SECONDS
nice cmake --build $build -j "$jobs" "${targets[@]}"
echo "== sanitized build: $((SECONDS - start)) s"
export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
start=$SECONDS
$build/tests/kvevict_tests "$spec" --warn NoTests
echo "== kvevict_tests \"$spec\" under ASan+UBSan: $((SECONDS - start)) s"
if [ $tp = 1 ]; then
  start=$SECONDS
  $build/tests/tensor_parallel/kvevict_tp_tests "[tensor_parallel][agree][tier]" --warn NoTests
  echo "== kvevict_tp_tests [tensor_parallel][agree][tier] under ASan+UBSan: $((SECONDS - start)) s"
fi
echo "== sanitizers: PASSED"
