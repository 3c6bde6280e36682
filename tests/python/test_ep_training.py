"""Gradients through switchyard.ep's dispatch and combine (docs/design.md section 7): x's and the
routing weights' gradients of an expert-parallel MoE step equal those of the same computation
written densely with plain torch autograd. On the CPU the ranks run CpuGroup (threads); on a GPU
GpuGroup (one rank per process, two processes sharing one GPU), checked against the same dense
reference and against CpuGroup. LoopbackGroup refuses the autograd tape (its results are ready only
once every rank has called)."""

import os
import socket

import pytest

from sy_testing import cuda_skip_reason, require_torch

torch = require_torch()

import switchyard.ep as ep  # noqa: E402

from test_ep import make_inputs  # noqa: E402

CUDA_REASON = cuda_skip_reason()
needs_gpu = pytest.mark.skipif(CUDA_REASON is not None, reason=f"GPU expert parallelism: {CUDA_REASON or ''}")


def expert_fn(v, e):
    """Expert e's function of its rows (float math): differs per expert, not linear."""
    return v * (1.0 + 0.25 * e[:, None]) + 0.1 * v * v


def local_experts(offsets, rows, first):
    """Global expert of each expert-major row (from the layout's segment offsets)."""
    return torch.searchsorted(offsets[1:].long(), torch.arange(rows, device=offsets.device), right=True) + first


def rank_forward(group, rank, x, ids, w, expert_major):
    """One rank's MoE step: dispatch, experts, combine; returns the output [T,H]."""
    L = group.experts_per_rank
    d = group.dispatch(rank, x, ids, w, expert_major=expert_major)
    if expert_major:
        e = local_experts(d.layout.offsets, d.expert_x.shape[0], rank * L).clamp(max=rank * L + L - 1)
        y = expert_fn(d.expert_x.float(), e.float()).to(d.expert_x.dtype)
        return group.combine(rank, d.handle, y, out_dtype=torch.float32)
    # Rank-major: the rank reduces its local picks itself, weighting with the received weights.
    xr = d.x.float()
    y = torch.zeros_like(xr)
    for k in range(d.topk_ids.shape[1]):
        local = d.topk_ids[:, k].long()
        mine = (local >= 0)[:, None]
        e = (local.clamp(min=0) + rank * L).float()
        y = y + torch.where(mine, d.topk_weights[:, k:k + 1] * expert_fn(xr, e), torch.zeros_like(xr))
    return group.combine(rank, d.handle, y.to(d.x.dtype), expert_major=False, out_dtype=torch.float32)


def dense_reference(xs, ids, ws, seeds):
    """x and weight gradients of sum_r <G_r, out_r> with out_r[t] = sum_k w[t,k] f_e(x[t])."""
    grads = []
    for r, (x, idx, w) in enumerate(zip(xs, ids, ws)):
        x = x.detach().float().requires_grad_()
        w = w.detach().clone().requires_grad_()
        out = torch.zeros_like(x)
        for k in range(idx.shape[1]):
            e = idx[:, k].long()
            placed = (e >= 0)[:, None]
            f = expert_fn(x, e.clamp(min=0).float())
            out = out + torch.where(placed, w[:, k:k + 1] * f, torch.zeros_like(f))
        (out * seeds[r]).sum().backward()
        grads.append((x.grad, w.grad))
    return grads


