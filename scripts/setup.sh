#!/usr/bin/env bash
# Shared by scripts/test, scripts/bench, scripts/python_test and scripts/demo: installs what building
# Switchyard needs when it is missing (Debian/Ubuntu), decides whether to build the CUDA backend,
# keeps the Python environment inside the checkout, and builds everything in one tree, build/
# (the C++ library, its tests, the benchmark programs and the Python extension), so that each
# source file compiles once whichever script runs first.
#
# Environment (for these scripts only; the library reads none of it):
#   SWITCHYARD_CUDA=1 / 0   build the CUDA backend / the CPU backend only (as --cuda / --cpu).
#                           Default: CUDA only where nvcc is found and a GPU that can run the
#                           kernels (sm_90) is present, or where build/ was configured with it.
#   SY_PYTHON=/path/python  use that interpreter instead of the checkout's .venv/.
#   SY_JOBS=N               parallel build jobs (default: the number of cores).
#   SY_BUILD_TYPE           CMake build type of build/ (default Release).
set -euo pipefail

SY_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SY_JOBS="${SY_JOBS:-$(nproc 2>/dev/null || echo 2)}"
SY_BUILD="$SY_ROOT/build"
export CMAKE_GENERATOR="${CMAKE_GENERATOR:-Unix Makefiles}"

sy_have_gtest() {
  [ -e /usr/include/gtest/gtest.h ] || [ -e /usr/local/include/gtest/gtest.h ] ||
    [ -e /usr/src/googletest/CMakeLists.txt ]
}

sy_need_packages() {
  local missing=()
  command -v cmake >/dev/null 2>&1 || missing+=(cmake)
  command -v g++ >/dev/null 2>&1 || missing+=(g++)
  command -v make >/dev/null 2>&1 || missing+=(make)
  command -v git >/dev/null 2>&1 || missing+=(git)
  if ! command -v python3 >/dev/null 2>&1; then
    missing+=(python3 python3-pip python3-venv python3-dev)
  elif [ -z "${SY_PYTHON:-}" ] && ! python3 -c "import ensurepip, venv" >/dev/null 2>&1; then
    missing+=(python3-venv)
  fi
  # "nogtest": the caller builds no C++ tests (scripts/bench).
  if [ "${1:-}" != nogtest ] && ! sy_have_gtest; then
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
}

# sy_gpu_reason: prints why no GPU here can run the kernels (sm_90a SASS), nothing when one can.
sy_gpu_reason() {
  if ! command -v nvidia-smi >/dev/null 2>&1; then
    echo "no NVIDIA driver (nvidia-smi not found)"
    return
  fi
  local caps
  if ! caps=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null) || [ -z "$caps" ]; then
    echo "nvidia-smi lists no GPU"
    return
  fi
  if ! grep -qx '9\.0' <<<"$caps"; then
    echo "no sm_90 GPU (compute capability $(echo $caps | tr ' ' ','); the kernels are built for sm_90a)"
  fi
}

# sy_decide_cuda REQUEST: sets SY_CUDA=ON|OFF and prints one line saying which and why.
# REQUEST: "on" (--cuda), "off" (--cpu) or "" (SWITCHYARD_CUDA, else decided here).
sy_decide_cuda() {
  local request="${1:-}"
  if [ -z "$request" ]; then
    case "${SWITCHYARD_CUDA:-}" in
      1 | ON | on | yes) request=on ;;
      0 | OFF | off | no) request=off ;;
      "") ;;
      *) echo "setup: SWITCHYARD_CUDA=${SWITCHYARD_CUDA}: expected 1 or 0" >&2; return 2 ;;
    esac
  fi
  local have_nvcc=0 reason cached=""
  command -v nvcc >/dev/null 2>&1 && have_nvcc=1
  if [ -f "$SY_BUILD/CMakeCache.txt" ]; then
    cached=$(sed -n 's/^SWITCHYARD_ENABLE_CUDA:BOOL=//p' "$SY_BUILD/CMakeCache.txt")
  fi
  if [ "$request" = on ]; then
    if [ "$have_nvcc" = 0 ]; then
      echo "setup: the CUDA backend was asked for (--cuda / SWITCHYARD_CUDA=1) but no nvcc was found (PATH, /usr/local/cuda/bin)" >&2
      return 2
    fi
    SY_CUDA=ON
    echo "setup: building the CUDA backend as asked ($(nvcc --version | tail -1))"
  elif [ "$request" = off ]; then
    SY_CUDA=OFF
    echo "setup: building the CPU backend only, as asked"
  elif [ "$have_nvcc" = 0 ]; then
    SY_CUDA=OFF
    echo "setup: no CUDA toolkit (nvcc) found: building the CPU backend only"
  elif [ -z "${reason:=$(sy_gpu_reason)}" ]; then
    SY_CUDA=ON
    echo "setup: sm_90 GPU and CUDA toolkit found: building the CUDA backend ($(nvcc --version | tail -1))"
  elif [ "$cached" = ON ]; then
    SY_CUDA=ON
    echo "setup: $reason, but build/ was configured with the CUDA backend before: keeping it (--cpu or SWITCHYARD_CUDA=0 switches to the CPU backend only)"
  else
    SY_CUDA=OFF
    echo "setup: $reason: building the CPU backend only (--cuda or SWITCHYARD_CUDA=1 also compiles the CUDA kernels, about 5 minutes on 2 cores)"
  fi
  if [ "$SY_CUDA" = ON ] && ! compgen -G "$SY_BUILD/src/CMakeFiles/switchyard.dir/cuda/*/*.cu.o" >/dev/null; then
    echo "setup: the CUDA kernels compile from scratch now: about 5 minutes with 2 jobs (the routing kernels, in five units, most of it), less with more cores; progress below"
  fi
}

