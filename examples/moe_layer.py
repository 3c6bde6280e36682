"""A full Mixture-of-Experts layer on PyTorch with Switchyard doing the token traffic:

    router GEMM (torch) -> switchyard.route_and_layout -> switchyard.gather
    -> per-expert SwiGLU GEMMs (torch, one slice of rows per expert: offsets/counts)
    -> switchyard.combine (weighted sum in fp32, k order; adds onto the shared expert's output)

Run:  python examples/moe_layer.py --preset deepseek-v3 --tokens 256 [--device cuda] [--dtype bf16]
      python examples/moe_layer.py --preset mixtral-8x7b --train-steps 20   # training (see below)

Training: route_and_layout, gather and combine carry gradients (the selection does not; the
selection bias is trained by the aux-loss-free rule instead). --train-steps N trains the layer
with Adam on a synthetic regression target (a teacher layer's output) plus the load-balancing
and z losses, next to a copy of it written in plain PyTorch, and prints both loss curves.

The per-expert loop reads the layout's counts and offsets on the host (one sync per layer); an
engine would hand x_perm, tile_expert and tile_row_end to a grouped GEMM kernel instead, and the
whole layer would stay on the device.
"""

import argparse
import copy
import time
from typing import Optional

import torch
import torch.nn.functional as F

import switchyard as sy


class SwitchyardMoE(torch.nn.Module):
    """An MoE layer with the routing rule of a Switchyard preset (sy.presets) and SwiGLU experts:
    expert(x) = (silu(x @ W_gate^T) * (x @ W_up^T)) @ W_down^T."""

    def __init__(self, preset: str, hidden_size: int, intermediate_size: int, tile_size: int = 16,
                 shared_intermediate_size: Optional[int] = None, dtype: torch.dtype = torch.float32,
                 device: Optional[torch.device] = None, seed: int = 0):
        super().__init__()
        self.config = sy.presets[preset]
        self.tile_size = tile_size
        E, H, I = self.config.num_experts, hidden_size, intermediate_size
        g = torch.Generator().manual_seed(seed)

        def param(*shape, scale, requires_grad=True):
            return torch.nn.Parameter((torch.randn(*shape, generator=g) * scale).to(dtype=dtype, device=device),
                                      requires_grad=requires_grad)

        self.router = param(E, H, scale=H ** -0.5)  # router GEMM weight: logits = x @ router^T
        # Models like DeepSeek-V3 carry a per-expert bias used for expert selection only: it has
        # no gradient and is trained by the aux-loss-free rule (switchyard.update_expert_bias).
        self.selection_bias = param(E, scale=0.02, requires_grad=False) if self.config.has_bias else None
        self.gate_up = param(E, 2 * I, H, scale=H ** -0.5)
        self.down = param(E, H, I, scale=I ** -0.5)
        self.shared_gate_up = self.shared_down = None
        if shared_intermediate_size:
            self.shared_gate_up = param(2 * shared_intermediate_size, H, scale=H ** -0.5)
            self.shared_down = param(H, shared_intermediate_size, scale=shared_intermediate_size ** -0.5)

    @staticmethod
    def swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, down)

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return self.swiglu(x, self.gate_up[e], self.down[e])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        return self.forward_with_router(x)[0]

    def forward_with_router(self, x: torch.Tensor):
        """(out [T, H], router logits [T, E], topk_ids [T, K], tokens per expert [E])."""
        logits = F.linear(x, self.router)  # [T, E]
        bias = None if self.selection_bias is None else self.selection_bias.float()
        # Routing and the expert-contiguous layout in one call: ids/weights [T, K] and the Layout.
        ids, weights, lay = sy.route_and_layout(logits, self.config, bias, tile_size=self.tile_size)
        x_perm = sy.gather(x, lay)  # [R, H]: each expert's tokens contiguous, in token order

        y_perm = torch.empty_like(x_perm)  # only rows holding a token are read back by combine
        counts, offsets = lay.counts.tolist(), lay.offsets.tolist()
        for e, count in enumerate(counts):
            if count:
                rows = slice(offsets[e], offsets[e] + count)
                y_perm[rows] = self.expert(e, x_perm[rows])

        if self.shared_gate_up is None:
            out = sy.combine(y_perm, lay, weights)
        else:
            out = self.swiglu(x, self.shared_gate_up, self.shared_down)
            out = sy.combine(y_perm, lay, weights, out=out, accumulate=True)  # out += routed experts
        return out, logits, ids, sy.tokens_per_expert(lay)


