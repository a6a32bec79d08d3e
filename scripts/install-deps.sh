#!/bin/sh
# Install headmix's Debian dependencies: `sh scripts/install-deps.sh test`
# for the test build (with libxsmm, the GEMM backend), `... bench` for the
# benchmark suite (adds libtorch, matplotlib, BLIS, the other GEMM
# candidate it measures, and Open MPI for the sharded layers), `... ci` for
# everything .ci/run builds (adds clang, its sanitizer runtimes and Open
# MPI, which the MPI tests run on). Works as root (no sudo needed) and as
# a user with sudo; installs only what is missing.
set -eu
# libxsmm multiplies (OpenBLAS defines the BLAS symbols its static library keeps).
base="cmake ninja-build g++ libeigen3-dev nlohmann-json3-dev libgtest-dev libbenchmark-dev libxsmm-dev libopenblas-dev pkg-config"
case "${1:-test}" in
  test)  packages="$base" ;;
  bench) packages="$base libtorch-dev python3-matplotlib libblis-dev libopenmpi-dev openmpi-bin" ;;
  ci)    packages="$base clang libclang-rt-14-dev libopenmpi-dev openmpi-bin" ;;
  *) echo "usage: sh scripts/install-deps.sh [test|bench|ci]" >&2; exit 2 ;;
esac
missing=""
for p in $packages; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
[ -z "$missing" ] && exit 0
if [ "$(id -u)" -eq 0 ]; then as_root=""; else as_root="sudo"; fi
echo "install-deps: installing$missing"
$as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
# shellcheck disable=SC2086
$as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $missing
