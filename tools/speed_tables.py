#!/usr/bin/env python3
"""The README's speed tables from committed benchmark JSON (bench/results/), so that they are regenerated
rather than retyped after a new full run:
  python3 tools/speed_tables.py --routing bench/results/bench_routing.json \\
      --layout bench/results/bench_layout.json
Routing: fp32 logits, every configuration of bench_routing, median us per call; '*' marks a point above
its target (the issue's where it names one, else max(2 us, 1.3 x the HBM floor)). Layout: layout from ids
and route + layout at the issue's token counts.
"""
import argparse
import json

ROUTING_T = (1, 128, 4096, 16384, 65536)
LAYOUT_T = (1, 128, 256, 4096, 8192, 65536)


def cell(p):
    if p is None or not p.get("ok", True) or not p.get("median_us"):
        return "-"
    v = p["median_us"]
    s = f"{v:.3g}" if v < 100 else f"{v:.0f}"
    return s + ("" if p.get("met", True) else "*")


def routing_table(path):
    d = json.load(open(path))
    pts = {(p["config"], p["logits_dtype"], p["tokens"]): p for p in d["points"]}
    configs = list(dict.fromkeys(p["config"] for p in d["points"]))
    head = "| rule | E | K | " + " | ".join(f"T = {t}" for t in ROUTING_T) + " | target at 65536 |"
    lines = [head, "|" + "---|" * (4 + len(ROUTING_T))]
    for c in configs:
        last = pts.get((c, "fp32", ROUTING_T[-1]))
        if last is None:
            continue
        row = [cell(pts.get((c, "fp32", t))) for t in ROUTING_T]
        lines.append(f"| {c} | {last['num_experts']} | {last['top_k']} | " + " | ".join(row) +
                     f" | {last['target_us']:.3g} |")
    met = sum(1 for p in d["points"] if p.get("met"))
    lines.append("")
    lines.append(f"{met} of {len(d['points'])} points (fp32 and bf16) meet their target; "
                 f"{d['device']}, {d['date'][:10]}, commit {d['commit']}.")
    return "\n".join(lines)


def layout_table(path):
    d = json.load(open(path))
    rows = {}
    for p in d["points"]:
        if p["op"] == "layout" and p.get("ids", "uniform") != "uniform":
            continue
        rows.setdefault((p["op"], p["config"]), {})[p["T"]] = p
    head = "| op | config | " + " | ".join(f"T = {t}" for t in LAYOUT_T) + " |"
    lines = [head, "|" + "---|" * (2 + len(LAYOUT_T))]
    for (op, config), by_t in rows.items():
        lines.append(f"| {op} | {config} | " + " | ".join(cell(by_t.get(t)) for t in LAYOUT_T) + " |")
    lines.append("")
    lines.append(f"{d['device']}, {d['date'][:10]}, commit {d['commit']}.")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--routing", required=True)
    ap.add_argument("--layout", required=True)
    args = ap.parse_args()
    print(routing_table(args.routing))
    print()
    print(layout_table(args.layout))


if __name__ == "__main__":
    main()
