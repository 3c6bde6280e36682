"""switchyard-bench --ep: the PyTorch baseline it times computes what the expert-parallel group
computes (checked against CpuGroup on the CPU), the CLI's refusal without a GPU, and on a GPU
the smallest run."""

import json
import os
import subprocess
import sys

import pytest

from sy_testing import cuda_skip_reason, require_torch

torch = require_torch()

import switchyard.ep as ep  # noqa: E402
from switchyard.bench_ep import TorchEp  # noqa: E402

from test_ep import make_inputs  # noqa: E402


@pytest.mark.parametrize("R,L,K", [(1, 4, 2), (3, 4, 3), (4, 2, 3)])
def test_torch_baseline_matches_cpu_group(R, L, K):
    E, H = R * L, 16
    T = [7, 5, 9, 0][:R] if R > 1 else [6]
    xs, ids, ws = make_inputs(R, E, K, T, H, seed=R + 10 * K)
    group = ep.CpuGroup(R, E, K, max(max(T), 1), H, dtype=torch.float32)

    def step(r):
        d = group.dispatch(r, xs[r], ids[r], ws[r])
        return d, group.combine(r, d.handle, d.expert_x)

    results = ep.run_ranks(R, step)
    ref = TorchEp(torch, R, L)
    expert_x = ref.dispatch(xs, ids, ws)
    outs = ref.combine(expert_x, torch.float32)
    for r, (d, out) in enumerate(results):
        assert d.rows == ref.recv[r][0]
        used = int(d.layout.totals[0])  # tile size 1: the expert-major rows, in the same order
        assert torch.equal(d.expert_x[:used], expert_x[r])
        torch.testing.assert_close(out, outs[r], rtol=1e-6, atol=1e-6)  # same sums, another order


def _run_cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "switchyard.bench", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=600)


@pytest.mark.skipif(cuda_skip_reason() is None, reason="a GPU is present: the smallest --ep run is checked instead")
def test_ep_without_gpu_is_refused_with_the_reason(tmp_path):
    r = _run_cli("--ep", "--smoke", "--quiet", cwd=tmp_path)
    assert r.returncode == 2
    assert "--ep" in r.stderr and "GPU" in r.stderr
    assert not os.listdir(tmp_path)


@pytest.mark.skipif(cuda_skip_reason() is not None, reason=f"switchyard-bench --ep: {cuda_skip_reason()}")
def test_ep_smoke_on_gpu(tmp_path):
    path = tmp_path / "ep.json"
    r = _run_cli("--ep", "--smoke", "--quiet", "--ep-ranks", "2", "--ep-shapes", "qwen3-235b-a22b", "--json",
                 str(path), cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads(path.read_text())
    ops = sorted(p["op"] for p in data["points"])
    assert ops == ["ep_combine", "ep_dispatch"]
    assert all(p["check"] == "ok" and p["median_us"] > 0 and p["torch_median_us"] > 0 for p in data["points"])
