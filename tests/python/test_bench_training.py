"""bench/training/bench_training.py runs (its --tiny shapes, on the CPU in CI) and writes its JSON:
every backward op and the training step, with the two layers' gradients in agreement."""

import json
import pathlib
import subprocess
import sys

import pytest

from sy_testing import require_torch

torch = require_torch()

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "bench" / "training" / "bench_training.py"


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no torch._grouped_mm")
def test_tiny_run_writes_every_point(tmp_path):
    out = tmp_path / "bench_training.json"
    run = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--json", str(out)], capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(out.read_text())
    ops = sorted({(p["shape"], p["op"]) for p in result["points"]})
    shapes = ("deepseek-v3", "qwen3-235b-a22b")
    assert ops == sorted((s, o) for s in shapes
                         for o in ("gather_backward", "combine_backward", "route_backward", "training_step"))
    for p in result["points"]:
        assert p["median_us"] > 0 and p["torch_median_us"] > 0
        if p["op"] == "training_step":
            assert p["max_grad_rel_diff"] < 2e-2, p  # the same function: bf16 rounding apart
    assert "| training_step |" in run.stdout
