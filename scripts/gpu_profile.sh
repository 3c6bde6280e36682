#!/usr/bin/env bash
# Nsight Compute profiles of single benchmark points on the lent GPU (run it there, after
# scripts/gpu_run.sh STEPS=build has built into /tmp/sy_build). Each argument is
#   name:bench:filter:tokens:kernel-regex:count
# e.g. route_e256:routing:softmax-e256:65536:route_kernel:1 profiles the first route_kernel launch
# of `bench_routing x.json softmax-e256` restricted to T = 65536 (SY_BENCH_TOKENS). Reports land
# in $OUT/ncu_<name>.txt (details page, full set) and a few headline metrics go to stdout. For
# per-instruction counts, see scripts/ncu_sass_summary.py.
set -uo pipefail
B=/tmp/sy_build
OUT="${OUT:-/tmp/sy_out}"
mkdir -p "$OUT"
export PATH="/usr/local/cuda/bin:$PATH"
for spec in "$@"; do
  IFS=: read -r name bench filter tokens regex count <<<"$spec"
  SY_BENCH_TOKENS="$tokens" timeout 180 ncu --clock-control none --set full -k "regex:$regex" -c "${count:-1}" \
    "$B/bench/bench_$bench" "/tmp/ncu_$name.json" $filter >"$OUT/ncu_$name.txt" 2>&1
  echo "== $name rc=$?"
  grep -E "^  [a-z_]+.*\(|Duration|Registers Per|Achieved Occupancy|Executed Ipc Active|Issue Slots Busy|No Eligible|Memory Throughput|Compute \(SM\) Throughput|Executed Instructions  |Warp Cycles Per Issued|Theoretical Occupancy" \
    "$OUT/ncu_$name.txt" | sed -E 's/ +/ /g' | head -40
done
