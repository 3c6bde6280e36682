"""A DeepSeek-V3-shaped MoE layer with expert parallelism (EP), checked against a dense reference:

    router GEMM (fp32 logits) -> switchyard.route (DeepSeek-V3 rule, selection bias)
    -> EP dispatch straight into the expert-major layout of the rank's local experts
    -> per-expert SwiGLU GEMMs (torch._grouped_mm over layout.offsets, or a per-expert loop)
    -> EP combine (weighted by the routing weights, added onto the shared expert's output)

Rank r holds its own tokens and the weights of its experts [r*L, (r+1)*L), L = E / R. Every
weight comes from --seed deterministically, so each rank also builds the single-process dense
reference for its tokens (every routed expert's SwiGLU, weighted, plus the shared expert, with
the routing the layer computed) and prints its max abs error and PASS/FAIL (exit code 1 on FAIL).
Tolerance: |out - ref| <= atol + rtol*|ref| with atol = rtol = 1e-4 in fp32, 2e-2 in bf16.

Run:  python examples/ep_moe_layer.py --loopback 4                  # 4 ranks on one GPU
      torchrun --nproc-per-node 8 examples/ep_moe_layer.py          # one rank per GPU (GpuGroup, NCCL)
      torchrun --nproc-per-node 2 examples/ep_moe_layer.py          # on one GPU: ranks share it (gloo)
      python examples/ep_moe_layer.py --cpu 4                       # CPU reference group (threads)
"""

import argparse
import hashlib
import os
import sys
import time
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

import switchyard as sy
import switchyard.ep as ep

Tensor = torch.Tensor
TOLERANCE = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (2e-2, 2e-2)}  # (atol, rtol)


