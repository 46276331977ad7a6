#!/usr/bin/env bash
# GPU check, for a machine with an NVIDIA GPU, a CUDA LibTorch (a pip `torch` wheel
# works), CMake and a C++ compiler, offline and without Catch2, fmt or Google Benchmark:
#   1. configure (examples off: they need fmt; tests use third_party/catch2; bench has no deps),
#   2. build the tests and the benchmark,
#   3. run the tests tagged [cuda] (the tier's CUDA kernels against their reference forms, the
#      CUDA graph replays against eager), then the CPU [steady_state] and [ops] tests,
#   4. run the benchmark's CUDA configurations (CUDA graph replay timing included), and the
#      layer-step with a recall every step at evict_every 1 and 16, with the tier's compiled
#      kernels and with their reference forms,
#   5. where this Python has transformers, accelerate, pytest, scikit-build-core and pybind11:
#      build the Python extension and run kvevict.hf's CUDA tests (layers split cpu + CUDA).
# Sized for one call of at most 8 minutes on a 16-core machine with one GPU.
# Never calls apt or the network. Logs and results go to $OUT (default: $BUILD_DIR/gpu_check).
#
# Usage: scripts/gpu_check.sh [--cpu-dry-run]
#   --cpu-dry-run   for a machine without a GPU: the same configure and build, then the CPU
#                   steady-state tests, the [cuda] tests (which return without a GPU) and one small
#                   CPU benchmark line; checks this script itself.
# Environment:
#   Torch_DIR   LibTorch's CMake package dir; default: python's torch.utils.cmake_prefix_path/Torch
#   PYTHON      the Python that has torch (default: the first of python3, python, /usr/bin/python3)
#   BUILD_DIR   build directory (default: build-gpu)   JOBS  parallel jobs (default: nproc)
#   OUT         where logs and results go
set -uo pipefail
cd "$(dirname "$0")/.."

dry_run=0
for arg in "$@"; do
  case "$arg" in
    --cpu-dry-run) dry_run=1 ;;
    -h | --help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "gpu_check: unknown argument '$arg' (see --help)" >&2; exit 2 ;;
  esac
done

build=${BUILD_DIR:-build-gpu}
out=${OUT:-$build/gpu_check}
jobs=${JOBS:-$(nproc)}
mkdir -p "$out"
summary="$out/summary.txt"
: > "$summary"
status=0
note() { echo "$*" | tee -a "$summary"; }
# step NAME LOG CMD...: runs CMD with its output in $out/LOG (and on the terminal); records PASS/FAIL.
step() {
  local name=$1 log=$2
  shift 2
  echo "== $name: $*"
  if "$@" 2>&1 | tee "$out/$log"; then
    note "PASS $name ($log)"
  else
    note "FAIL $name (see $out/$log)"
    status=1
    return 1
  fi
}

# --- LibTorch, CUDA toolkit, GPU --------------------------------------------------------------
python=""
for p in ${PYTHON:-} python3 python /usr/bin/python3; do
  if command -v "$p" >/dev/null 2>&1 && "$p" -c 'import torch' >/dev/null 2>&1; then python=$p; break; fi
done
torch_dir=${Torch_DIR:-}
if [ -z "$torch_dir" ] && [ -n "$python" ]; then
  torch_dir="$("$python" -c 'import torch; print(torch.utils.cmake_prefix_path)')/Torch"
fi
[ -n "$python" ] && note "python: $python, torch $("$python" -c 'import torch; print(torch.__version__, "cuda", torch.version.cuda)')"
note "Torch_DIR: ${torch_dir:-<not set: CMake searches its default prefixes>}"

gpu=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >"$out/nvidia-smi.txt" 2>&1; then
  gpu=1
  note "GPU: $(head -n1 "$out/nvidia-smi.txt")"
fi
if [ -n "$python" ] && [ "$("$python" -c 'import torch; print(int(torch.cuda.is_available()))' 2>/dev/null)" != 1 ]; then
  [ "$gpu" = 1 ] && note "torch.cuda.is_available() is False: this torch has no usable CUDA"
  gpu=0
fi
if [ "$gpu" = 0 ] && [ "$dry_run" = 0 ]; then
  note "gpu_check: no usable NVIDIA GPU here (nvidia-smi / torch.cuda); nothing run. On a CPU-only machine, --cpu-dry-run checks the script."
  exit 2
fi

# A CUDA LibTorch's CMake config looks for the CUDA toolkit: point it at one if nvcc is not on PATH.
cmake_args=(-DCMAKE_BUILD_TYPE=Release -DKVEVICT_BUILD_EXAMPLES=OFF -DKVEVICT_BUILD_TESTS=ON -DKVEVICT_BUILD_BENCH=ON)
[ -n "$torch_dir" ] && cmake_args+=("-DTorch_DIR=$torch_dir")
# A pip torch's prefix (torch/, three levels above Torch_DIR) in CMAKE_PREFIX_PATH: its config
# would otherwise take a system LibTorch's libraries (e.g. Debian's) where one is installed.
if [ -n "$torch_dir" ] && [ -d "$torch_dir/../../../lib" ]; then
  cmake_args+=("-DCMAKE_PREFIX_PATH=$(cd "$torch_dir/../../.." && pwd)")
