#!/usr/bin/env bash
# Installs what kvevict needs on Debian 12 and builds it:
# 1. apt: the C++ build's packages (KVEVICT_EXTRA_PKGS: more, e.g. gnuplot-nox for
#    scripts/eval_quality.sh's plots);
# 2. the project venv at ${KVEVICT_VENV:-$HOME/.cache/kvevict/venv}: torch, transformers and
#    pytest from PyPI, pinned in python/requirements.txt (made once, ~2.5 min and 5.7 GB;
#    reinstalled only when that file changes: its sha256 is kept in the venv);
# 3. the overlay venv ${KVEVICT_VENV}-tf5.14: transformers 5.14 (python/requirements-tf5.14.txt,
#    the last release before DeepSeek caches the latent) over the main venv's torch and kvevict;
# 4. `pip install ".[hf]"` of this tree into the main venv (the extension is built against its
#    torch, in build/py-<tag>, reused);
# 5. configures build/ against the venv's torch (LibTorch 2.x from PyPI; tests, examples,
#    benchmarks, the pytest suite as ctests) and builds the given targets (all when none).
# Usage: [KVEVICT_VENV=DIR] [KVEVICT_PYTHON=python3] [KVEVICT_EXTRA_PKGS="pkg ..."] scripts/setup.sh [target ...]
#   KVEVICT_PYTHON: the Python the venv is made with when it does not exist (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
say() { echo "== [setup ${SECONDS}s] $*"; }

pkgs=(cmake g++ make catch2 libfmt-dev
      libgloo-dev   # Gloo headers: c10d groups for tensor parallelism (LibTorch links Gloo)
      python3 python3-venv python3-dev  # the venv and the extension's Python headers
      ${KVEVICT_EXTRA_PKGS:-})
scripts/apt_install.sh "${pkgs[@]}"

venv=${KVEVICT_VENV:-$HOME/.cache/kvevict/venv}
py=$venv/bin/python
req=python/requirements.txt
hash_of() { sha256sum "$1" | cut -d' ' -f1; }

# A venv whose python does not run (interrupted creation, a removed base Python) is made again.
if [ -e "$venv" ] && ! "$py" -c 'import sys' 2>/dev/null; then
  say "$venv is broken: making it again"
  rm -rf "$venv"
fi
if [ ! -e "$venv" ]; then
  say "making the venv $venv"
  mkdir -p "$(dirname "$venv")"
  "${KVEVICT_PYTHON:-python3}" -m venv "$venv"
fi
if [ "$(cat "$venv/.kvevict-requirements.sha256" 2>/dev/null)" != "$(hash_of $req)" ]; then
  say "$venv: pip install -r $req"
  "$py" -m pip install -q --disable-pip-version-check -r $req
  hash_of $req > "$venv/.kvevict-requirements.sha256"
fi

# The overlay: its own transformers (and the hub and tokenizers that one needs) first on sys.path,
# then the main venv's site-packages through a .pth file (torch, kvevict, pytest, the rest).
overlay=$venv-tf5.14
overlay_req=python/requirements-tf5.14.txt
site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if [ -e "$overlay" ] && ! "$overlay/bin/python" -c 'import sys' 2>/dev/null; then
  rm -rf "$overlay"
fi
if [ ! -e "$overlay" ]; then
  say "making the overlay venv $overlay"
  "$py" -m venv "$overlay"
fi
overlay_site=$("$overlay/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$site" > "$overlay_site/kvevict-main-venv.pth"
if [ "$(cat "$overlay/.kvevict-requirements.sha256" 2>/dev/null)" != "$(hash_of $overlay_req)" ]; then
  say "$overlay: pip install -r $overlay_req"
  # pip sees the main venv's packages through the .pth and installs here only what differs; it
  # never uninstalls outside this venv.
  "$overlay/bin/python" -m pip install -q --disable-pip-version-check -r $overlay_req
  hash_of $overlay_req > "$overlay/.kvevict-requirements.sha256"
fi

# The package, built against the venv's torch. --no-build-isolation: the build requirement
# (scikit-build-core) is in the venv, so a rerun needs no network.
say "pip install .[hf] into $venv"
"$py" -m pip install -q --disable-pip-version-check --no-build-isolation ".[hf]"

# build/ against the venv's torch. A build directory configured against another LibTorch (say
# Debian's, before the venv) keeps that LibTorch's paths in its cache: start that cache afresh.
torch_prefix=$("$py" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')
torch_root=$("$py" -c 'import os, torch; print(os.path.dirname(torch.__file__))')
# (-DTorch_DIR=... on the command line is cached as Torch_DIR:UNINITIALIZED, a find as :PATH.)
if [ -f build/CMakeCache.txt ] && ! grep -qxE "Torch_DIR:[A-Z]+=$torch_prefix/Torch" build/CMakeCache.txt; then
  say "build/ was configured against another LibTorch: configuring it afresh"
  rm -rf build/CMakeCache.txt build/CMakeFiles
fi
say "configuring build/ against torch in $torch_root"
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DKVEVICT_BUILD_TESTS=ON -DKVEVICT_BUILD_EXAMPLES=ON \
  -DKVEVICT_BUILD_BENCH=ON "-DCMAKE_PREFIX_PATH=$torch_prefix;$torch_root" "-DTorch_DIR=$torch_prefix/Torch" \
  "-DPython3_EXECUTABLE=$py" -DKVEVICT_PYTHON_TESTS=ON "-DKVEVICT_PYTHON_PRE_LATENT=$overlay/bin/python"
targets=()
for t in "$@"; do targets+=(--target "$t"); done
say "building build/ ${*:-(all)}"
cmake --build build -j "$(nproc)" "${targets[@]}"
say "done"
