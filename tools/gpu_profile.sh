#!/usr/bin/env bash
# Nsight Compute profiles of single benchmark points on a GPU machine, from a build made by
# tools/gpu_run.sh (WORK_DIR/build) or any build with the benchmarks.
#   bash tools/gpu_profile.sh BUILD_DIR OUT_DIR SPEC...
# Each SPEC is name:bench:filter:tokens:kernel-regex:count, e.g. route_e256:routing:softmax-e256:65536:route_kernel:1
# profiles the first route_kernel launch of `bench_routing x.json softmax-e256` restricted to
# T = 65536 (SY_BENCH_TOKENS). The report of each lands in OUT_DIR/ncu_<name>.txt (details page, full
# set), the benchmark's own JSON in OUT_DIR/ncu_<name>.json, and a few headline metrics go to stdout.
# For per-instruction counts, see tools/ncu_sass_summary.py.
set -uo pipefail
if [ $# -lt 3 ]; then
  sed -n '2,/^set -uo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//' >&2
  exit 2
fi
B="$1"
OUT="$2"
shift 2
mkdir -p "$OUT"
export PATH="/usr/local/cuda/bin:$PATH"
for spec in "$@"; do
  IFS=: read -r name bench filter tokens regex count <<<"$spec"
  SY_BENCH_TOKENS="$tokens" timeout 180 ncu --clock-control none --set full -k "regex:$regex" -c "${count:-1}" \
    "$B/bench/bench_$bench" "$OUT/ncu_$name.json" $filter >"$OUT/ncu_$name.txt" 2>&1
  echo "== $name rc=$?"
  grep -E "^  [a-z_]+.*\(|Duration|Registers Per|Achieved Occupancy|Executed Ipc Active|Issue Slots Busy|No Eligible|Memory Throughput|Compute \(SM\) Throughput|Executed Instructions  |Warp Cycles Per Issued|Theoretical Occupancy" \
    "$OUT/ncu_$name.txt" | sed -E 's/ +/ /g' | head -40
done