fi
if ! command -v nvcc >/dev/null 2>&1; then
  for root in "${CUDA_HOME:-}" "${CUDA_PATH:-}" /usr/local/cuda /usr/local/cuda-*; do
    if [ -n "$root" ] && [ -x "$root/bin/nvcc" ]; then
      export PATH="$root/bin:$PATH" CUDA_HOME="$root" CUDA_PATH="$root" CUDAToolkit_ROOT="$root"
      break
    fi
  done
fi
if command -v nvcc >/dev/null 2>&1; then
  note "nvcc: $(command -v nvcc) ($(nvcc --version | sed -n 's/.*release \([0-9.]*\).*/\1/p'))"
  cuda_root=$(dirname "$(dirname "$(command -v nvcc)")")
  cmake_args+=("-DCUDAToolkit_ROOT=$cuda_root" "-DCUDA_TOOLKIT_ROOT_DIR=$cuda_root")
  # The tests' CUDA graph case includes <ATen/cuda/CUDAGraph.h>, which needs the CUDA headers.
  [ "$gpu" = 1 ] && cmake_args+=("-DCMAKE_CXX_FLAGS=-isystem $cuda_root/include")
elif [ "$gpu" = 1 ]; then
  note "note: no nvcc found (PATH, CUDA_HOME, /usr/local/cuda*): a CUDA LibTorch's CMake config may fail to configure"
fi

# --- build --------------------------------------------------------------------------------------
step configure configure.log cmake -S . -B "$build" "${cmake_args[@]}" || { note "gpu_check: configure failed"; exit 1; }
step build build.log cmake --build "$build" -j "$jobs" --target kvevict_tests kvevict_bench ||
  { note "gpu_check: build failed"; exit 1; }
tests="$build/tests/kvevict_tests"
bench="$build/bench/kvevict_bench"

# --- tests --------------------------------------------------------------------------------------
# [cuda]: every CUDA test, the tier's CUDA kernels against their reference forms and the CUDA
# graph replays of a decode step (with a recall every step among them) against eager; then the
# CPU steady-state and kernel tests. The full suite is CI's (scripts/test.sh), not this one's:
# the whole check fits in one 8-minute call.
step "tests [cuda]" tests_cuda.log "$tests" "[cuda]" --warn NoTests
step "tests [steady_state]" tests_steady_state.log "$tests" "[steady_state]~[cuda]" --warn NoTests
step "tests [ops]" tests_ops.log "$tests" "[ops]~[cuda]" --warn NoTests

# --- benchmark ----------------------------------------------------------------------------------
if [ "$dry_run" = 1 ]; then
  step "bench (CPU, dry run)" bench_cpu.txt "$bench" --device cpu --heads 4 --capacity 84,1024 --layout expanded,latent \
    --min-time 0.05 --reps 3 --out-csv "$out/bench_cpu.csv" --out-json "$out/bench_cpu.json"
  step "bench recall (CPU tensor path, dry run)" bench_cpu_recall.txt "$bench" --device cpu --heads 4 --capacity 84 \
    --layout latent --evict-every 16 --recall --tensor-path --check-observations off --no-naive --min-time 0.05 --reps 3
else
  # DeepSeek-V3's layer at 64 and 128 heads, both layouts, bf16, sync-free (observation checks
  # off, the CUDA default, as a CUDA graph needs).
  step "bench CUDA bf16" bench_cuda_bf16.txt "$bench" --device cuda --layout expanded,latent --heads 64,128 \
    --dtype bf16 --capacity 1024,4612,16384 --check-observations off --min-time 0.1 \
    --out-csv "$out/bench_cuda_bf16.csv" --out-json "$out/bench_cuda_bf16.json"
  # The recall figures: one latent layer-step at capacity 4,612, 128 heads, bf16, evict_every 1
  # and 16, graphed without a tier ("u+o+e graph", per step of a replayed window) and eager with
  # a recall every step ("u+o+e+recall"), with the tier's compiled kernels and with their ATen
  # reference forms (--reference), side by side.
  for ee in 1 16; do
    for form in kernels reference; do
      flag=(); [ "$form" = reference ] && flag=(--reference)
      step "bench CUDA recall, evict_every $ee, $form" "bench_cuda_recall_ee${ee}_$form.txt" "$bench" --device cuda \
        --layout latent --heads 128 --dtype bf16 --capacity 4612 --check-observations off --evict-every "$ee" --recall \
        --no-naive --min-time 0.1 "${flag[@]}" --out-csv "$out/bench_cuda_recall_ee${ee}_$form.csv"
    done
  done
fi

# --- transformers on CUDA ------------------------------------------------------------------------
# The CUDA tests of kvevict.hf (a model split between the CPU and CUDA with device_map among
# them), where this Python has what the extension's build and the tests need (offline: nothing
# is fetched). The extension is built without its CUDA kernels, to keep the call short.
if [ "$dry_run" = 0 ] && "$python" -c 'import transformers, accelerate, pytest, scikit_build_core, pybind11' 2>/dev/null; then
  step "python extension" pip_install.log "$python" -m pip install --no-build-isolation --no-deps -v \
    -Ccmake.define.KVEVICT_KERNELS_CUDA=OFF . &&
    step "transformers on CUDA" pytest_hf_cuda.log "$python" -m pytest python/tests/test_hf.py -k cuda -q -rs
else
  note "SKIP transformers on CUDA: needs transformers, accelerate, pytest, scikit-build-core and pybind11 in ${python:-python}"
fi

echo "== summary ($summary)"
cat "$summary"
exit $status
