"""Hugging Face transformers' MoE layers with the "switchyard" experts implementation (and patched
routers) against transformers' own "grouped_mm", on one GPU.

    python bench/transformers/bench_transformers.py --json bench/results/bench_transformers.json
    python bench/transformers/bench_transformers.py --tiny     # small shapes (CPU or GPU), a check only

For each layer shape (Qwen3-30B-A3B: H 2048, 128 experts, top 8, expert width 768; DeepSeek-V3:
H 7168, 256 experts, top 8, expert width 2048, one shared expert, grouped sigmoid routing) a
2-layer model with random weights is built from its config (small vocabulary and attention;
DeepSeek-V3's first layer dense), and timed eagerly, as transformers runs:
- block: the MoE block's forward (router + experts + shared expert) on [1, T, H], T = 16, 512,
  4096;
- prefill: the model's forward of [1, T] tokens; decode: the forward of 16 sequences of one
  token (no cache), the shape of a decode step's MoE layers.
Timing: CUDA events around `--calls` back-to-back calls, median of `--repeats` (per call). The
share outside the GEMMs: one profiled call per point, 1 - (GPU time of GEMM kernels / the
call's median time); the rest is token traffic (sort, gather, sum), the router, elementwise
work and host overhead between launches.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import re
import statistics
import subprocess
import sys
from typing import Any, Callable, Dict, List

import torch
import transformers

import switchyard as sy
import switchyard.integrations.transformers as sy_hf

GEMM_KERNEL = re.compile(r"gemm|cutlass|xmma|nvjet|grouped_mm|cublas", re.IGNORECASE)


def qwen3_30b_a3b(tiny: bool) -> Any:
    h, e, i = (64, 16, 32) if tiny else (2048, 128, 768)
    return transformers.Qwen3MoeConfig(vocab_size=1024, hidden_size=h, num_hidden_layers=2, num_attention_heads=8,
                                       num_key_value_heads=4, head_dim=h // 8, intermediate_size=4 * h,
                                       moe_intermediate_size=i, num_experts=e, num_experts_per_tok=8,
                                       norm_topk_prob=True, max_position_embeddings=8192)


def deepseek_v3(tiny: bool) -> Any:
    h, e, i = (64, 32, 32) if tiny else (7168, 256, 2048)
    return transformers.DeepseekV3Config(vocab_size=1024, hidden_size=h, num_hidden_layers=2, num_attention_heads=8,
                                         num_key_value_heads=8, intermediate_size=4 * h, moe_intermediate_size=i,
                                         n_routed_experts=e, num_experts_per_tok=8, n_group=8, topk_group=4,
                                         n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
                                         norm_topk_prob=True, kv_lora_rank=64, q_lora_rank=96, qk_rope_head_dim=16,
                                         qk_nope_head_dim=32, v_head_dim=32, max_position_embeddings=8192)


SHAPES = {"qwen3-30b-a3b": qwen3_30b_a3b, "deepseek-v3": deepseek_v3}
IMPLS = {"grouped_mm": ("grouped_mm", False), "switchyard": ("switchyard", True)}  # experts, patched routers


def build(shape: str, tiny: bool, device: str) -> Any:
    config = SHAPES[shape](tiny)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16,
                                                              attn_implementation="sdpa").eval()
    with torch.no_grad():  # weights large enough that routing is decisive and outputs are O(1)
        for name, p in model.named_parameters():
            if ".mlp." in name:
                p.normal_(0.0, 0.02)
    return model


def use(model: Any, impl: str) -> None:
    experts, patched = IMPLS[impl]
    model.set_experts_implementation(experts)
    sy_hf.unpatch_routers(model)
    if patched:
        sy_hf.patch_routers(model)


def time_calls(fn: Callable[[], Any], calls: int, repeats: int, device: str) -> float:
    """Median per-call time in us."""
    for _ in range(3):
        fn()
    samples = []
    for _ in range(repeats):
        if device == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(calls):
                fn()
            b.record()
            b.synchronize()
            samples.append(1000.0 * a.elapsed_time(b) / calls)
        else:
            import time
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            samples.append(1e6 * (time.perf_counter() - t0) / calls)
    return statistics.median(samples)


def gemm_us(fn: Callable[[], Any]) -> float:
    """GPU time of GEMM kernels in one call, from the profiler."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    total = 0.0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and GEMM_KERNEL.search(e.name or ""):
            total += e.device_time
    return total


def moe_block(model: Any) -> Any:
    return model.model.layers[-1].mlp


