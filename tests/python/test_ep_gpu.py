"""switchyard.ep's GPU groups from Python: LoopbackGroup (R ranks on one GPU, driven from one
thread) and GpuGroup (one rank per process over a torch.distributed process group), each checked
bit for bit against CpuGroup on the same inputs.

Without a GPU and the CUDA backend the GPU tests skip with the reason; what runs everywhere is
the error a build without the CUDA backend gives."""

import os
import socket
import time
from types import SimpleNamespace

import pytest

from sy_testing import cuda_skip_reason, require_torch

torch = require_torch()

import switchyard as sy  # noqa: E402
import switchyard.ep as ep  # noqa: E402
from switchyard import _ext  # noqa: E402

from test_ep import make_inputs  # noqa: E402

CUDA_REASON = cuda_skip_reason()
needs_gpu = pytest.mark.skipif(CUDA_REASON is not None, reason=f"GPU expert parallelism: {CUDA_REASON or ''}")


# ----------------------------------------------------------------------------- everywhere

@pytest.mark.skipif(sy.built_with_cuda(), reason="this build has the CUDA backend (the CPU-only error is checked "
                                                 "on CPU-only builds)")
def test_loopback_without_cuda_backend_names_it():
    with pytest.raises(sy.UnsupportedError, match="no CUDA backend"):
        ep.LoopbackGroup(2, 4, 2, max_tokens=4, hidden=8, dtype=torch.float32)


@pytest.mark.skipif(sy.built_with_cuda(), reason="this build has the CUDA backend (the CPU-only error is checked "
                                                 "on CPU-only builds)")
def test_gpu_group_without_cuda_backend_names_it():
    # Raised before the process group is looked at: no torch.distributed set-up needed.
    with pytest.raises(sy.UnsupportedError, match="no CUDA backend"):
        ep.GpuGroup(None, num_experts=4, top_k=2, max_tokens=4, hidden=8, dtype=torch.float32)


@pytest.mark.skipif(not sy.built_with_cuda() or torch.cuda.is_available(),
                    reason="needs a build with the CUDA backend on a machine without a GPU")
def test_loopback_without_gpu_says_so():
    with pytest.raises(RuntimeError, match="no CUDA device"):
        ep.LoopbackGroup(2, 4, 2, max_tokens=4, hidden=8, dtype=torch.float32)


def test_loopback_bad_config_names_the_field_before_the_backend():
    with pytest.raises(ValueError, match="num_experts"):
        ep.LoopbackGroup(3, 7, 2, max_tokens=4, hidden=8)
    with pytest.raises(TypeError, match="partial_dtype"):  # a dtype message: TypeError, as elsewhere
        ep.LoopbackGroup(2, 4, 2, max_tokens=4, hidden=8, partial_dtype=torch.float16)