# sy_python_env: sets SY_PY, the interpreter the scripts use: SY_PYTHON, else the checkout's own
# virtual environment .venv/ (created here; git ignores it). The venv sees the packages of the
# system python3 (torch, if installed there, is not downloaded again); what the scripts install
# goes into .venv/ only.
sy_python_env() {
  if [ -n "${SY_PYTHON:-}" ]; then
    SY_PY="$SY_PYTHON"
    echo "python: $SY_PY (SY_PYTHON)"
  else
    SY_PY="$SY_ROOT/.venv/bin/python"
    if [ ! -x "$SY_PY" ]; then
      echo "python: creating .venv/ (this checkout's own environment; sees the system python3's packages, installs go here; SY_PYTHON=... uses another interpreter)"
      python3 -m venv --system-site-packages "$SY_ROOT/.venv"
    fi
  fi
}

# sy_pip_need MODULE PIP-SPEC...: installs PIP-SPEC into SY_PY's environment when MODULE is not importable.
sy_pip_need() {
  local module="$1"
  shift
  if ! "$SY_PY" -c "import $module" >/dev/null 2>&1; then
    echo "python: pip install $*"
    "$SY_PY" -m pip install -q --disable-pip-version-check "$@"
  fi
}

# sy_build [--target T] [cmake args...]: configures build/ (CUDA per SY_CUDA, the Python extension
# for SY_PY) and builds it, all targets or T.
sy_build() {
  local target=()
  if [ "${1:-}" = --target ]; then
    target=(--target "$2")
    shift 2
  fi
  sy_pip_need nanobind "nanobind>=2.0"
  mkdir -p "$SY_BUILD"
  local start=$SECONDS
  cmake -S "$SY_ROOT" -B "$SY_BUILD" -DCMAKE_BUILD_TYPE="${SY_BUILD_TYPE:-Release}" \
    -DSWITCHYARD_ENABLE_CUDA="$SY_CUDA" -DSWITCHYARD_BUILD_PYTHON=ON -DPython_EXECUTABLE="$SY_PY" \
    "$@" >"$SY_BUILD.configure.log" 2>&1 || { cat "$SY_BUILD.configure.log"; return 1; }
  local beat=""
  if [ "$SY_CUDA" = ON ]; then
    # A CUDA file compiles for minutes without a line of output: say that the build is alive.
    (while sleep 60; do echo "   ... still compiling, $(( (SECONDS - start) / 60 )) min so far"; done) &
    beat=$!
  fi
  local rc=0
  cmake --build "$SY_BUILD" -j "$SY_JOBS" "${target[@]}" || rc=$?
  if [ -n "$beat" ]; then kill "$beat" 2>/dev/null || true; wait "$beat" 2>/dev/null || true; fi
  [ "$rc" = 0 ] || return "$rc"
  echo "== build/ up to date in $(( SECONDS - start )) s (CUDA backend $SY_CUDA)"
}

# sy_install_python: makes `import switchyard` in SY_PY load this checkout's package with the
# extension just built in build/: the package is assembled in build/python-pkg/ (the sources of
# python/switchyard plus build/'s _ext, as the wheel holds them) and a .pth file in SY_PY's
# site-packages points there. No second compile: `pip install .` builds its own copy.
sy_install_python() {
  local pkg="$SY_BUILD/python-pkg"
  rm -rf "$pkg/switchyard"
  mkdir -p "$pkg"
  cp -r "$SY_ROOT/python/switchyard" "$pkg/switchyard"
  find "$pkg/switchyard" -name __pycache__ -prune -exec rm -rf {} +
  cmake --install "$SY_BUILD" --component python --prefix "$pkg" >/dev/null
  local site
  site=$("$SY_PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  echo "$pkg" >"$site/switchyard-checkout.pth"
  local where
  where=$(cd / && "$SY_PY" -c 'import switchyard; print(switchyard.__file__)' 2>&1) || { echo "$where"; return 1; }
  if [ "$where" != "$pkg/switchyard/__init__.py" ]; then
    echo "python: $SY_PY imports another switchyard ($where) before this checkout's; uninstall it (pip uninstall switchyard) or use the default .venv/" >&2
    return 1
  fi
  echo "== python: $(cd / && "$SY_PY" -c 'import switchyard as s; print("switchyard", s.__version__, "CUDA backend:", s.built_with_cuda(), "PyTorch:", s.has_torch())') ($SY_PY)"
}

# sy_python_tests [pytest args...]: tests/python with pytest (installed into SY_PY's environment
# when missing), or the suite's own minimal runner where pytest cannot be installed (offline).
sy_python_tests() {
  sy_pip_need pytest pytest || true
  if "$SY_PY" -c "import pytest" >/dev/null 2>&1; then
    echo "== pytest tests/python -q -rs $*"
    (cd "$SY_ROOT" && "$SY_PY" -m pytest tests/python -q -rs "$@")
  else
    echo "== pytest unavailable; running tests/python with tests/python/minirunner.py"
    (cd "$SY_ROOT" && "$SY_PY" tests/python/minirunner.py tests/python "$@")
  fi
}

# sy_configure_build BUILD_DIR [extra cmake args...]: a separate tree (scripts/demo's old form).
sy_configure_build() {
  local dir="$1"
  shift
  cmake -S "$SY_ROOT" -B "$dir" -DCMAKE_BUILD_TYPE="${SY_BUILD_TYPE:-Release}" "$@" >"$dir.configure.log" 2>&1 ||
    { cat "$dir.configure.log"; return 1; }
  cmake --build "$dir" -j "$SY_JOBS"
}