def run(args: argparse.Namespace) -> Dict[str, Any]:
    device = "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"
    sy_hf.register()
    points: List[Dict[str, Any]] = []

    def header() -> Dict[str, Any]:
        props = torch.cuda.get_device_properties(0) if device == "cuda" else None
        return {
            "benchmark": "bench_transformers",
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": props.name if props else platform.processor(),
            "commit": _commit(),
            "versions": {"switchyard": sy.__version__, "torch": torch.__version__,
                         "transformers": transformers.__version__, "cuda": torch.version.cuda},
            "method": __doc__.strip(),
            "settings": {"shapes": args.shapes, "tokens": args.tokens, "calls": args.calls, "repeats": args.repeats,
                         "tiny": args.tiny},
        }

    for shape in args.shapes:
        model = build(shape, args.tiny, device)
        block = moe_block(model)
        H = model.config.hidden_size
        cases = [("block", T) for T in args.tokens] + [("prefill", T) for T in args.tokens if T >= 512] + \
                [("decode", 16)]
        for what, T in cases:
            g = torch.Generator(device=device).manual_seed(T)
            if what == "block":
                x = torch.randn(1, T, H, generator=g, device=device, dtype=torch.bfloat16)
                fn = lambda: block(x)  # noqa: E731
            else:
                shape_ids = (1, T) if what == "prefill" else (16, 1)
                ids = torch.randint(3, 1024, shape_ids, generator=g, device=device)
                fn = lambda: model(ids).logits  # noqa: E731
            row: Dict[str, Any] = {"shape": shape, "what": what, "tokens": T if what != "decode" else 16}
            outs = {}
            with torch.no_grad():
                for impl in IMPLS:
                    use(model, impl)
                    outs[impl] = fn()
                    row[f"{impl}_us"] = time_calls(fn, args.calls, args.repeats, device)
                    if device == "cuda":
                        row[f"{impl}_gemm_us"] = gemm_us(fn)
                        row[f"{impl}_outside_gemm_share"] = max(0.0, 1.0 - row[f"{impl}_gemm_us"] /
                                                                row[f"{impl}_us"])
            a, b = outs["switchyard"].float(), outs["grouped_mm"].float()
            row["max_abs_diff"] = float((a - b).abs().max())
            row["max_abs"] = float(b.abs().max())
            row["speedup"] = row["grouped_mm_us"] / row["switchyard_us"]
            if device == "cuda":
                ours_out = row["switchyard_us"] - row["switchyard_gemm_us"]
                theirs_out = row["grouped_mm_us"] - row["grouped_mm_gemm_us"]
                row["outside_gemm_speedup"] = theirs_out / ours_out if ours_out > 0 else None
            points.append(row)
            print(_line(row), flush=True)
            if args.json:  # after every point: a run cut short keeps what it measured
                with open(args.json, "w") as f:
                    json.dump(dict(header(), points=points, complete=False), f, indent=1)
        del model, block
        if device == "cuda":
            torch.cuda.empty_cache()
    return dict(header(), points=points, complete=True)


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _line(r: Dict[str, Any]) -> str:
    share = (f", outside GEMMs {100 * r['grouped_mm_outside_gemm_share']:.0f}% -> "
             f"{100 * r['switchyard_outside_gemm_share']:.0f}%" if "switchyard_gemm_us" in r else "")
    return (f"{r['shape']} {r['what']} T={r['tokens']}: grouped_mm {r['grouped_mm_us']:.1f} us, switchyard "
            f"{r['switchyard_us']:.1f} us ({r['speedup']:.2f}x){share}; max |diff| {r['max_abs_diff']:.3g} of "
            f"{r['max_abs']:.3g}")


def markdown(result: Dict[str, Any]) -> str:
    lines = ["| shape | what | T | grouped_mm us | switchyard us | speedup | outside GEMMs (grouped_mm -> switchyard) | "
             "outside-GEMM speedup |", "|" + "---|" * 8]
    for r in result["points"]:
        share = (f"{100 * r['grouped_mm_outside_gemm_share']:.0f}% -> {100 * r['switchyard_outside_gemm_share']:.0f}%"
                 if "switchyard_gemm_us" in r else "-")
        osp = f"{r['outside_gemm_speedup']:.1f}x" if r.get("outside_gemm_speedup") else "-"
        lines.append(f"| {r['shape']} | {r['what']} | {r['tokens']} | {r['grouped_mm_us']:.1f} | "
                     f"{r['switchyard_us']:.1f} | {r['speedup']:.2f}x | {share} | {osp} |")
    return "\n".join(lines)


def main(argv: List[str] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(SHAPES), type=lambda s: s.split(","))
    ap.add_argument("--tokens", default="16,512,4096", type=lambda s: [int(v) for v in s.split(",")])
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--tiny", action="store_true", help="small shapes: a quick check of the script")
    ap.add_argument("--cpu", action="store_true", help="run on the CPU even if a GPU is present")
    ap.add_argument("--json", default="", help="write the results here")
    args = ap.parse_args(argv)
    for s in args.shapes:
        if s not in SHAPES:
            ap.error(f"unknown shape {s!r}; expected one of {', '.join(SHAPES)}")
    result = run(args)
    print()
    print(markdown(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"JSON written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
