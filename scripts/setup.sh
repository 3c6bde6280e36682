#!/usr/bin/env bash
# Installs what building Switchyard needs when it is missing (Debian/Ubuntu), and defines
# sy_configure_build BUILD_DIR [cmake args...]. Sourced by scripts/demo and scripts/test.
set -euo pipefail

SY_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SY_JOBS="${SY_JOBS:-$(nproc 2>/dev/null || echo 2)}"

sy_need_packages() {
  local missing=()
  command -v cmake >/dev/null 2>&1 || missing+=(cmake)
  command -v g++ >/dev/null 2>&1 || missing+=(g++)
  command -v make >/dev/null 2>&1 || missing+=(make)
  command -v git >/dev/null 2>&1 || missing+=(git)
  command -v python3 >/dev/null 2>&1 || missing+=(python3 python3-pip)
  # "nogtest": the caller builds no C++ tests (scripts/bench).
  if [ "${1:-}" != nogtest ] && [ ! -e /usr/include/gtest/gtest.h ] && [ ! -e /usr/local/include/gtest/gtest.h ]; then
    missing+=(libgtest-dev)
  fi
  if [ "${#missing[@]}" -gt 0 ]; then
    echo "setup: installing ${missing[*]}"
    local sudo=""
    [ "$(id -u)" -ne 0 ] && sudo="sudo"
    { $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}"; } ||
      echo "setup: could not install ${missing[*]}; the build may fail without them" >&2
  fi
  # nvcc usually lives outside PATH in /usr/local/cuda.
  if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
    export PATH="/usr/local/cuda/bin:$PATH"
  fi
  if command -v nvcc >/dev/null 2>&1; then
    echo "setup: CUDA toolkit found ($(nvcc --version | tail -1)); the CUDA backend will be built"
  else
    echo "setup: no CUDA toolkit (nvcc) found; building the CPU backend only"
  fi
}

# sy_configure_build BUILD_DIR [extra cmake args...]
sy_configure_build() {
  local dir="$1"
  shift
  cmake -S "$SY_ROOT" -B "$dir" -DCMAKE_BUILD_TYPE="${SY_BUILD_TYPE:-Release}" "$@" >"$dir.configure.log" 2>&1 ||
    { cat "$dir.configure.log"; return 1; }
  cmake --build "$dir" -j "$SY_JOBS"
}
