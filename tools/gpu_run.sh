#!/usr/bin/env bash
# Builds Switchyard on a GPU machine and runs the GPU tests, compute-sanitizer and the benchmarks,
# with a summary on stdout. The source tree is the checkout this script lives in.
#   bash tools/gpu_run.sh [--steps LIST] [--commit SHA] [--archive FILE] WORK_DIR
# WORK_DIR (created when missing) receives everything the run writes:
#   WORK_DIR/build    the CMake build (Release, Ninja)
#   WORK_DIR/results  logs, benchmark JSON and markdown tables
#   WORK_DIR/pkg      python/switchyard plus the build's extension (steps pyfast, clifast)
# --archive FILE packs WORK_DIR/results into FILE (.tgz), e.g. "$OUT/results.tgz" on a lent GPU
# machine whose $OUT comes back. --commit SHA is stamped into the benchmark JSON: give it when
# the machine's copy of the tree may carry older git metadata than its files, where `git
# rev-parse` would name the wrong commit.
# --steps (comma-separated; default build,test,sanitize,bench): build, test (GPU + CPU ctest),
# python (pip install + pytest), pyfast (pytest on the build step's extension, without a second
# compile of the kernels), cli (switchyard-bench after a pip install), clifast (switchyard-bench on
# the build step's extension), bench, approx_ab (the staged approximate selection's same-call
# A/B), sanitize, demo.
# Tunables (environment): PYTHON_TIMEOUT, CLI_TIMEOUT, SANITIZE_TIMEOUT (seconds); SANITIZE_FILTER
# or SAN_FILTER_<test binary> (gtest filters); TIME_BUDGET (seconds, skips later sanitizer runs);
# AB_TOKENS, AB_CONFIGS (approx_ab points).
set -uo pipefail
usage() { sed -n '2,/^set -uo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit "${1:-0}"; }
SRC="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
STEPS=build,test,sanitize,bench
COMMIT=""
ARCHIVE=""
WORK=""
while [ $# -gt 0 ]; do
  case "$1" in
    --steps) STEPS="$2"; shift 2 ;;
    --commit) COMMIT="$2"; shift 2 ;;
    --archive) ARCHIVE="$2"; shift 2 ;;
    -h | --help) usage 0 ;;
    -*) echo "gpu_run.sh: unknown option $1" >&2; usage 2 >&2 ;;
    *) [ -z "$WORK" ] || { echo "gpu_run.sh: one WORK_DIR only" >&2; usage 2 >&2; }; WORK="$1"; shift ;;
  esac
done
[ -n "$WORK" ] || { echo "gpu_run.sh: WORK_DIR missing" >&2; usage 2 >&2; }
mkdir -p "$WORK"
WORK="$(cd "$WORK" && pwd)"
B="$WORK/build"
RES="$WORK/results"
PKG="$WORK/pkg"
mkdir -p "$RES"
has() { [[ ",$STEPS," == *",$1,"* ]]; }
export PATH="/usr/local/cuda/bin:$PATH"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv >"$RES/gpu.txt" 2>&1
cat "$RES/gpu.txt"

if has build; then
  start=$(date +%s)
  # The Python extension too when nanobind is importable, for the `pyfast` step (no second build).
  py_opts=()
  if python3 -c "import nanobind" >/dev/null 2>&1; then
    py_opts=(-DSWITCHYARD_BUILD_PYTHON=ON -DPython_EXECUTABLE="$(command -v python3)")
  fi
  cmake -S "$SRC" -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=Release -DSWITCHYARD_GIT_COMMIT="$COMMIT" "${py_opts[@]}" \
    >"$RES/configure.log" 2>&1 || { tail -30 "$RES/configure.log"; }
  cmake --build "$B" -j "$(nproc)" >"$RES/build.log" 2>&1 || { grep -E "error|Error" "$RES/build.log" | head -40; }
  echo "build: $(( $(date +%s) - start )) s"
fi

if has test; then
  for t in test_routing_cuda test_route_backward_cuda test_layout_cuda test_permute_cuda; do
    start=$(date +%s)
    timeout 400 "$B/tests/$t" --gtest_brief=1 >"$RES/$t.log" 2>&1
    rc=$?
    echo "$t rc=$rc $(( $(date +%s) - start )) s: $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$RES/$t.log" | tr '\n' ' ')"
    [ $rc -ne 0 ] && grep -E "FAILED|Failure|error" "$RES/$t.log" | head -20
  done
  (cd "$B" && ctest -E cuda -j 8 >"$RES/ctest_cpu.log" 2>&1; tail -3 "$RES/ctest_cpu.log")
fi

if has python; then
  start=$(date +%s)
  (cd "$SRC" && timeout "${PYTHON_TIMEOUT:-300}" bash scripts/python_test >"$RES/python.log" 2>&1; echo "python rc=$? $(( $(date +%s) - start )) s"; tail -4 "$RES/python.log")
fi

# A copy of python/switchyard with the build step's _ext added, in $PKG (for PYTHONPATH):
# the Python suite and switchyard-bench run on it without a pip install or a second compile of
# the kernels. Fails (with a message) when the build step made no extension.
build_tree_package() {
  local ext
  ext=$(ls "$B"/python/_ext*.so 2>/dev/null | head -1)
  if [ -z "$ext" ]; then
    echo "$1: no _ext module in $B/python (the build step found no nanobind)"
    return 1
  fi
  rm -rf "$PKG" && mkdir -p "$PKG" && cp -r "$SRC/python/switchyard" "$PKG/" && cp "$ext" "$PKG/switchyard/"
}

