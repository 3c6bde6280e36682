#!/usr/bin/env python3
"""Same-call A/B of two bench_routing / bench_layout JSON sets: the median of each point over the
runs of A and of B, the ratio B/A per point, its geometric mean, and the points that meet their
target on each side.
  python3 tools/bench_ab.py --a a1.json a2.json --b b1.json b2.json [--title T] [--md out.md]
"""
import argparse
import json
import math
import statistics


def key(p):
    return tuple(str(p.get(k, "")) for k in ("kind", "config", "logits_dtype", "tokens"))


def load(files):
    pts = {}
    for f in files:
        for p in json.load(open(f))["points"]:
            if p.get("ok", True) and p.get("median_us"):
                pts.setdefault(key(p), []).append(p)
    return pts


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--a", nargs="+", required=True)
    ap.add_argument("--b", nargs="+", required=True)
    ap.add_argument("--title", default="A/B")
    ap.add_argument("--md")
    args = ap.parse_args()
    A, B = load(args.a), load(args.b)
    rows, logs, met = [], [], [0, 0]
    for k in sorted(set(A) & set(B), key=lambda k: (k[0], k[1], k[2], int(k[3]) if k[3].isdigit() else 0)):
        a = statistics.median(p["median_us"] for p in A[k])
        b = statistics.median(p["median_us"] for p in B[k])
        t = A[k][0].get("target_us") or 0
        met[0] += bool(t) and a <= t
        met[1] += bool(t) and b <= t
        logs.append(math.log(b / a))
        rows.append("| " + " | ".join(x for x in k if x) + f" | {a:.2f} | {b:.2f} | {b / a:.3f} | {t or ''} |")
    gm = math.exp(sum(logs) / len(logs)) if logs else float("nan")
    out = [f"# {args.title}", "", f"A: {' '.join(args.a)}", f"B: {' '.join(args.b)}", "",
           f"{len(rows)} points; geometric mean of B/A {gm:.3f}; targets met: A {met[0]}, B {met[1]}", "",
           "| point | A | B | B/A | target |", "|---|---|---|---|---|"] + rows
    text = "\n".join(out) + "\n"
    if args.md:
        open(args.md, "w").write(text)
    print(text)


if __name__ == "__main__":
    main()
