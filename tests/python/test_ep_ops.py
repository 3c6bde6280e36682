"""switchyard.ep's groups as torch custom ops (switchyard::ep_dispatch, switchyard::ep_combine):
opcheck, torch.compile(fullgraph=True) and, on a GPU, CUDA graph capture, each against the
eager result. On the CPU the ops run CpuGroup; the GPU tests run LoopbackGroup."""

import pytest

from sy_testing import cuda_skip_reason, require_torch

torch = require_torch()

import switchyard.ep as ep  # noqa: E402

from test_ep import make_inputs  # noqa: E402

CUDA_REASON = cuda_skip_reason()
needs_gpu = pytest.mark.skipif(CUDA_REASON is not None, reason=f"GPU expert parallelism: {CUDA_REASON or ''}")


def full_inputs(T, E, H, seed, device="cpu"):
    """One rank whose every token picks every expert (K = E, tile size 1): every row of every
    output capacity is written, so outputs compare whole (opcheck compares them whole)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(device)
    ids = torch.stack([torch.randperm(E, generator=g) for _ in range(T)]).to(torch.int32).to(device)
    w = torch.rand(T, E, generator=g).to(device)
    return x, ids, w


def opcheck_both(group, x, ids, w):
    d = group._dispatch_call(0, x, ids, w, None, True, None, False)
    # Dispatch: every opcheck test but the eager-against-traced output comparison, which cannot
    # hold for the handle output (each dispatch's handle is new: a new key on CpuGroup, new
    # memory on a GPU group); the compile tests below compare every other output instead.
    torch.library.opcheck(torch.ops.switchyard.ep_dispatch.default,
                          (group._state, group.group_id, 0, x, ids, w, None, True, None),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    y = torch.randn(d.expert_x.shape, generator=torch.Generator().manual_seed(3)).to(x.device)
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    torch.library.opcheck(torch.ops.switchyard.ep_combine.default,
                          (group._state, group.group_id, 0, d.handle.memory, x.shape[0], True, y, True, out, False,
                           True, None, out.new_empty(0)))
    # The training form: unweighted, with pick values sent back.
    K = ids.shape[1]
    values = torch.randn(group.max_recv_rows, K, generator=torch.Generator().manual_seed(4)).to(x.device)
    torch.library.opcheck(torch.ops.switchyard.ep_combine.default,
                          (group._state, group.group_id, 0, d.handle.memory, x.shape[0], True, y, True, out, False,
                           False, values, out.new_empty(x.shape[0], K)))


def test_opcheck_on_cpu_group():
    T, E, H = 6, 4, 16
    group = ep.CpuGroup(1, E, E, max_tokens=T, hidden=H, dtype=torch.float32)
    opcheck_both(group, *full_inputs(T, E, H, seed=1))


def layer_step(group, x, ids, w, expert_scale):
    """A one-rank MoE step through the group's methods: dispatch, "experts" (row scaling), combine
    added to a residual; what torch.compile must trace without a break."""
    d = group.dispatch(0, x, ids, w, trim=False) if isinstance(group, ep.CpuGroup) else group.dispatch(0, x, ids, w)
    y = d.expert_x.float() * expert_scale
    return group.combine(0, d.handle, y, out=x.float().clone(), accumulate=True), d.stats


def test_compile_fullgraph_on_cpu_group_matches_eager():
    T, E, K, H = 7, 6, 2, 8
    xs, ids, ws = make_inputs(1, E, K, [T], H, seed=4)
    group = ep.CpuGroup(1, E, K, max_tokens=T, hidden=H, dtype=torch.float32, tile_size=2)
    want, want_stats = layer_step(group, xs[0], ids[0], ws[0], 3.0)
    compiled = torch.compile(layer_step, fullgraph=True, backend="aot_eager")
    got, stats = compiled(group, xs[0], ids[0], ws[0], 3.0)
    assert torch.equal(got, want) and torch.equal(stats, want_stats)
    # A second routing through the same graph.
    xs2, ids2, ws2 = make_inputs(1, E, K, [T], H, seed=5)
    got2, _ = compiled(group, xs2[0], ids2[0], ws2[0], 3.0)
    assert torch.equal(got2, layer_step(group, xs2[0], ids2[0], ws2[0], 3.0)[0])


def test_handle_of_another_group_is_refused():
    T, E, H = 3, 2, 8
    a = ep.CpuGroup(1, E, E, max_tokens=T, hidden=H, dtype=torch.float32)
    b = ep.CpuGroup(1, E, E, max_tokens=T, hidden=H, dtype=torch.float32)
    x, ids, w = full_inputs(T, E, H, seed=2)
    d = a.dispatch(0, x, ids, w)
    b.dispatch(0, x, ids, w)
    with pytest.raises(ValueError, match="handle"):
        b.combine(0, ep.Handle(d.handle.memory + 1000, T, True), d.expert_x)
    with pytest.raises(TypeError, match="'handle'"):
        a.combine(0, "not a handle", d.expert_x)
    with pytest.raises(TypeError, match="'y'"):
        a.combine(0, d.handle, None)
    with pytest.raises(TypeError, match="'x'"):
        a.dispatch(0, x.tolist(), ids, w)


# ----------------------------------------------------------------------------- GPU


@needs_gpu
def test_opcheck_on_loopback_group():
    T, E, H = 6, 4, 16
    group = ep.LoopbackGroup(1, E, E, max_tokens=T, hidden=H, dtype=torch.float32, timeout_seconds=20.0,
                             device="cuda")
    opcheck_both(group, *full_inputs(T, E, H, seed=1, device="cuda"))
    group.synchronize()


def loopback_round(group, xs, ids, ws, scale):
    """Every rank's dispatch, then every rank's combine; the per-rank outputs."""
    R = group.num_ranks
    ds = [group.dispatch(r, xs[r], ids[r], ws[r]) for r in range(R)]
    return [group.combine(r, ds[r].handle, ds[r].expert_x.float() * scale) for r in range(R)]


@needs_gpu
def test_loopback_round_compiles_fullgraph():
    R, L, K, H = 3, 2, 2, 32
    T = [5, 8, 6]
    xs, ids, ws = make_inputs(R, R * L, K, T, H, seed=8)
    xs, ids, ws = ([t.cuda() for t in v] for v in (xs, ids, ws))
    group = ep.LoopbackGroup(R, R * L, K, max(T), H, dtype=torch.float32, tile_size=4, timeout_seconds=20.0,
                             device="cuda")
    want = loopback_round(group, xs, ids, ws, 2.0)
    # aot_eager keeps the program's order; see LoopbackGroup's docstring on Inductor.
    compiled = torch.compile(loopback_round, fullgraph=True, backend="aot_eager")
    for _ in range(2):
        got = compiled(group, xs, ids, ws, 2.0)
        for r in range(R):
            assert torch.equal(got[r], want[r]), f"rank {r}"
    group.synchronize()


@needs_gpu
def test_loopback_round_in_a_cuda_graph():
    R, L, K, H = 2, 3, 3, 64
    T = [9, 4]
    xs, ids, ws = make_inputs(R, R * L, K, T, H, seed=9)
    xs, ids, ws = ([t.cuda() for t in v] for v in (xs, ids, ws))
    group = ep.LoopbackGroup(R, R * L, K, max(T), H, dtype=torch.float32, timeout_seconds=20.0, device="cuda")
    want = [o.clone() for o in loopback_round(group, xs, ids, ws, 1.5)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture, as torch.cuda.graphs asks
        loopback_round(group, xs, ids, ws, 1.5)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = loopback_round(group, xs, ids, ws, 1.5)
    for replay in range(3):
        for o in outs:
            o.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for r in range(R):
            assert torch.equal(outs[r], want[r]), f"replay {replay}, rank {r}"
    # New inputs copied into the captured ones: the replay routes them.
    xs2, ids2, ws2 = make_inputs(R, R * L, K, T, H, seed=10)
    for dst, src in zip(xs + ids + ws, xs2 + ids2 + ws2):
        dst.copy_(src)
    want2 = [o.clone() for o in loopback_round(group, xs, ids, ws, 1.5)]
    graph.replay()
    torch.cuda.synchronize()
    for r in range(R):
        assert torch.equal(outs[r], want2[r]), f"new inputs, rank {r}"
    group.synchronize()