def make_case(R, L, K, T, H, seed, dtype, device):
    xs, ids, ws = make_inputs(R, R * L, K, T, H, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    seeds = [torch.randn(t, H, generator=g) for t in T]
    xs = [x.to(dtype) for x in xs]
    return xs, ids, ws, seeds, dense_reference(xs, ids, ws, seeds)


def leaves(xs, ids, ws, device):
    return ([x.to(device).requires_grad_() for x in xs], [i.to(device) for i in ids],
            [w.to(device).requires_grad_() for w in ws])


def check_grads(got, want, dtype):
    """fp32 rows: only summation order differs (1e-5). bf16 rows: the rows, expert outputs and
    output gradients travel as bf16 (2^-8 relative each), so a weight's gradient, a dot product
    over H such terms, is off by up to about 2% of the largest weight gradient."""
    for r, ((gx, gw), (wx, ww)) in enumerate(zip(got, want)):
        for name, g, w in (("dx", gx.float().cpu(), wx.to(gx.dtype).float()), ("d topk_weights", gw.cpu(), ww)):
            if dtype == torch.float32:
                tol = dict(rtol=1e-5, atol=1e-5)
            else:
                tol = dict(rtol=2e-2, atol=2e-2 * max(1.0, float(w.abs().max())))
            torch.testing.assert_close(g, w, **tol, msg=lambda m: f"rank {r} {name}: {m}")


@pytest.mark.parametrize("R,L,K,expert_major", [(1, 4, 2, True), (3, 2, 3, True), (4, 2, 2, False), (2, 3, 4, True)])
def test_cpu_group_gradients_match_dense_autograd(R, L, K, expert_major):
    H = 16
    T = [6, 0, 5, 7][:R] if R > 1 else [6]
    xs, ids, ws, seeds, want = make_case(R, L, K, T, H, seed=10 * R + K, dtype=torch.float32, device="cpu")
    group = ep.CpuGroup(R, R * L, K, max_tokens=max(T), hidden=H, dtype=torch.float32, tile_size=3)
    x, idx, w = leaves(xs, ids, ws, "cpu")

    def step(rank):
        out = rank_forward(group, rank, x[rank], idx[rank], w[rank], expert_major)
        (out * seeds[rank]).sum().backward()
        return x[rank].grad, w[rank].grad

    check_grads(ep.run_ranks(R, step), want, torch.float32)


def test_unused_outputs_and_repeated_backward():
    """Gradients only through the weights (x detached), then a second step on the same group: each
    backward is a collective that every rank makes."""
    R, L, K, H, T = 2, 2, 2, 8, [4, 3]
    xs, ids, ws, seeds, want = make_case(R, L, K, T, H, seed=5, dtype=torch.float32, device="cpu")
    group = ep.CpuGroup(R, R * L, K, max_tokens=4, hidden=H, dtype=torch.float32)

    def step(rank):
        grads = []
        for _ in range(2):
            w = ws[rank].clone().requires_grad_()
            out = rank_forward(group, rank, xs[rank], ids[rank], w, True)
            (out * seeds[rank]).sum().backward()
            grads.append(w.grad)
        return grads

    for r, (g1, g2) in enumerate(ep.run_ranks(R, step)):
        torch.testing.assert_close(g1, want[r][1], rtol=1e-5, atol=1e-5)
        assert torch.equal(g1, g2), f"rank {r}: the second step's gradient differs"


def test_fp8_group_refuses_backward_with_a_clear_error():
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("this torch has no float8_e4m3fn")
    R, L, K, H = 1, 2, 2, 16
    group = ep.CpuGroup(R, R * L, K, max_tokens=3, hidden=H, dtype=torch.float8_e4m3fn)
    x = torch.randn(3, H).to(torch.float8_e4m3fn)
    ids = torch.tensor([[0, 1], [1, -1], [0, 1]], dtype=torch.int32)
    w = torch.rand(3, K, requires_grad=True)
    d = group.dispatch(0, x, ids, w)
    y = d.expert_x.float().requires_grad_()
    out = group.combine(0, d.handle, y, out_dtype=torch.float32)
    with pytest.raises(ValueError, match="cannot carry gradients"):
        out.sum().backward()


@needs_gpu
def test_loopback_refuses_the_autograd_tape():
    group = ep.LoopbackGroup(2, 4, 2, max_tokens=4, hidden=8, dtype=torch.float32)
    x = torch.randn(4, 8, device="cuda", requires_grad=True)
    ids = torch.tensor([[0, 3], [1, 2], [2, -1], [3, 0]], dtype=torch.int32, device="cuda")
    w = torch.rand(4, 2, device="cuda")
    with pytest.raises(ValueError, match="autograd tape"):
        group.dispatch(0, x, ids, w)
    with torch.no_grad():  # without a gradient the group works as always
        group.dispatch(0, x, ids, w)


# (R, L, K, H, T): the GPU case of the two-process test.
GPU_CASE = (2, 3, 4, 256, [37, 64])
GPU_FORMS = [(dtype, em) for dtype in (torch.float32, torch.bfloat16) for em in (True, False)]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gpu_worker(rank, port, out_dir):
    """One rank of a GpuGroup over gloo (both processes on GPU 0): every form's step and backward."""
    import torch.distributed as dist

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    R, L, K, H, T = GPU_CASE
    dist.init_process_group("gloo", rank=rank, world_size=R)
    try:
        torch.cuda.set_device(0)
        results = {}
        for dtype, em in GPU_FORMS:
            xs, ids, ws, seeds, _ = make_case(R, L, K, T, H, seed=77, dtype=dtype, device="cuda")
            group = ep.GpuGroup(None, num_experts=R * L, top_k=K, max_tokens=max(T), hidden=H, dtype=dtype,
                                tile_size=8, timeout_seconds=30.0)
            x, idx, w = leaves([xs[rank]], [ids[rank]], [ws[rank]], "cuda")
            out = rank_forward(group, rank, x[0], idx[0], w[0], em)
            (out * seeds[rank].cuda()).sum().backward()
            group.synchronize()
            results[(str(dtype), em)] = (x[0].grad.cpu(), w[0].grad.cpu())
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@needs_gpu
def test_gpu_group_gradients_match_dense_autograd(tmp_path):
    """GpuGroup, one rank per process (two processes on one GPU, as on a multi-GPU host): x's and
    the weights' gradients against dense autograd, fp32 and bf16 rows, both dispatch forms; in
    fp32 also against CpuGroup's gradients of the same step."""
    import torch.multiprocessing as mp

    R, L, K, H, T = GPU_CASE
    mp.spawn(_gpu_worker, args=(_free_port(), str(tmp_path)), nprocs=R, join=True)
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in range(R)]
    for dtype, em in GPU_FORMS:
        xs, ids, ws, seeds, want = make_case(R, L, K, T, H, seed=77, dtype=dtype, device="cpu")
        grads = [got[r][(str(dtype), em)] for r in range(R)]
        check_grads(grads, want, dtype)
        if dtype == torch.float32:
            cpu = ep.CpuGroup(R, R * L, K, max_tokens=max(T), hidden=H, dtype=dtype, tile_size=8)
            xc, ic, wc = leaves(xs, ids, ws, "cpu")

            def step(rank):
                (rank_forward(cpu, rank, xc[rank], ic[rank], wc[rank], em) * seeds[rank]).sum().backward()
                return xc[rank].grad, wc[rank].grad

            # The transport sums in the same order on both; the expert function's backward and the
            # weights' dot products are torch's, whose CPU and GPU reductions round differently.
            for r, (gx, gw) in enumerate(ep.run_ranks(R, step)):
                torch.testing.assert_close(grads[r][0], gx, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(grads[r][1], gw, rtol=1e-5, atol=1e-5)
