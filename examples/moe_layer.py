"""A full Mixture-of-Experts layer on PyTorch with Switchyard doing the token traffic:

    router GEMM (torch) -> switchyard.route_and_layout -> switchyard.gather
    -> per-expert SwiGLU GEMMs (torch, one slice of rows per expert: offsets/counts)
    -> switchyard.combine (weighted sum in fp32, k order; adds onto the shared expert's output)

Run:  python examples/moe_layer.py --preset deepseek-v3 --tokens 256 [--device cuda] [--dtype bf16]

The per-expert loop reads the layout's counts and offsets on the host (one sync per layer); an
engine would hand x_perm, tile_expert and tile_row_end to a grouped GEMM kernel instead, and the
whole layer would stay on the device.
"""

import argparse
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

        def param(*shape, scale):
            return torch.nn.Parameter((torch.randn(*shape, generator=g) * scale).to(dtype=dtype, device=device),
                                      requires_grad=False)

        self.router = param(E, H, scale=H ** -0.5)  # router GEMM weight: logits = x @ router^T
        # Models like DeepSeek-V3 carry a per-expert bias used for expert selection only.
        self.selection_bias = param(E, scale=0.02) if self.config.has_bias else None
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
        logits = F.linear(x, self.router)  # [T, E]
        bias = None if self.selection_bias is None else self.selection_bias.float()
        # Routing and the expert-contiguous layout in one call: ids/weights [T, K] and the Layout.
        _, weights, lay = sy.route_and_layout(logits, self.config, bias, tile_size=self.tile_size)
        x_perm = sy.gather(x, lay)  # [R, H]: each expert's tokens contiguous, in token order

        y_perm = torch.empty_like(x_perm)  # only rows holding a token are read back by combine
        counts, offsets = lay.counts.tolist(), lay.offsets.tolist()
        for e, count in enumerate(counts):
            if count:
                rows = slice(offsets[e], offsets[e] + count)
                y_perm[rows] = self.expert(e, x_perm[rows])

        if self.shared_gate_up is None:
            return sy.combine(y_perm, lay, weights)
        out = self.swiglu(x, self.shared_gate_up, self.shared_down)
        return sy.combine(y_perm, lay, weights, out=out, accumulate=True)  # out += routed experts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="deepseek-v3", choices=list(sy.presets))
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=128)
    parser.add_argument("--tile-size", type=int, default=16)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    args = parser.parse_args()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    device = torch.device(args.device)

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