if has pyfast; then
  start=$(date +%s)
  if build_tree_package pyfast; then
    (cd "$SRC" && PYTHONPATH="$PKG" timeout "${PYTHON_TIMEOUT:-300}" python3 -m pytest tests/python -q -rs \
      >"$RES/python.log" 2>&1; echo "python (build-tree extension) rc=$? $(( $(date +%s) - start )) s"; tail -4 "$RES/python.log")
  fi
fi

# switchyard-bench (the README's main command) on the build step's extension.
if has clifast; then
  start=$(date +%s)
  if build_tree_package clifast; then
    (cd "$SRC" && PYTHONPATH="$PKG" SWITCHYARD_GIT_COMMIT="$COMMIT" timeout "${CLI_TIMEOUT:-240}" \
      python3 -m switchyard.bench --json "$RES/switchyard_bench.json" --plot "$RES/switchyard_bench.png" \
      >"$RES/switchyard_bench.md" 2>"$RES/switchyard_bench.err")
    echo "switchyard-bench (build-tree extension) rc=$? $(( $(date +%s) - start )) s"
    head -3 "$RES/switchyard_bench.md"; tail -3 "$RES/switchyard_bench.err"
  fi
fi

if has cli; then
  start=$(date +%s)
  (cd "$SRC" && SWITCHYARD_GIT_COMMIT="$COMMIT" SY_BENCH_REINSTALL="${SY_BENCH_REINSTALL:-0}" timeout "${CLI_TIMEOUT:-240}" bash scripts/bench \
    --json "$RES/switchyard_bench.json" --plot "$RES/switchyard_bench.png" >"$RES/switchyard_bench.md" 2>"$RES/switchyard_bench.err")
  echo "switchyard-bench rc=$? $(( $(date +%s) - start )) s"; head -3 "$RES/switchyard_bench.md"; tail -3 "$RES/switchyard_bench.err"
fi

if has bench; then
  for s in routing layout permute; do
    start=$(date +%s)
    timeout 300 "$B/bench/bench_$s" "$RES/bench_$s.json" >"$RES/bench_$s.md" 2>&1
    echo "bench_$s rc=$? $(( $(date +%s) - start )) s"
  done
fi

# Same-call A/B of route_staged.cuh's approximate selection (bench_routing --staged-approx=on / off,
# two rounds, interleaved) on the sigmoid + bias presets, with the default kernel choice and with the
# staged kernels forced (--staged=always: every T, and Kimi-K2's E = 384).
if has approx_ab; then
  for r in 1 2; do
    for k in 0 1; do
      for form in default forced; do
        flags=(--staged-approx=$([ "$k" = 1 ] && echo on || echo off)); [ "$form" = forced ] && flags+=(--staged=always)
        SY_BENCH_TOKENS="${AB_TOKENS:-4096,16384,32768,65536}" \
          timeout 300 "$B/bench/bench_routing" "${flags[@]}" "$RES/approx_ab_${form}_k${k}_r$r.json" \
          "${AB_CONFIGS:-deepseek-v3,glm-4.5,kimi-k2}" >"$RES/approx_ab_${form}_k${k}_r$r.md" 2>&1
      done
    done
  done
  for form in default forced; do
    python3 "$SRC/tools/bench_ab.py" --a "$RES"/approx_ab_${form}_k0_r*.json --b "$RES"/approx_ab_${form}_k1_r*.json \
      --title "staged approximate selection ($form kernels): exact (A) against approximate (B)" \
      --md "$RES/approx_ab_$form.md" | tail -4
  done
fi

if has sanitize; then
  for tool in memcheck racecheck; do
    for t in test_routing_cuda test_route_backward_cuda test_layout_cuda test_permute_cuda; do
      if [ "$SECONDS" -gt "${TIME_BUDGET:-100000}" ]; then echo "compute-sanitizer $tool $t: skipped (time budget)"; continue; fi
      # Per-binary filters keep the sanitizer runs short: SAN_FILTER_test_routing_cuda=... etc.;
      # the defaults below reach every kernel (layout: one-block, cluster and chunked paths).
      # Racecheck of LayoutCuda.PathBoundaries alone takes ~130 s on the H200: the layout subset needs
      # SANITIZE_TIMEOUT=300.
      var="SAN_FILTER_$t"
      case "$t" in
        test_routing_cuda) def="RoutingCuda.TieHeavy:RoutingCuda.GroupLimits:RoutingCuda.LaneHeavy" ;;
        test_layout_cuda) def="LayoutCuda.PathBoundaries:LayoutCuda.EdgeCases:LayoutCuda.RouteAndLayoutMatchesCpu" ;;
        test_permute_cuda) def="PermuteCuda.GatherSweep:PermuteCuda.CombineSweep:PermuteCuda.CombineBackwardSweep:PermuteCuda.EmptyInputs" ;;
        *) def="*" ;;
      esac
      filt="${!var:-${SANITIZE_FILTER:-$def}}"
      timeout "${SANITIZE_TIMEOUT:-240}" compute-sanitizer --tool $tool --error-exitcode 99 --print-limit 20 \
        "$B/tests/$t" --gtest_brief=1 --gtest_filter="$filt" >"$RES/san_${tool}_$t.log" 2>&1
      echo "compute-sanitizer $tool $t rc=$? $(grep -E '(ERROR|RACECHECK) SUMMARY' "$RES/san_${tool}_$t.log" | tail -1)"
    done
  done
fi

if has demo; then
  "$B/bench/switchyard_demo" 2>&1 | tee "$RES/demo.log"
fi

if [ -n "$ARCHIVE" ]; then
  mkdir -p "$(dirname "$ARCHIVE")" && tar -czf "$ARCHIVE" -C "$RES" .
fi
