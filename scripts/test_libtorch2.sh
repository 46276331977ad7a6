#!/usr/bin/env bash
# Builds kvevict and runs the whole ctest suite against LibTorch 2.x: Debian 13's LibTorch 2.6
# with GCC 14 and fmt 10, in a Debian 13 root made with debootstrap from Debian's archive (the
# Catch2 there is v3: the tests use the vendored third_party/catch2 v2 header). Needs root
# (debootstrap, mount, chroot); installs debootstrap on the host when it is missing.
#
# A run killed before its exit trap (SIGKILL) leaves its bind mounts (/proc, /sys, /dev, the
# source tree) under the root until the next run removes them: do not delete build/ before.
# Idempotent: the root is made once and reused (KVEVICT_DEBIAN13_ROOT, default
# build/debian13-root); the source tree is bind-mounted into it at /src and built into
# build-libtorch2/ (only what ctest runs: no benchmarks, no examples ctest does not run, no
# Python module). Every mount is undone on exit, also on failure. Exits non-zero when anything
# fails.
# Usage: scripts/test_libtorch2.sh
set -euo pipefail
cd "$(dirname "$0")/.."
src=$(pwd)
root=${KVEVICT_DEBIAN13_ROOT:-$src/build/debian13-root}
[ "$(id -u)" -eq 0 ] || { echo "test_libtorch2.sh: needs root (debootstrap, mount, chroot)" >&2; exit 1; }

pkgs=(cmake g++ make libtorch-dev libopenblas0-pthread libfmt-dev libgloo-dev)
apt_quiet=(-y -qq -o Dpkg::Use-Pty=0 -o DPkg::Lock::Timeout=600)
export DEBIAN_FRONTEND=noninteractive

mounted=()
cleanup() {
  local i
  for ((i = ${#mounted[@]} - 1; i >= 0; i--)); do umount "${mounted[i]}" || umount -l "${mounted[i]}" || true; done
}
trap cleanup EXIT
bind() {  # bind <host dir> <dir in the root>; unmounted on exit
  mkdir -p "$root$2"
  mount --bind "$1" "$root$2"
  mounted+=("$root$2")
}
# A run killed before its exit trap (SIGKILL) leaves its bind mounts behind: undo them first, so
# that nothing below (the root's removal, a later rm -rf build) reaches through them.
for d in /proc /sys /dev /src; do
  while mountpoint -q "$root$d" 2>/dev/null; do umount "$root$d" || umount -l "$root$d"; done
done

# 1. The Debian 13 root. debootstrap removes $root/debootstrap when it has finished: a root
#    that still has it was interrupted and is made again.
if [ ! -x "$root/usr/bin/apt-get" ] || [ -e "$root/debootstrap" ]; then
  if ! command -v debootstrap >/dev/null; then
    echo "== installing debootstrap on the host"
    apt-get update -qq
    apt-get install "${apt_quiet[@]}" debootstrap >/dev/null
  fi
  echo "== debootstrap: Debian 13 (trixie) into $root"
  # Never delete through a mount (the source tree is bind-mounted into the root):
  # --one-file-system skips whatever is still mounted under it.
  rm -rf --one-file-system "$root"
  mkdir -p "$(dirname "$root")"
  debootstrap --variant=minbase trixie "$root" > "$root.debootstrap.log" 2>&1 ||
    { tail -n 30 "$root.debootstrap.log" >&2; exit 1; }
fi
bind /proc /proc
bind /sys /sys
bind /dev /dev
bind "$src" /src
in_root() { chroot "$root" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 \
  DEBIAN_FRONTEND=noninteractive "$@"; }

# 2. The build packages (the chroot resolves names through the host's resolver).
cp -L /etc/resolv.conf "$root/etc/resolv.conf"
missing=()
for p in "${pkgs[@]}"; do
  in_root dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "== installing in the root: ${missing[*]}"
  in_root apt-get update -qq
  in_root apt-get install "${apt_quiet[@]}" --no-install-recommends "${missing[@]}" > "$root.apt.log" 2>&1 ||
    { tail -n 30 "$root.apt.log" >&2; exit 1; }
fi
echo "== $(in_root dpkg-query -W -f='libtorch-dev ${Version}, ' libtorch-dev)$(in_root g++ --version | head -n 1)"

# 3. Configure, build what ctest runs, run ctest.
jobs=$(nproc)
mkdir -p "$src/build-libtorch2"
log=$src/build-libtorch2/configure.log
in_root cmake -S /src -B /src/build-libtorch2 -DCMAKE_BUILD_TYPE=Release -DKVEVICT_BUILD_TESTS=ON \
  -DKVEVICT_BUILD_EXAMPLES=ON -DKVEVICT_BUILD_BENCH=OFF -DKVEVICT_PYTHON_TESTS=OFF > "$log" 2>&1 ||
  { cat "$log" >&2; exit 1; }
grep -E "kvevict:|Catch2" "$log" || true
# The executables ctest runs (the target kvevict_test_programs).
in_root cmake --build /src/build-libtorch2 -j "$jobs" --target kvevict_test_programs
in_root ctest --test-dir /src/build-libtorch2 --output-on-failure -j "$jobs"
