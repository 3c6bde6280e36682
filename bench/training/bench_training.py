"""Backward passes and a training step, on one GPU: Switchyard's gradients against PyTorch autograd
of the same computation written in plain PyTorch.

    python bench/training/bench_training.py --json bench/results/bench_training.json
    python bench/training/bench_training.py --tiny        # small shapes (CPU or GPU), a check only

Shapes: DeepSeek-V3 (H 7168, 256 experts, top 8, expert width 2048, grouped sigmoid routing) and
Qwen3-235B-A22B (H 4096, 128 experts, top 8, expert width 1536, softmax routing), bf16 rows.

- Backward ops, at T = 4096 and 16384 tokens: `loss.backward()`'s work for one op, timed as
  torch.autograd.grad over a retained graph (the same autograd machinery on both sides):
    gather   ours: sy.gather (backward: Switchyard's unweighted combine);
             torch: x.index_select(0, token of each row) (backward: zeros + index_add_)
    combine  ours: sy.combine (backward: switchyard::combine_backward);
             torch: (y[expanded_to_permuted] * w[..., None]).float().sum(1) (backward: index_put_
             with accumulate for dy, a product-sum for dw)
    route    ours: sy.route's weights (backward: the torch formulas of docs/design.md section 7);
             torch: the same rule written with softmax/sigmoid + topk + gather (autograd of it)
  Bytes counted as the minimum a backward must move (reads of its inputs, writes of its
  gradients). The kernel figure is Switchyard's backward op alone, called directly in a CUDA
  graph (switchyard-bench's method), as a fraction of the copy bandwidth measured in the same
  run; the autograd figures include autograd's host work, which dominates the small route
  backward on both sides.
- Training step, at T = 4096: one MoE layer, forward + backward (router GEMM, routing, token
  traffic, SwiGLU experts with torch._grouped_mm, weighted sum), with Switchyard's route_and_layout,
  gather and combine against the same layer written in plain PyTorch (topk routing, stable sort,
  index_select, index_add_). The gradients of both are compared once.
Timing: CUDA events around `--calls` back-to-back calls after a warm-up, median of `--repeats`;
kernels: a CUDA graph of 20 calls, median of its replays.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import subprocess
import sys
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

import switchyard as sy
from switchyard.bench import GpuTimer, measure_copy_bandwidth, torch_route

SHAPES = {
    # name: (preset, hidden, expert width)
    "deepseek-v3": ("deepseek-v3", 7168, 2048),
    "qwen3-235b-a22b": ("qwen3-235b-a22b", 4096, 1536),
}


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


class Timer:
    def __init__(self, device: torch.device, calls: int, repeats: int) -> None:
        self.device, self.calls, self.repeats = device, calls, repeats

    def time(self, fn: Callable[[], Any]) -> float:
        """Median microseconds per call."""
        for _ in range(5):
            fn()
        if self.device.type != "cuda":
            import time
            samples = []
            for _ in range(self.repeats):
                t0 = time.perf_counter()
                for _ in range(self.calls):
                    fn()
                samples.append((time.perf_counter() - t0) * 1e6 / self.calls)
            return statistics.median(samples)
        torch.cuda.synchronize(self.device)
        samples = []
        for _ in range(self.repeats):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(self.calls):
                fn()
            b.record()
            b.synchronize()
            samples.append(a.elapsed_time(b) * 1e3 / self.calls)
        return statistics.median(samples)


def layout_inputs(T: int, E: int, K: int, device: torch.device, seed: int) -> Tuple[torch.Tensor, Any]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(T, E, generator=g).topk(K, dim=-1).indices.to(torch.int32).to(device)
    return ids, sy.layout(ids, E, 1)


def backward_points(shape: str, T: int, timer: Timer, copy_bw: float, device: torch.device,
                    dtype: torch.dtype) -> List[Dict[str, Any]]:
    preset, H, _ = SHAPES[shape]
    cfg = sy.presets[preset]
    E, K = cfg.num_experts, cfg.top_k
    e = torch.empty(0, dtype=dtype).element_size()
    ids, lay = layout_inputs(T, E, K, device, seed=T + E)
    g = torch.Generator(device=device).manual_seed(T)
    R = lay.permuted_to_token.shape[0]
    e2p = lay.expanded_to_permuted.long()
    tok = (lay.permuted_to_expanded.long() // K).clamp(max=T - 1)[: T * K]  # tile size 1: rows 0..T*K-1 placed
    points = []

    graph_timer = GpuTimer(torch, 20, 50, 0.2) if device.type == "cuda" else None

    def point(op: str, ours: Callable[[], Any], theirs: Callable[[], Any], kernel: Callable[[], Any],
              nbytes: float) -> None:
        us, tus = timer.time(ours), timer.time(theirs)
        kus = graph_timer.time(lambda i: kernel())["median_us"] if graph_timer else timer.time(kernel)
        gbps = nbytes / (kus * 1e-6) / 1e9
        points.append({"shape": shape, "op": op, "tokens": T, "hidden": H, "num_experts": E, "top_k": K,
                       "dtype": str(dtype).replace("torch.", ""), "bytes": nbytes, "kernel_us": kus,
                       "gbps": gbps, "pct_copy": 100.0 * gbps * 1e9 / copy_bw, "median_us": us,
                       "torch_median_us": tus, "speedup": tus / us})

    # gather: d x [T,H] from d x_perm [R,H].
    x = torch.randn(T, H, device=device, generator=g).to(dtype).requires_grad_()
    dxp = torch.randn(R, H, device=device, generator=g).to(dtype)
    ours_out = sy.gather(x, lay)
    theirs_out = x.index_select(0, tok)
    point("gather_backward", lambda: torch.autograd.grad(ours_out, x, dxp, retain_graph=True),
          lambda: torch.autograd.grad(theirs_out, x, dxp[: T * K], retain_graph=True),
          lambda: torch.ops.switchyard.combine(dxp, lay.expanded_to_permuted, lay.permuted_to_token, None),
          (T * K + T) * H * e)
    del ours_out, theirs_out

    # combine: d y_perm [R,H] and d w [T,K] from d out [T,H].
    y = torch.randn(R, H, device=device, generator=g).to(dtype).requires_grad_()
    w = torch.rand(T, K, device=device, generator=g).requires_grad_()
    dout = torch.randn(T, H, device=device, generator=g).to(dtype)
    ours_out = sy.combine(y, lay, w)
    theirs_out = (y[e2p] * w[..., None]).float().sum(1).to(dtype)
    point("combine_backward", lambda: torch.autograd.grad(ours_out, (y, w), dout, retain_graph=True),
          lambda: torch.autograd.grad(theirs_out, (y, w), dout, retain_graph=True),
          lambda: torch.ops.switchyard.combine_backward(dout, y, lay.expanded_to_permuted, lay.permuted_to_token, w,
                                                        True, True),
          T * H * e + 2.0 * T * K * H * e + 4.0 * T * K * 2)
    del ours_out, theirs_out, y

    # route: d logits [T,E] fp32 from d weights [T,K].
    logits = torch.randn(T, E, device=device, generator=g).requires_grad_()
    bias = torch.randn(E, device=device, generator=g) * 0.1 if cfg.has_bias else None
    dw = torch.randn(T, K, device=device, generator=g)
    ours_ids, ours_w = sy.route(logits, cfg, bias=bias)
    _, theirs_w = torch_route(torch, logits, bias, cfg)
    rule = cfg.routing._op_args
    point("route_backward", lambda: torch.autograd.grad(ours_w, logits, dw, retain_graph=True),
          lambda: torch.autograd.grad(theirs_w, logits, dw, retain_graph=True),
          lambda: torch.ops.switchyard.route_backward(logits, bias, ours_ids, dw, rule[2], rule[3], rule[7]),
          4.0 * T * E * 2 + 12.0 * T * K)
    return points


class Layer(torch.nn.Module):
    """One MoE layer's parameters: router, SwiGLU experts (grouped_mm layout: [E, H, 2I], [E, I, H])."""

    def __init__(self, preset: str, H: int, inter: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        cfg = sy.presets[preset]
        E = cfg.num_experts
        g = torch.Generator(device=device).manual_seed(0)
        self.cfg = cfg
        self.router = torch.nn.Parameter(torch.randn(E, H, device=device, generator=g) * H ** -0.5)
        self.bias = (torch.randn(E, device=device, generator=g) * 0.1) if cfg.has_bias else None
        # Drawn in the rows' dtype: DeepSeek-V3's experts are 22 GB in bf16.
        self.gate_up = torch.nn.Parameter(torch.randn(E, H, 2 * inter, device=device, generator=g, dtype=dtype)
                                          .mul_(H ** -0.5))
        self.down = torch.nn.Parameter(torch.randn(E, inter, H, device=device, generator=g, dtype=dtype)
                                       .mul_(inter ** -0.5))

    def experts(self, xp: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        gu = torch._grouped_mm(xp, self.gate_up, offs=offs)
        gate, up = gu.chunk(2, dim=-1)
        return torch._grouped_mm(F.silu(gate) * up, self.down, offs=offs)

    def switchyard(self, x: torch.Tensor) -> torch.Tensor:
        logits = x.float() @ self.router.t()
        _, w, lay = sy.route_and_layout(logits, self.cfg, self.bias, tile_size=1)
        y = self.experts(sy.gather(x, lay), lay.offsets[1:])
        return sy.combine(y, lay, w)

    def plain(self, x: torch.Tensor) -> torch.Tensor:
        T, K, E = x.shape[0], self.cfg.top_k, self.cfg.num_experts
        logits = x.float() @ self.router.t()
        ids, w = torch_route(torch, logits, self.bias, self.cfg)
        flat = ids.reshape(-1)
        order = torch.sort(flat, stable=True).indices
        counts = torch.zeros(E, dtype=torch.int64, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
        offs = counts.cumsum(0).to(torch.int32)
        tok = order // K
        y = self.experts(x.index_select(0, tok), offs)
        weighted = y.float() * w.reshape(-1)[order, None]
        return torch.zeros(T, x.shape[1], dtype=torch.float32, device=x.device).index_add_(0, tok, weighted).to(x.dtype)


def training_point(shape: str, T: int, timer: Timer, device: torch.device, dtype: torch.dtype) -> Dict[str, Any]:
    preset, H, inter = SHAPES[shape]
    layer = Layer(preset, H, inter, dtype, device)
    g = torch.Generator(device=device).manual_seed(1)
    x0 = torch.randn(T, H, device=device, generator=g).to(dtype)
    target = torch.randn(T, H, device=device, generator=g).to(dtype)
    params = [p for p in layer.parameters() if p.requires_grad]

    def step(forward: Callable[[torch.Tensor], torch.Tensor]) -> Tuple[torch.Tensor, ...]:
        x = x0.detach().requires_grad_()
        loss = (forward(x).float() * target.float()).sum()
        return torch.autograd.grad(loss, [x] + params)

    def kept(grads: Tuple[torch.Tensor, ...]) -> List[torch.Tensor]:
        # x's and the router's gradients, and the first 4 experts' (one set of expert gradients
        # at a time fits next to DeepSeek-V3's weights).
        return [grads[0], grads[1]] + [gr[:4].clone() for gr in grads[2:]]

    ours = kept(step(layer.switchyard))
    theirs = kept(step(layer.plain))
    # The two layers compute the same function; their gradients agree to bf16 rounding.
    worst = max(float(((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-30)))
                for a, b in zip(ours, theirs))
    del ours, theirs
    us, tus = timer.time(lambda: step(layer.switchyard)), timer.time(lambda: step(layer.plain))
    del layer
    return {"shape": shape, "op": "training_step", "tokens": T, "hidden": H, "expert_width": inter,
            "num_experts": sy.presets[preset].num_experts, "top_k": sy.presets[preset].top_k,
            "dtype": str(dtype).replace("torch.", ""), "median_us": us, "torch_median_us": tus,
            "speedup": tus / us, "max_grad_rel_diff": worst}


def markdown(points: List[Dict[str, Any]]) -> str:
    lines = ["| shape | op | T | kernel us | GB/s | % copy | autograd us | PyTorch autograd us | speedup |",
             "|---|---|---|---|---|---|---|---|---|"]
    for p in points:
        k = f"{p['kernel_us']:.1f}" if "kernel_us" in p else ""
        gb = f"{p['gbps']:.0f}" if "gbps" in p else ""
        pct = f"{p['pct_copy']:.0f}%" if "pct_copy" in p else ""
        lines.append(f"| {p['shape']} | {p['op']} | {p['tokens']} | {k} | {gb} | {pct} | {p['median_us']:.1f} | "
                     f"{p['torch_median_us']:.1f} | {p['speedup']:.2f}x |")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default="", help="write the results here")
    ap.add_argument("--tiny", action="store_true", help="small shapes (a check that everything runs)")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated: " + ",".join(SHAPES))
    ap.add_argument("--tokens", default="4096,16384", help="token counts of the backward ops")
    ap.add_argument("--train-tokens", default="4096", help="token counts of the training step ('' for none)")
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16
    if args.tiny:
        for name in list(SHAPES):
            preset, _, _ = SHAPES[name]
            SHAPES[name] = (preset, 64, 32)
        tokens, train_tokens, args.calls, args.repeats = [64], [64], 2, 2
    else:
        tokens = [int(t) for t in args.tokens.split(",") if t]
        train_tokens = [int(t) for t in args.train_tokens.split(",") if t]
    timer = Timer(device, args.calls, args.repeats)
    copy_bw = measure_copy_bandwidth(torch, device.type, 1 << 30 if device.type == "cuda" else 1 << 24)["bytes_per_s"]
    points: List[Dict[str, Any]] = []
    for shape in args.shapes.split(","):
        for T in tokens:
            points += backward_points(shape, T, timer, copy_bw, device, dtype)
        for T in train_tokens:
            points.append(training_point(shape, T, timer, device, dtype))
    print(markdown(points))
    if args.json:
        meta = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
                "torch": torch.__version__, "commit": commit(),
                "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
                "copy_bandwidth_gbps": copy_bw / 1e9, "calls": args.calls, "repeats": args.repeats,
                "command": " ".join(["python", "bench/training/bench_training.py"] + (argv or sys.argv[1:]))}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "points": points}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
