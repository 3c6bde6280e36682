#!/usr/bin/env python3
"""Per-row instruction counts from an Nsight Compute source page (SASS), for finding where an
issue-bound kernel spends its instructions.

Produce the CSV on the GPU machine, e.g. for the routing kernel at T = 65536:
  SY_BENCH_TOKENS=65536 ncu --clock-control none --set full -k regex:route_kernel -c 1 \\
      -o r BUILD_DIR/bench/bench_routing x.json softmax-e256
  ncu --import r.ncu-rep --page source --csv --print-source sass > src.csv
then here:
  python3 tools/ncu_sass_summary.py src.csv --per 65536           # opcode totals per row
  python3 tools/ncu_sass_summary.py src.csv --per 65536 --lines   # every executed instruction
With `--print-source cuda,sass` (SASS under each CUDA source line; the kernel built with -lineinfo, as
src/CMakeLists.txt does), --source attributes the instructions to source lines instead, and
--functions also sums them per enclosing function of the named source files (a function starts at a
line that begins with `__device__`, `__host__`, `__global__`, `template` or `inline`; FILE=NAME reads
FILE as the source of the profiled file NAME, e.g. an older version of it):
  python3 tools/ncu_sass_summary.py src.csv --per 65536 --source --functions src/cuda/routing/route_warp.cuh
"""
import argparse
import bisect
import collections
import csv
import gzip
import os
import re


def read_rows(path):
    """The rows of an ncu source-page CSV (.csv or .csv.gz)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return list(csv.reader(f))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv", help="ncu --page source --csv --print-source sass output (.csv or .csv.gz)")
    ap.add_argument("--per", type=float, default=1.0, help="divide counts by this (rows, tokens, ...)")
    ap.add_argument("--lines", action="store_true", help="also print each executed instruction")
    ap.add_argument("--min", type=float, default=0.0, help="with --lines: skip instructions below this count")
    ap.add_argument("--source", action="store_true", help="a cuda,sass CSV: counts per source line")
    ap.add_argument("--functions", nargs="*", default=[],
                    help="with --source: also per function of these files (FILE or FILE=PROFILED_NAME)")
    ap.add_argument("--top", type=int, default=40, help="with --source: lines shown")
    a = ap.parse_args()
    rows = read_rows(a.csv)
    if a.source:
        source_summary(a, rows)
        return
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


def function_starts(path):
    """(line, name) of each function start in a source file (see the module docstring)."""
    starts = []
    with open(path) as f:
        for i, text in enumerate(f, 1):
            if re.match(r"(__device__|__host__|__global__|template|inline)\b", text):
                names = [n for n in re.findall(r"(\w+)\s*\(", text) if n not in ("__launch_bounds__", "static_cast")]
                starts.append((i, names[0] if names else text.strip()[:40]))
    return starts


def source_summary(a, rows):
    per_line, text, cur_file, n_col = collections.Counter(), {}, "?", None
    for r in rows:
        if len(r) == 2 and r[0] == "File Path":
            cur_file = r[1]
        elif r and r[0] == "Line No":
            n_col = r.index("Instructions Executed")
        elif n_col is not None and len(r) > n_col and r[0] != "":
            try:
                n = int(r[n_col].replace(",", ""))
            except ValueError:
                continue
            per_line[(cur_file, int(r[0]))] += n
            text[(cur_file, int(r[0]))] = r[1].strip()
    total = sum(per_line.values())
    print(f"warp instructions: {total} ({total / a.per:.1f} per unit)")
    by_file = collections.Counter()
    for (path, _), n in per_line.items():
        by_file[os.path.basename(path)] += n
    for name, n in by_file.most_common():
        print(f"  {name:32s} {n / a.per:9.1f}")
    for wanted in a.functions:
        wanted, _, profiled = wanted.partition("=")  # FILE=NAME: FILE is the profiled NAME's source
        starts = function_starts(wanted)
        lines = [s[0] for s in starts]
        by_fn = collections.Counter()
        for (path, line), n in per_line.items():
            if os.path.basename(path) == os.path.basename(profiled or wanted):
                i = bisect.bisect_right(lines, line) - 1
                by_fn[f"{starts[i][1]} (line {starts[i][0]})" if i >= 0 else "(file scope)"] += n
        print(f"\n  per function of {wanted}:")
        for name, n in by_fn.most_common():
            if n / a.per >= 0.5:
                print(f"  {n / a.per:9.1f}  {name}")
    print("\n  count/unit  file:line  source")
    for (path, line), n in per_line.most_common(a.top):
        print(f"  {n / a.per:9.1f}  {os.path.basename(path)}:{line}  {text[(path, line)][:90]}")


if __name__ == "__main__":
    main()
