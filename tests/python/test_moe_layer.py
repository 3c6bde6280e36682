"""examples/moe_layer.py against a naive PyTorch MoE layer (routing from the plain reference,
then every token through each of its experts, one at a time) for the DeepSeek-V3, Qwen3 and
Mixtral presets with small hidden sizes."""

import importlib.util
import pathlib
import subprocess
import sys

import pytest

from sy_testing import call_or_skip_unsupported, devices, require_torch

torch = require_torch()

import sy_reference as ref  # noqa: E402

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "moe_layer.py"


def load_example():
    spec = importlib.util.spec_from_file_location("moe_layer_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def naive_moe(layer, x):
    """(out [T,H] float64, rows to compare): plain loops, float64."""
    cfg = layer.config
    xd = x.double().cpu()
    logits = torch.nn.functional.linear(x, layer.router).cpu()  # the same router GEMM as the layer
    bias = None if layer.selection_bias is None else layer.selection_bias.float().cpu()
    ids, weights, margin = ref.route(logits, cfg, bias)
    safe = ref.safe_rows(margin)  # rows whose routing fp32 rounding cannot flip
    assert int(safe.sum()) >= 0.8 * x.shape[0], "too many near ties in the test data; change the seed"

    def swiglu(v, gate_up, down):
        gate, up = (gate_up.double().cpu() @ v).chunk(2)
        return down.double().cpu() @ (torch.nn.functional.silu(gate) * up)

    out = torch.zeros(xd.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        if layer.shared_gate_up is not None:
            out[t] += swiglu(xd[t], layer.shared_gate_up, layer.shared_down)
        for k in range(cfg.top_k):
            e = int(ids[t, k])
            out[t] += weights[t, k] * swiglu(xd[t], layer.gate_up[e], layer.down[e])
    return out, safe


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("shared", [False, True], ids=["routed", "with_shared_expert"])
@pytest.mark.parametrize("preset,tokens,tile_size", [("deepseek-v3", 48, 16), ("qwen3-235b-a22b", 40, 8),
                                                     ("mixtral-8x7b", 33, 4)])
def test_example_moe_layer_matches_naive(preset, tokens, tile_size, shared, device):
    example = load_example()
    hidden, intermediate = 64, 32
    layer = example.SwitchyardMoE(preset, hidden, intermediate, tile_size,
                                  shared_intermediate_size=48 if shared else None, device=torch.device(device),
                                  seed=tokens)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(tokens + 1)).to(device)
    with torch.no_grad():
        got = call_or_skip_unsupported(layer, x)
        want, safe = naive_moe(layer, x)
    assert got.shape == (tokens, hidden) and got.dtype == torch.float32
    torch.testing.assert_close(got.double().cpu()[safe], want[safe], rtol=1e-4, atol=1e-4)


def test_example_runs_as_a_script():
    result = subprocess.run([sys.executable, str(EXAMPLE), "--preset", "mixtral-8x7b", "--tokens", "16", "--hidden",
                             "32", "--intermediate", "16", "--device", "cpu"], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert "finite: True" in result.stdout
