"""examples/ep_moe_layer.py: the expert-parallel DeepSeek-V3-shaped MoE layer against its dense
reference, run in-process on the CPU reference group (ranks as threads) and, where the CUDA
backend and a GPU are present, on the one-GPU loopback group."""

import importlib.util
import pathlib

import pytest

from sy_testing import cuda_skip_reason, require_torch

torch = require_torch()

import switchyard as sy  # noqa: E402

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "ep_moe_layer.py"
SMALL = ["--tokens", "9", "--hidden", "32", "--experts", "12", "--top-k", "3", "--intermediate", "16",
         "--tile-size", "4", "--steps", "1"]

CUDA_REASON = cuda_skip_reason()


def load_example():
    spec = importlib.util.spec_from_file_location("ep_moe_layer_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def pass_lines(out: str, ranks: int) -> None:
    lines = [line for line in out.splitlines() if line.startswith("rank ")]
    assert len(lines) == ranks, out
    assert all(line.endswith(" PASS") for line in lines), out


@pytest.mark.parametrize("ranks", [2, 3])
def test_cpu_group_matches_dense_reference(ranks, capsys):
    example = load_example()
    assert example.main(["--cpu", str(ranks), "--dtype", "fp32"] + SMALL) == 0
    pass_lines(capsys.readouterr().out, ranks)


def test_cpu_group_bf16_and_several_steps(capsys):
    example = load_example()
    assert example.main(["--cpu", "2", "--dtype", "bf16"] + SMALL + ["--steps", "2"]) == 0
    out = capsys.readouterr().out
    pass_lines(out, 2)
    assert "step 1:" in out


def test_wrong_expert_output_fails(capsys, monkeypatch):
    # The check is not vacuous: experts off by 1% make every rank FAIL and main return 1.
    example = load_example()
    right = example.grouped_swiglu
    monkeypatch.setattr(example, "grouped_swiglu", lambda *a, **kw: right(*a, **kw) * 1.01)
    assert example.main(["--cpu", "2", "--dtype", "fp32"] + SMALL) == 1
    assert capsys.readouterr().out.count(" FAIL") == 2


def test_grouped_mm_and_loop_agree_on_padded_layout():
    # The grouped_mm path (offs = layout.offsets[1:]) against the per-expert loop, on the rows
    # that hold tokens of a tile-padded layout.
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no torch._grouped_mm")
    example = load_example()
    T, E, K, H, I, M = 11, 6, 2, 16, 8, 4
    g = torch.Generator().manual_seed(5)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32)
    lay = sy.layout(ids, E, tile_size=M)
    x = sy.gather(torch.randn(T, H, generator=g), lay)
    gate_up, down = torch.randn(E, 2 * I, H, generator=g), torch.randn(E, H, I, generator=g)
    try:
        grouped = example.grouped_swiglu(x, lay.counts, lay.offsets, gate_up, down, use_grouped_mm=True)
    except RuntimeError as e:  # older torch: no CPU / fp32 kernel
        pytest.skip(f"torch._grouped_mm does not run on CPU fp32 here: {e}")
    loop = example.grouped_swiglu(x, lay.counts, lay.offsets, gate_up, down, use_grouped_mm=False)
    rows = lay.permuted_to_token < T
    torch.testing.assert_close(grouped[rows], loop[rows], rtol=1e-5, atol=1e-5)


def test_routing_config_fits_small_expert_counts():
    example = load_example()
    assert example.routing_config(256, 8) is sy.presets["deepseek-v3"]
    cfg = example.routing_config(12, 3)
    assert 12 % cfg.n_group == 0 and cfg.topk_group * (12 // cfg.n_group) >= 3


def test_needs_a_mode(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)  # not under torchrun
    example = load_example()
    with pytest.raises(SystemExit) as e:
        example.main(["--tokens", "4"])
    assert e.value.code == 2


@pytest.mark.skipif(CUDA_REASON is not None, reason=f"GPU expert parallelism: {CUDA_REASON or ''}")
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_loopback_matches_dense_reference(dtype, capsys):
    example = load_example()
    args = ["--loopback", "4", "--dtype", dtype, "--tokens", "40", "--hidden", "64", "--experts", "16", "--top-k",
            "4", "--intermediate", "32", "--tile-size", "16", "--steps", "2"]
    assert example.main(args) == 0
    pass_lines(capsys.readouterr().out, 4)
