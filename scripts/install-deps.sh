#!/bin/sh
# Install headmix's Debian dependencies: `sh scripts/install-deps.sh test`
# for the test build, `... bench` for the benchmark suite (adds OpenBLAS,
# libtorch, matplotlib, and BLIS and libxsmm, the GEMM candidates it
# measures), `... ci` for everything .ci/run builds (adds clang, its
# sanitizer runtimes and OpenBLAS). Works as root (no sudo needed) and as
# a user with sudo; installs only what is missing.
set -eu
base="cmake ninja-build g++ libeigen3-dev nlohmann-json3-dev libgtest-dev libbenchmark-dev"
case "${1:-test}" in
  test)  packages="$base" ;;
  bench) packages="$base libopenblas-dev libtorch-dev python3-matplotlib libblis-dev libxsmm-dev pkg-config" ;;
  ci)    packages="$base libopenblas-dev clang libclang-rt-14-dev" ;;
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
