#!/bin/sh
# Install headmix's Debian dependencies: `sh scripts/install-deps.sh test`
# for the test build (clang and its sanitizer runtimes, which the test
# preset compiles with, and libxsmm, the GEMM backend), `... bench` for the
# benchmark suite (adds libtorch, matplotlib, BLIS, the other GEMM
# candidate it measures, and Open MPI for the sharded layers), `... ci` for
# everything .ci/run builds (adds Open MPI, which the MPI tests run on).
# Works as root (no sudo needed) and as a user with sudo; installs only what
# is missing.
set -eu
# libxsmm multiplies (OpenBLAS defines the BLAS symbols its static library keeps).
base="cmake ninja-build g++ libeigen3-dev nlohmann-json3-dev libgtest-dev libbenchmark-dev libxsmm-dev libopenblas-dev pkg-config"
case "${1:-test}" in
  test)  packages="$base clang" ;;
  bench) packages="$base libtorch-dev python3-matplotlib libblis-dev libopenmpi-dev openmpi-bin" ;;
  ci)    packages="$base clang libopenmpi-dev openmpi-bin" ;;
  *) echo "usage: sh scripts/install-deps.sh [test|bench|ci]" >&2; exit 2 ;;
esac
if [ "$(id -u)" -eq 0 ]; then as_root=""; else as_root="sudo"; fi
updated=""

# Install those of the given packages that are missing.
install() {
  missing=""
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
  done
  [ -z "$missing" ] && return 0
  echo "install-deps: installing$missing"
  if [ -z "$updated" ]; then
    $as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    updated=1
  fi
  # shellcheck disable=SC2086
  $as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $missing
}

install $packages
# clang's sanitizer runtimes, which Debian 12 packages apart from clang
# (libclang-rt-<major>-dev; other releases with it), and llvm-symbolizer,
# through which ASan's reports name functions and lines (in llvm-<major>).
case " $packages " in
  *" clang "*)
    major=$(clang -dumpversion | cut -d. -f1)
    ls "$(clang -print-runtime-dir)"/libclang_rt.asan* >/dev/null 2>&1 || install "libclang-rt-$major-dev"
    command -v "llvm-symbolizer-$major" >/dev/null || command -v llvm-symbolizer >/dev/null || install "llvm-$major"
    ;;
esac
