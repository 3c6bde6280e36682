#!/usr/bin/env python3
"""Per-row instruction counts from an Nsight Compute source page (SASS), for finding where an
issue-bound kernel spends its instructions.

Produce the CSV on the GPU machine, e.g. for the routing kernel at T = 65536:
  SY_BENCH_TOKENS=65536 ncu --clock-control none --set full -k regex:route_kernel -c 1 \\
      -o /tmp/r bench_routing /tmp/x.json softmax-e256
  ncu --import /tmp/r.ncu-rep --page source --csv --print-source sass > src.csv
then here:
  python3 scripts/ncu_sass_summary.py src.csv --per 65536           # opcode totals per row
  python3 scripts/ncu_sass_summary.py src.csv --per 65536 --lines   # every executed instruction
"""
import argparse
import collections
import csv
import gzip


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv", help="ncu --page source --csv --print-source sass output (.csv or .csv.gz)")
    ap.add_argument("--per", type=float, default=1.0, help="divide counts by this (rows, tokens, ...)")
    ap.add_argument("--lines", action="store_true", help="also print each executed instruction")
    ap.add_argument("--min", type=float, default=0.0, help="with --lines: skip instructions below this count")
    a = ap.parse_args()
    opener = gzip.open if a.csv.endswith(".gz") else open
    with opener(a.csv, "rt") as f:
        rows = list(csv.reader(f))
    header = next(i for i, r in enumerate(rows) if "Instructions Executed" in r)
    cols = rows[header]
    n_col, src_col = cols.index("Instructions Executed"), cols.index("Source")
    stall_col = cols.index("Warp Stall Sampling (All Samples)") if "Warp Stall Sampling (All Samples)" in cols else None
    total, by_op, lines = 0, collections.Counter(), []
    for r in rows[header + 1:]:
        try:
            n = int(r[n_col].replace(",", ""))
        except (ValueError, IndexError):
            continue
        src = r[src_col].strip()
        words = src.split()
        op = (words[1] if words and words[0].startswith("@") and len(words) > 1 else (words[0] if words else "?"))
        by_op[op.split(".")[0]] += n
        total += n
        stalls = r[stall_col] if stall_col is not None else ""
        lines.append((n, stalls, src))
    print(f"warp instructions: {total} ({total / a.per:.1f} per unit)")
    for op, n in by_op.most_common(30):
        print(f"  {op:12s} {n / a.per:9.1f}")
    if a.lines:
        print("\n  count/unit  stall-samples  instruction")
        for n, stalls, src in lines:
            if n > 0 and n / a.per >= a.min:
                print(f"  {n / a.per:9.2f}  {stalls:>12}  {src}")


if __name__ == "__main__":
    main()