def routing_config(num_experts: int, top_k: int) -> sy.RoutingConfig:
    """DeepSeek-V3's preset, or its rule (sigmoid scores, top-2-sum group selection, normalized
    weights times 2.5) with n_group / topk_group fitted to other expert counts."""
    p = sy.presets["deepseek-v3"]
    if num_experts == p.num_experts and top_k == p.top_k:
        return p
    for n_group in range(min(p.n_group, num_experts // 2), 0, -1):
        size = num_experts // n_group
        if num_experts % n_group or size < 2:  # top2_sum needs two experts per group
            continue
        for topk_group in range(max(1, n_group // 2), n_group + 1):
            if topk_group * size >= top_k:
                return sy.RoutingConfig(num_experts, top_k, pre=p.pre, post=p.post, group_rule=p.group_rule,
                                        n_group=n_group, topk_group=topk_group, scale=p.scale)
    return sy.RoutingConfig(num_experts, top_k, pre=p.pre, post=p.post, scale=p.scale)


def randn(seed: int, key: Tuple, shape: Sequence[int], scale: float) -> Tensor:
    """fp32 CPU normals fixed by (seed, key), the same in every process."""
    digest = hashlib.sha256(repr((seed,) + key).encode()).digest()
    g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    return torch.randn(*shape, generator=g) * scale


def swiglu(x: Tensor, gate_up: Tensor, down: Tensor) -> Tensor:
    """(silu(x @ W_gate^T) * (x @ W_up^T)) @ W_down^T; gate_up [2I, H], down [H, I]."""
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down)


def grouped_mm_default(device: torch.device, dtype: torch.dtype) -> bool:
    return hasattr(torch, "_grouped_mm") and device.type == "cuda" and dtype == torch.bfloat16


def grouped_swiglu(x: Tensor, counts: Tensor, offsets: Tensor, gate_up: Tensor, down: Tensor,
                   use_grouped_mm: Optional[bool] = None) -> Tensor:
    """Expert-major rows x [P, H] through local expert l's SwiGLU (gate_up [L, 2I, H], down
    [L, H, I]) on rows offsets[l]:offsets[l+1]. Rows past offsets[L] are left unset; combine
    reads only the rows holding tokens. use_grouped_mm None: torch._grouped_mm for bf16 on CUDA
    (its fast kernel), else the loop."""
    if use_grouped_mm is None:
        use_grouped_mm = grouped_mm_default(x.device, x.dtype)
    if use_grouped_mm:
        ends = offsets[1:]  # cumulative group ends, as grouped_mm's offs; no host read
        h = torch._grouped_mm(x, gate_up.transpose(1, 2), offs=ends)
        gate, up = h.chunk(2, dim=-1)
        return torch._grouped_mm(F.silu(gate) * up, down.transpose(1, 2), offs=ends)
    y = x.new_empty(x.shape[0], down.shape[1])
    for l, (start, n) in enumerate(zip(offsets.tolist(), counts.tolist())):  # one host read
        if n:
            y[start:start + n] = swiglu(x[start:start + n], gate_up[l], down[l])
    return y


class Layer:
    """The layer's weights (all from one seed) and one rank's pieces of its forward."""

    def __init__(self, args: argparse.Namespace, num_ranks: int, dtype: torch.dtype, device: torch.device):
        E, H, I = args.experts, args.hidden, args.intermediate
        self.args, self.dtype, self.device = args, dtype, device
        self.cfg = routing_config(E, args.top_k)
        self.experts_per_rank = E // num_ranks
        put = lambda t: t.to(dtype=dtype, device=device)  # noqa: E731
        self.router = put(randn(args.seed, ("router",), (E, H), H ** -0.5))
        self.bias = randn(args.seed, ("bias",), (E,), 0.02).to(device)  # selection-only bias, fp32
        self.shared_gate_up = put(randn(args.seed, ("shared_gate_up",), (2 * I, H), H ** -0.5))
        self.shared_down = put(randn(args.seed, ("shared_down",), (H, I), I ** -0.5))

    def expert(self, e: int) -> Tuple[Tensor, Tensor]:
        """Global expert e's (gate_up [2I, H], down [H, I])."""
        H, I = self.args.hidden, self.args.intermediate
        return (randn(self.args.seed, ("gate_up", e), (2 * I, H), H ** -0.5).to(self.dtype).to(self.device),
                randn(self.args.seed, ("down", e), (H, I), I ** -0.5).to(self.dtype).to(self.device))

    def local_experts(self, rank: int) -> Tuple[Tensor, Tensor]:
        """Rank `rank`'s experts stacked: (gate_up [L, 2I, H], down [L, H, I])."""
        L = self.experts_per_rank
        pairs = [self.expert(e) for e in range(rank * L, (rank + 1) * L)]
        return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])

    def tokens(self, rank: int) -> Tensor:
        return randn(self.args.seed, ("tokens", rank), (self.args.tokens, self.args.hidden), 1.0).to(
            dtype=self.dtype, device=self.device)

    def route(self, x: Tensor) -> Tuple[Tensor, Tensor]:
        """(topk_ids [T, K] int32 global, topk_weights [T, K] fp32) from fp32 router logits."""
        logits = F.linear(x.float(), self.router.float())
        return sy.route(logits, self.cfg, self.bias)

    def shared(self, x: Tensor) -> Tensor:
        return swiglu(x, self.shared_gate_up, self.shared_down)

    def reference(self, x: Tensor, ids: Tensor, weights: Tensor) -> Tensor:
        """Dense single-process output in fp32: sum_k weight * expert(x) + shared(x), each expert
        computed in the layer's dtype from its full weights."""
        out = self.shared(x).float()
        for e in ids.unique().tolist():
            t, k = (ids == e).nonzero(as_tuple=True)
            out.index_add_(0, t, weights[t, k, None] * swiglu(x[t], *self.expert(e)).float())
        return out


def rank_forward(layer: Layer, group, rank: int, x: Tensor, experts: Tuple[Tensor, Tensor]):
    """One rank's whole layer on a group whose collectives block per rank (CpuGroup, GpuGroup):
    (output [T, H], topk_ids, topk_weights)."""
    ids, weights = layer.route(x)
    d = group.dispatch(rank, x, ids, weights)
    y = grouped_swiglu(d.expert_x, d.layout.counts, d.layout.offsets, *experts)
    out = group.combine(rank, d.handle, y, out=layer.shared(x), accumulate=True)
    return out, ids, weights


def run_rank_steps(args: argparse.Namespace, layer: "Layer", group, rank: int, cuda: bool):
    """A rank of a group whose collectives block per rank (CpuGroup, GpuGroup) runs the layer
    args.steps times: (its outputs, the reference for its tokens, step milliseconds)."""
    x, experts = layer.tokens(rank), layer.local_experts(rank)
    last: List[Tensor] = []

    def step() -> List[Tensor]:
        out, ids, weights = rank_forward(layer, group, rank, x, experts)
        last[:] = [ids, weights]
        return [out]

    outs, times = run_steps(args.steps, step, cuda=cuda)
    return [o[0] for o in outs], layer.reference(x, *last), times


def run_steps(steps: int, step: Callable[[], List[Tensor]], cuda: bool) -> Tuple[List[List[Tensor]], List[float]]:
    """Runs step() `steps` times: (the outputs of each step, each step's milliseconds)."""
    outs, times = [], []
    for _ in range(steps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            outs.append(step())
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            outs.append(step())
            times.append((time.perf_counter() - t0) * 1e3)
    return outs, times


def check(layer: Layer, rank: int, outs: List[Tensor], ref: Tensor) -> bool:
    """Prints rank `rank`'s worst error over the steps; True when every step is within tolerance."""
    atol, rtol = TOLERANCE[layer.dtype]
    err, ok = 0.0, True
    for out in outs:
        diff = (out.float() - ref).abs()
        err = max(err, float(diff.max()))
        ok = ok and bool(torch.isfinite(out).all()) and bool((diff <= atol + rtol * ref.abs()).all())
    print(f"rank {rank}: max abs err {err:.3e} (max |ref| {float(ref.abs().max()):.3f}, atol {atol:g}, "
          f"rtol {rtol:g}) {'PASS' if ok else 'FAIL'}", flush=True)
    return ok


def report(args: argparse.Namespace, layer: Layer, mode: str, times: List[float]) -> None:
    c = layer.cfg
    print(f"{mode}: E={args.experts} (L={layer.experts_per_rank} per rank) K={args.top_k} T={args.tokens} per rank "
          f"H={args.hidden} I={args.intermediate} tile={args.tile_size} {layer.dtype}; routing n_group={c.n_group} "
          f"topk_group={c.topk_group}; expert GEMMs: "
          f"{'torch._grouped_mm' if grouped_mm_default(layer.device, layer.dtype) else 'per-expert loop'}", flush=True)
    for i, ms in enumerate(times):
        print(f"step {i}: {ms:.3f} ms", flush=True)


def run_cpu(args: argparse.Namespace, R: int, dtype: torch.dtype) -> bool:
    """R ranks as threads on a CpuGroup; each rank calls every collective from its own thread."""
    layer = Layer(args, R, dtype, torch.device("cpu"))
    group = ep.CpuGroup(R, args.experts, args.top_k, args.tokens, args.hidden, dtype=dtype, tile_size=args.tile_size)

    results = ep.run_ranks(R, lambda rank: run_rank_steps(args, layer, group, rank, cuda=False))
    report(args, layer, f"cpu group, {R} ranks", results[0][2])
    return all([check(layer, r, outs, ref) for r, (outs, ref, _) in enumerate(results)])


def run_loopback(args: argparse.Namespace, R: int, dtype: torch.dtype) -> bool:
    """R ranks on one GPU driven from this thread: every rank's dispatch in turn, then the
    expert GEMMs, then every rank's combine in turn (the calls only enqueue)."""
    device = torch.device("cuda", torch.cuda.current_device())
    layer = Layer(args, R, dtype, device)
    group = ep.LoopbackGroup(R, args.experts, args.top_k, args.tokens, args.hidden, dtype=dtype,
                             tile_size=args.tile_size, device=device)
    xs = [layer.tokens(r) for r in range(R)]
    experts = [layer.local_experts(r) for r in range(R)]
    routed: List[Tuple[Tensor, Tensor]] = []

    def step() -> List[Tensor]:
        routed[:] = [layer.route(x) for x in xs]
        ds = [group.dispatch(r, xs[r], *routed[r]) for r in range(R)]
        # A dispatch's rows are ready on this stream once every rank has made it.
        ys = [grouped_swiglu(d.expert_x, d.layout.counts, d.layout.offsets, *experts[r]) for r, d in enumerate(ds)]
        return [group.combine(r, ds[r].handle, ys[r], out=layer.shared(xs[r]), accumulate=True) for r in range(R)]

    outs, times = run_steps(args.steps, step, cuda=True)
    group.synchronize()  # raises what the device reported (timeouts, a rank's bad arguments)
    report(args, layer, f"loopback group, {R} ranks on {torch.cuda.get_device_name(device)}", times)
    refs = [layer.reference(xs[r], *routed[r]) for r in range(R)]
    return all([check(layer, r, [o[r] for o in outs], refs[r]) for r in range(R)])


def run_torchrun(args: argparse.Namespace, dtype: torch.dtype) -> bool:
    """This process's rank of a GpuGroup over torch.distributed (launched by torchrun)."""
    import torch.distributed as dist

    # More processes than GPUs share them (GpuGroup maps one GPU's region into each); NCCL
    # refuses two ranks on one GPU, so the exchanges then go over gloo.
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
    dist.init_process_group("nccl" if torch.cuda.device_count() >= int(os.environ["WORLD_SIZE"]) else "gloo")
    try:
        rank, R = dist.get_rank(), dist.get_world_size()
        layer = Layer(args, R, dtype, torch.device("cuda", torch.cuda.current_device()))
        group = ep.GpuGroup(None, num_experts=args.experts, top_k=args.top_k, max_tokens=args.tokens,
                            hidden=args.hidden, dtype=dtype, tile_size=args.tile_size)
        outs, ref, times = run_rank_steps(args, layer, group, rank, cuda=True)
        group.synchronize()
        if rank == 0:
            report(args, layer, f"gpu group, {R} processes", times)
        ok = check(layer, rank, outs, ref)
        verdicts: List[bool] = [False] * R
        dist.all_gather_object(verdicts, ok)  # every process exits 1 when any rank failed
        return all(verdicts)
    finally:
        dist.destroy_process_group()


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--loopback", type=int, metavar="R", help="R ranks on one GPU (LoopbackGroup)")
    mode.add_argument("--cpu", type=int, metavar="R", help="R ranks as threads on the CPU (CpuGroup)")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per rank")
    parser.add_argument("--hidden", type=int, default=1024, help="hidden size (DeepSeek-V3: 7168)")
    parser.add_argument("--experts", type=int, default=64, help="routed experts (DeepSeek-V3: 256)")
    parser.add_argument("--top-k", type=int, default=8, help="experts per token (DeepSeek-V3: 8)")
    parser.add_argument("--intermediate", type=int, default=256,
                        help="expert and shared expert FFN width (DeepSeek-V3: 2048)")
    parser.add_argument("--tile-size", type=int, default=16, help="rows each expert's segment is padded to")
    parser.add_argument("--dtype", choices=["bf16", "fp32"], help="default: bf16 on GPU, fp32 with --cpu")
    parser.add_argument("--steps", type=int, default=3, help="forward passes, each timed")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torchrun = "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ
    if args.cpu is None and args.loopback is None and not torchrun:
        parser.error("choose --loopback R, --cpu R, or launch with torchrun")
    ranks = args.cpu if args.cpu is not None else args.loopback if args.loopback is not None else \
        int(os.environ["WORLD_SIZE"])
    if ranks < 1 or args.experts % ranks:
        parser.error(f"--experts {args.experts} must be a multiple of the {ranks} ranks")
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    if args.loopback is not None and args.loopback > 8:
        # One hardware queue per rank's stream; CUDA reads this when it starts.
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", str(args.loopback))
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or ("fp32" if args.cpu else "bf16")]
    with torch.no_grad():
        if args.cpu is not None:
            ok = run_cpu(args, args.cpu, dtype)
        elif args.loopback is not None:
            ok = run_loopback(args, args.loopback, dtype)
        else:
            ok = run_torchrun(args, dtype)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
