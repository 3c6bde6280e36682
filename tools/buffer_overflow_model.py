#!/usr/bin/env python3
"""How often a routed row overflows the candidate buffers of src/cuda/routing/route_warp.cuh, the
model behind kShapeTable's token bounds.

A whole-warp row (W = 32) gives lane l the experts e with (e / 4) % 32 == l, and each lane keeps
its best D candidates. When one lane holds more than D of the row's K picks, the row leaves the
fast top-K pass for the exact rounds (~2700 cycles more on the H200). At small T the slowest row
is the call's time, so what matters is P(some row of T overflows) = 1 - (1 - p)^T. This draws
rows like bench_routing's (logits N(0, 1), bias 0.1 N(0, 1)) for the presets' rules and prints p
and that probability for D = 2, 3, 4.
  python3 tools/buffer_overflow_model.py [rows] [seed]
"""
import math
import random
import sys


def picks(row, k, groups=None):
    """Top-k expert ids by (score desc, id asc); groups = (n_group, topk_group) keeps the
    experts of the topk_group groups with the best top-2 sums (DeepSeek-V3's rule)."""
    order = sorted(range(len(row)), key=lambda e: (-row[e], e))
    if groups is not None:
        n_group, keep = groups
        size = len(row) // n_group
        sums = []
        for g in range(n_group):
            top = sorted(row[g * size:(g + 1) * size], reverse=True)
            sums.append((-(top[0] + top[1]), g))
        kept = {g for _, g in sorted(sums)[:keep]}
        order = [e for e in order if e // size in kept]
    return order[:k]


def overflow_rate(num_experts, k, rule, depth, rows, rng):
    bias = [0.1 * rng.gauss(0, 1) for _ in range(num_experts)]
    over = 0
    for _ in range(rows):
        x = [rng.gauss(0, 1) for _ in range(num_experts)]
        if rule == "sigmoid+bias":
            row = [1 / (1 + math.exp(-v)) + b for v, b in zip(x, bias)]
            chosen = picks(row, k)
        elif rule == "sigmoid+bias, 8 groups keep 4":
            row = [1 / (1 + math.exp(-v)) + b for v, b in zip(x, bias)]
            chosen = picks(row, k, (8, 4))
        else:  # softmax / none: the order of the logits
            chosen = picks(x, k)
        per_lane = {}
        for e in chosen:
            lane = (e // 4) % 32
            per_lane[lane] = per_lane.get(lane, 0) + 1
        over += max(per_lane.values()) > depth
    return over / rows


def main():
    rows = int(sys.argv[1]) if len(sys.argv) > 1 else 4000
    rng = random.Random(int(sys.argv[2]) if len(sys.argv) > 2 else 1)
    configs = [("qwen3-235b", 128, 8, "none"), ("gpt-oss-120b", 128, 4, "none"),
               ("glm-4.5", 160, 8, "sigmoid+bias"), ("softmax-e256-k8", 256, 8, "softmax"),
               ("deepseek-v3", 256, 8, "sigmoid+bias, 8 groups keep 4"), ("kimi-k2", 384, 8, "sigmoid+bias"),
               ("qwen3-next", 512, 10, "none")]
    print(f"{rows} random rows per line; p = rows whose picks overflow a buffer of D")
    print("config            E    K  D  p        P(T=16)  P(T=128) P(T=1024)")
    for name, e, k, rule in configs:
        for depth in (2, 3, 4):
            p = overflow_rate(e, k, rule, depth, rows, rng)
            any_of = [1 - (1 - p) ** t for t in (16, 128, 1024)]
            print(f"{name:16s} {e:4d} {k:3d} {depth:2d}  {p:.5f}  " + "  ".join(f"{q:7.3f}" for q in any_of))


if __name__ == "__main__":
    main()