def test_cpu_group_takes_partial_dtype():
    # The binding now carries GroupConfig.partial_dtype (the GPU comparisons use it). Rank-major
    # combine of y = 2x: each rank's partial is bf16(2x), summed in fp32 over the ranks a token
    # went to, so out = n * bf16(2x) exactly.
    R, L, K, H = 2, 2, 2, 8
    E, T = R * L, [5, 6]
    xs, ids, ws = make_inputs(R, E, K, T, H, seed=17)
    g = ep.CpuGroup(R, E, K, max(T), H, dtype=torch.float32, partial_dtype=torch.bfloat16)

    def step(r):
        d = g.dispatch(r, xs[r], ids[r], ws[r], expert_major=False)
        return g.combine(r, d.handle, 2 * d.x, expert_major=False)

    outs = ep.run_ranks(R, step)
    for r in range(R):
        went = torch.tensor([len({v // L for v in ids[r][t].tolist() if 0 <= v < E}) for t in range(T[r])],
                            dtype=torch.float32)
        want = (2 * xs[r]).to(torch.bfloat16).float() * went[:, None]
        assert torch.equal(outs[r], want)


def test_size_queries_bound():
    c = ep._group_config(4, 16, 2, 64, 128, torch.bfloat16, 0, 8, 30.0, torch.float32)
    assert _ext.ep_handle_bytes(c) > 0
    assert _ext.ep_region_bytes(c) > _ext.ep_max_recv_rows(c) * 128 * 2  # at least the received rows


# ----------------------------------------------------------------------------- comparisons

def assert_dispatch_equal(cpu, gpu, em):
    """A GPU group's dispatch result equals CpuGroup's: the rank-major rows and counts, and the
    expert-major layout and rows inside their used extent (entries past it are untouched)."""
    t = gpu.trimmed()
    assert t.rows == cpu.rows
    for name in ("src_rank", "src_token", "topk_ids", "topk_weights", "x", "scales"):
        a, b = getattr(cpu, name), getattr(t, name)
        if a is None:
            assert b is None, name
            continue
        assert torch.equal(a.view(torch.uint8) if a.dtype.itemsize == 1 else a,
                           (b.cpu().view(torch.uint8) if b.dtype.itemsize == 1 else b.cpu())), name
    assert (t.sent, t.dropped) == (cpu.sent, cpu.dropped)
    if not em:
        return
    cl, gl = cpu.layout, [a.cpu() for a in gpu.layout]
    gl = type(cl)(*gl)
    for name in ("counts", "offsets", "totals"):
        assert torch.equal(getattr(cl, name), getattr(gl, name)), name
    pt, tiles = int(cl.totals[sy.PADDED_TOTAL]), int(cl.totals[sy.NUM_TILES])
    assert torch.equal(cl.permuted_to_expanded[:pt], gl.permuted_to_expanded[:pt])
    assert torch.equal(cl.permuted_to_token[:pt], gl.permuted_to_token[:pt])
    assert torch.equal(cl.expanded_to_permuted[: cpu.rows], gl.expanded_to_permuted[: cpu.rows])
    assert torch.equal(cl.tile_expert[:tiles], gl.tile_expert[:tiles])
    assert torch.equal(cl.tile_row_end[:tiles], gl.tile_row_end[:tiles])
    raw = (lambda v: v.view(torch.uint8)) if cpu.expert_x.dtype.itemsize == 1 else (lambda v: v)
    assert torch.equal(raw(cpu.expert_x[:pt]), raw(gpu.expert_x[:pt].cpu()))
    if cpu.expert_scales is not None:
        assert torch.equal(cpu.expert_scales[:pt], gpu.expert_scales[:pt].cpu())


def combine_input(d, L, em):
    """The same expert outputs for both groups, made on the CPU from CpuGroup's dispatch: expert
    l scales its rows by (l + 1) (expert-major), or 2 * x per received row (rank-major); fp32."""
    if not em:
        return 2 * d.x.float()
    y = torch.zeros(d.expert_x.shape, dtype=torch.float32)
    offsets = d.layout.offsets.tolist()
    for l in range(L):
        y[offsets[l]:offsets[l + 1]] = d.expert_x[offsets[l]:offsets[l + 1]].float() * (l + 1)
    return y


def run_both(R, L, K, M, dtype, em, *, scale_cols=0, partial_dtype=torch.float32, worst_case=True, seed=0,
             tokens=None):
    E, H = R * L, 32
    T = tokens or [(5 + 3 * r) % 11 for r in range(R)]  # includes a rank with few tokens
    xs, ids, ws = make_inputs(R, E, K, T, H, seed=seed + R * 100 + K, dtype=dtype)
    scales = [torch.rand(t, scale_cols) + 0.5 for t in T] if scale_cols else [None] * R
    kw = dict(dtype=dtype, scale_cols=scale_cols, tile_size=M, partial_dtype=partial_dtype, timeout_seconds=20.0)
    cpu = ep.CpuGroup(R, E, K, max(T), H, **kw)
    gpu = ep.LoopbackGroup(R, E, K, max(T), H, worst_case=worst_case, device="cuda", **kw)
    cd = ep.run_ranks(R, lambda r: cpu.dispatch(r, xs[r], ids[r], ws[r], scales[r], expert_major=em))
    cuda = lambda t: t.cuda() if t is not None else None  # noqa: E731
    gd = [gpu.dispatch(r, cuda(xs[r]), cuda(ids[r]), cuda(ws[r]), cuda(scales[r]), expert_major=em)
          for r in range(R)]
    for r in range(R):
        assert_dispatch_equal(cd[r], gd[r], em)
    ys = [combine_input(cd[r], L, em) for r in range(R)]
    co = ep.run_ranks(R, lambda r: cpu.combine(r, cd[r].handle, ys[r], expert_major=em))
    go = [gpu.combine(r, gd[r].handle, ys[r].cuda(), expert_major=em) for r in range(R)]
    for r in range(R):
        assert torch.equal(co[r], go[r].cpu()), f"combine, rank {r}"
    gpu.synchronize()  # raises a device-reported error, if any
    return cpu, gpu, cd, gd


# ----------------------------------------------------------------------------- loopback

@needs_gpu
@pytest.mark.parametrize("em", [True, False], ids=["expert_major", "rank_major"])
@pytest.mark.parametrize("R", [1, 2, 3, 5, 8])
def test_loopback_matches_cpu_group(R, em):
    run_both(R, L=2, K=min(3, 2 * R), M=4, dtype=torch.float32, em=em)


@needs_gpu
@pytest.mark.parametrize("em", [True, False], ids=["expert_major", "rank_major"])
def test_loopback_bf16_partials_and_exact_mode(em):
    run_both(3, L=3, K=2, M=8, dtype=torch.bfloat16, em=em, partial_dtype=torch.bfloat16, worst_case=False)


@needs_gpu
@pytest.mark.skipif(not hasattr(torch, "float8_e4m3fn"), reason="this PyTorch has no float8_e4m3fn")
def test_loopback_fp8_with_scales():
    run_both(2, L=2, K=2, M=4, dtype=torch.float8_e4m3fn, em=True, scale_cols=1)


@needs_gpu
def test_loopback_reuse_gives_the_same_rows():
    R, L, K, H = 3, 2, 2, 32
    E, T = R * L, [4, 6, 5]
    xs, ids, ws = make_inputs(R, E, K, T, H, seed=11)
    g = ep.LoopbackGroup(R, E, K, max(T), H, dtype=torch.float32, timeout_seconds=20.0, device="cuda")
    first = [g.dispatch(r, xs[r].cuda(), ids[r].cuda(), ws[r].cuda(), expert_major=False) for r in range(R)]
    again = [g.dispatch(r, xs[r].cuda(), ids[r].cuda(), (ws[r] * 0.5).cuda(), expert_major=False,
                        handle=first[r].handle, reuse=True) for r in range(R)]
    for a, b in zip(first, again):
        ta, tb = a.trimmed(), b.trimmed()
        assert torch.equal(ta.x.cpu(), tb.x.cpu()) and torch.equal(ta.src_token.cpu(), tb.src_token.cpu())
        assert torch.equal(tb.topk_weights.cpu(), ta.topk_weights.cpu() * 0.5)
    g.synchronize()


@needs_gpu
def test_loopback_out_of_turn_call_is_refused_before_enqueueing():
    R, E, K, H = 2, 4, 1, 8
    xs, ids, ws = make_inputs(R, E, K, [2, 2], H, seed=5)
    g = ep.LoopbackGroup(R, E, K, 2, H, dtype=torch.float32, timeout_seconds=20.0, device="cuda")
    d0 = g.dispatch(0, xs[0].cuda(), ids[0].cuda(), ws[0].cuda())
    with pytest.raises(RuntimeError, match=r"ranks \[1\]"):
        d0.rows  # noqa: B018 - not ready before rank 1 dispatches
    with pytest.raises(ValueError, match="already made"):
        g.dispatch(0, xs[0].cuda(), ids[0].cuda(), ws[0].cuda())
    with pytest.raises(ValueError, match=r"ranks \[1\] have not made their dispatch"):
        g.combine(0, d0.handle, d0.expert_x.float())
    g.dispatch(1, xs[1].cuda(), ids[1].cuda(), ws[1].cuda())
    g.synchronize()


@needs_gpu
def test_loopback_missing_rank_times_out():
    R, E, K, H, timeout = 2, 4, 1, 8, 1.0
    xs, ids, ws = make_inputs(R, E, K, [2, 2], H, seed=5)
    g = ep.LoopbackGroup(R, E, K, 2, H, dtype=torch.float32, timeout_seconds=timeout, device="cuda")
    start = time.monotonic()
    g.dispatch(0, xs[0].cuda(), ids[0].cuda(), ws[0].cuda())  # rank 1 never comes
    with pytest.raises(TimeoutError, match="rank 1"):
        while time.monotonic() - start < timeout + 10.0:
            g.check()
            time.sleep(0.02)
        pytest.fail(f"no timeout reported within {timeout} + 10 s")
    assert time.monotonic() - start < timeout + 10.0
    assert "rank 1" in g.broken_reason
    with pytest.raises(TimeoutError):  # the group refuses further calls
        g.dispatch(1, xs[1].cuda(), ids[1].cuda(), ws[1].cuda())


@needs_gpu
def test_loopback_bad_argument_fails_every_rank():
    R, E, K, H = 3, 6, 2, 8
    xs, ids, ws = make_inputs(R, E, K, [4, 4, 4], H, seed=3)
    xs[1] = xs[1][:, :-1]  # wrong hidden size on rank 1
    g = ep.LoopbackGroup(R, E, K, 4, H, dtype=torch.float32, timeout_seconds=20.0, device="cuda")
    errors = []
    for r in range(R):
        try:
            g.dispatch(r, xs[r].cuda(), ids[r].cuda(), ws[r].cuda())
        except ValueError as e:
            errors.append((r, str(e)))
    assert [r for r, _ in errors] == [1, 2], errors  # rank 0 returned before rank 1 called
    assert all("rank 1" in e and "in.x" in e for _, e in errors), errors
    start = time.monotonic()
    with pytest.raises(ValueError, match="rank 1"):
        g.synchronize()
    assert time.monotonic() - start < 10.0  # the peers stopped without waiting for the timeout


# ----------------------------------------------------------------------------- two processes

def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_process_worker(rank, world, port, case, out_dir):
    import torch.distributed as dist

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        R, L, K, M, H, T, em = case
        xs, ids, ws = make_inputs(R, R * L, K, T, H, seed=21)
        torch.cuda.set_device(0)  # both processes on the same GPU
        g = ep.GpuGroup(None, num_experts=R * L, top_k=K, max_tokens=max(T), hidden=H, dtype=torch.float32,
                        tile_size=M, timeout_seconds=20.0)
        d = g.dispatch(rank, xs[rank].cuda(), ids[rank].cuda(), ws[rank].cuda(), expert_major=em)
        t = d.trimmed()
        lay = type(t.layout)(*[a.cpu() for a in t.layout]) if em else None
        view = SimpleNamespace(x=t.x.cpu(), layout=lay, expert_x=t.expert_x.cpu() if em else None)
        out = g.combine(rank, d.handle, combine_input(view, L, em).cuda(), expert_major=em)
        g.synchronize()
        torch.save({"rows": t.rows, "x": t.x.cpu(), "src_rank": t.src_rank.cpu(), "src_token": t.src_token.cpu(),
                    "out": out.cpu()}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@needs_gpu
def test_two_processes_over_gloo_match_cpu_group(tmp_path):
    import torch.multiprocessing as mp

    R, L, K, M, H, T, em = 2, 2, 2, 4, 32, [5, 7], True
    case = (R, L, K, M, H, T, em)
    mp.spawn(_two_process_worker, args=(R, _free_port(), case, str(tmp_path)), nprocs=R, join=True)
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in range(R)]
    xs, ids, ws = make_inputs(R, R * L, K, T, H, seed=21)
    cpu = ep.CpuGroup(R, R * L, K, max(T), H, dtype=torch.float32, tile_size=M)
    cd = ep.run_ranks(R, lambda r: cpu.dispatch(r, xs[r], ids[r], ws[r], expert_major=em))
    co = ep.run_ranks(R, lambda r: cpu.combine(r, cd[r].handle, combine_input(cd[r], L, em), expert_major=em))
    for r in range(R):
        assert got[r]["rows"] == cd[r].rows
        assert torch.equal(got[r]["x"], cd[r].x)
        assert torch.equal(got[r]["src_rank"], cd[r].src_rank)
        assert torch.equal(got[r]["src_token"], cd[r].src_token)
        assert torch.equal(got[r]["out"], co[r]), f"combine, rank {r}"


def _bad_config_worker(rank, world, port, out_dir):
    import torch.distributed as dist

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        # Rank 1 asks for 5 experts (not a multiple of the 2 ranks); rank 0 for a valid group.
        ep.GpuGroup(None, num_experts=4 if rank == 0 else 5, top_k=2, max_tokens=4, hidden=8, dtype=torch.float32,
                    timeout_seconds=20.0)
        message = "created"
    except Exception as e:  # noqa: BLE001 - recorded for the test
        message = f"{type(e).__name__}: {e}"
    with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
        f.write(message)
    # Both ranks leave together: gloo aborts a process whose peer tore the group down first.
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.skipif(not sy.built_with_cuda(), reason="GpuGroup needs a build with the CUDA backend")
def test_gpu_group_bad_config_on_one_rank_fails_every_rank(tmp_path):
    """A rank whose arguments are bad fails at creation and its peers fail too, naming it, instead
    of waiting in the handle exchange (on a machine without a GPU every rank fails on its own
    device check, through the same verdict exchange)."""
    import torch.multiprocessing as mp

    start = time.monotonic()
    # The verdicts are read from the files the ranks write, with a bound on the wait. (A reference
    # cycle through the raised error once kept the process group alive past its destruction, and
    # about one run in ten a rank then aborted at interpreter exit; GpuGroup breaks that cycle.)
    ctx = mp.start_processes(_bad_config_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=False,
                             start_method="spawn")
    for p in ctx.processes:
        p.join(60.0)
    assert all(not p.is_alive() for p in ctx.processes), "a rank did not finish within 60 s"
    assert time.monotonic() - start < 60.0
    got = [(tmp_path / f"rank{r}.txt").read_text() for r in range(2)]
    assert got[1].startswith("ValueError") and "num_experts" in got[1], got
    if CUDA_REASON is None:
        assert got[0].startswith("ValueError") and "rank 1" in got[0] and "num_experts" in got[0], got
    else:
        assert got[0].startswith("RuntimeError") and "CUDA" in got[0], got