def plain_pytorch_forward(layer: SwitchyardMoE, x: torch.Tensor):
    """The same layer in plain PyTorch (torch.topk routing, index_add per expert), returning
    what forward_with_router returns: the baseline the training curve is compared with."""
    cfg = layer.config
    logits = F.linear(x, layer.router)
    s = logits.float()
    p = {"softmax": lambda: torch.softmax(s, -1), "sigmoid": lambda: torch.sigmoid(s),
         "sqrtsoftplus": lambda: torch.sqrt(F.softplus(s)), "none": lambda: s}[cfg.pre]()
    q = p.detach() if layer.selection_bias is None else p.detach() + layer.selection_bias.float()
    T, E = q.shape
    if cfg.group_rule != "none":
        G = E // cfg.n_group
        take = {"top2_sum": 2, "max": 1, "topk_sum": cfg.top_k // cfg.topk_group}[cfg.group_rule]
        group_scores = q.view(T, cfg.n_group, G).topk(take, -1).values.sum(-1)
        keep = torch.zeros(T, cfg.n_group, dtype=torch.bool, device=q.device)
        keep.scatter_(1, group_scores.topk(cfg.topk_group, -1).indices, True)
        q = q.masked_fill(~keep.repeat_interleave(G, 1), float("-inf"))
    ids = q.topk(cfg.top_k, -1).indices
    picked = p.gather(1, ids)
    weights = {"softmax": lambda: torch.softmax(picked, -1), "sigmoid": lambda: torch.sigmoid(picked),
               "normalize": lambda: picked / (picked.sum(-1, keepdim=True) + 1e-20),
               "none": lambda: picked}[cfg.post]() * cfg.scale
    out = torch.zeros_like(x)
    if layer.shared_gate_up is not None:
        out = out + layer.swiglu(x, layer.shared_gate_up, layer.shared_down)
    for e in range(E):
        t, k = (ids == e).nonzero(as_tuple=True)
        if t.numel():
            out = out.index_add(0, t, (weights[t, k, None] * layer.expert(e, x[t])).to(x.dtype))
    counts = torch.bincount(ids.reshape(-1), minlength=E).int()
    return out, logits, ids, counts


def train(args, device: torch.device, dtype: torch.dtype) -> None:
    """Trains the Switchyard layer and its plain PyTorch copy side by side; prints both curves."""
    sizes = (args.preset, args.hidden, args.intermediate, args.tile_size)
    layer = SwitchyardMoE(*sizes, shared_intermediate_size=args.intermediate, dtype=dtype, device=device, seed=0)
    teacher = SwitchyardMoE(*sizes, shared_intermediate_size=args.intermediate, dtype=dtype, device=device, seed=1)
    plain = copy.deepcopy(layer)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.tokens, args.hidden, generator=g).to(dtype=dtype, device=device)
    with torch.no_grad():
        target = teacher(x)
    cfg = layer.config
    runs = []
    for model, forward in ((layer, model_forward), (plain, plain_pytorch_forward)):
        opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=args.lr)
        runs.append((model, forward, opt, []))
    for step in range(args.train_steps):
        for model, forward, opt, losses in runs:
            out, logits, ids, counts = forward(model, x)
            probs = sy.router_probs(logits, cfg)
            loss = F.mse_loss(out.float(), target.float())
            total = loss + 1e-2 * sy.load_balancing_loss(probs, counts, cfg.top_k) + 1e-3 * sy.z_loss(logits)
            opt.zero_grad()
            total.backward()
            opt.step()
            if model.selection_bias is not None:  # DeepSeek-V3's aux-loss-free balancing
                sy.update_expert_bias(model.selection_bias, counts.float(), rate=1e-3)
            losses.append(loss.item())
        a, b = runs[0][3][-1], runs[1][3][-1]
        print(f"step {step:3d}: loss switchyard {a:.6e}  plain PyTorch {b:.6e}  (rel diff {abs(a - b) / b:.1e})")
    first, last = runs[0][3][0], runs[0][3][-1]
    diff = max(abs(a - b) / b for a, b in zip(runs[0][3], runs[1][3]))
    print(f"{args.preset}: loss {first:.4e} -> {last:.4e} in {args.train_steps} steps, went down: {last < first}; "
          f"largest relative difference to plain PyTorch: {diff:.1e}")


def model_forward(layer: SwitchyardMoE, x: torch.Tensor):
    return layer.forward_with_router(x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="deepseek-v3", choices=list(sy.presets))
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=128)
    parser.add_argument("--tile-size", type=int, default=16)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    parser.add_argument("--train-steps", type=int, default=0,
                        help="train this many steps next to a plain PyTorch copy of the layer (0: time the forward)")
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    device = torch.device(args.device)
    if args.train_steps > 0:
        train(args, device, dtype)
        return

    layer = SwitchyardMoE(args.preset, args.hidden, args.intermediate, args.tile_size,
                          shared_intermediate_size=args.intermediate, dtype=dtype, device=device)
    x = torch.randn(args.tokens, args.hidden, generator=torch.Generator().manual_seed(1)).to(dtype=dtype,
                                                                                               device=device)
    with torch.no_grad():
        layer(x)  # warm-up
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = layer(x)
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
    cfg = layer.config
    print(f"{args.preset}: E={cfg.num_experts} K={cfg.top_k} T={args.tokens} H={args.hidden} on {device} "
          f"({args.dtype}, switchyard {sy.__version__}, CUDA backend built: {sy.built_with_cuda()})")
    print(f"output {tuple(out.shape)}, finite: {bool(torch.isfinite(out).all())}, "
          f"mean |out| {out.float().abs().mean():.4f}, layer time {elapsed * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
