"""The torch custom ops: torch.library.opcheck (schema, mutations, fake tensors, AOT dispatch
with dynamic shapes), a small MoE block under torch.compile(fullgraph=True), and CUDA graph
capture and replay."""

import pytest

from sy_testing import call_or_skip_unsupported, devices, need_cuda, require_torch, seeded

torch = require_torch()

import switchyard as sy  # noqa: E402
import sy_reference as ref  # noqa: E402

if not hasattr(torch.library, "opcheck"):
    pytest.skip(f"torch {torch.__version__} has no torch.library.opcheck (needs torch >= 2.4)",
                allow_module_level=True)


def op_samples(device):
    """(op, args) for every switchyard op, with valid arguments on `device`."""
    cfg = sy.presets["deepseek-v3"]
    T, E, K, M, H = 13, cfg.num_experts, cfg.top_k, 4, 40
    g = seeded(0)
    logits = torch.randn(T, E, generator=g).to(device)
    bias = (torch.randn(E, generator=g) * 0.01).to(device)
    ids, w = sy.route(logits, cfg, bias)
    lay = sy.layout(ids, E, M)
    R = lay.permuted_to_token.shape[0]
    x = torch.randn(T, H, generator=g).to(device)
    scales = torch.rand(T, 1, generator=g).to(device)
    y = torch.randn(R, H, generator=g).to(device)
    routing = cfg._op_args
    local = (0, -1, 1)
    empty = sy.empty_layout(T, K, E, M, device=device)
    ws = sy.empty_workspace(T, K, E, M, device=device)
    emap = torch.arange(E, dtype=torch.int32, device=device) % 3 - 1  # L = 2
    ops = torch.ops.switchyard
    return [
        (ops.route.default, (logits, bias, *routing, torch.int32, torch.float32)),
        (ops.route.default, (logits.bfloat16(), None, *routing, torch.int64, torch.bfloat16)),
        (ops.route_out.default, (logits, bias, torch.empty_like(ids), torch.empty_like(w), *routing)),
        (ops.layout.default, (ids, None, E, M, *local)),
        (ops.layout.default, (ids, emap, E, M, 0, 2, 1)),
        (ops.layout_out.default, (ids, None, *[torch.empty_like(t) for t in empty], ws, E, M, *local)),
        (ops.route_and_layout.default, (logits, bias, None, *routing, M, *local, torch.int32, torch.float32)),
        (ops.route_and_layout_out.default, (logits, bias, torch.empty_like(ids), torch.empty_like(w), None,
                                            *[torch.empty_like(t) for t in empty], ws, *routing, M, *local)),
        (ops.gather.default, (x, lay.permuted_to_token, lay.totals, True)),
        (ops.gather_scaled.default, (x, scales, lay.permuted_to_token, lay.totals, False)),
        (ops.gather_out.default, (x, scales, lay.permuted_to_token, lay.totals, torch.zeros(R, H, device=device),
                                  torch.zeros(R, 1, device=device), True)),
        (ops.combine.default, (y, lay.expanded_to_permuted, lay.permuted_to_token, w)),
        (ops.combine.default, (y, lay.expanded_to_permuted, lay.permuted_to_token, None)),
        (ops.combine_out.default, (y, lay.expanded_to_permuted, lay.permuted_to_token, w,
                                   torch.randn(T, H, device=device), True)),
    ]


@pytest.mark.parametrize("device", devices())
def test_opcheck_every_op(device):
    samples = call_or_skip_unsupported(op_samples, device)
    for op, args in samples:
        torch.library.opcheck(op, args)


def test_out_variants_declare_every_written_tensor_mutated():
    ops = torch.ops.switchyard
    expected = {
        "route_out": {"topk_ids", "topk_weights"},
        "layout_out": {"counts", "offsets", "permuted_to_expanded", "permuted_to_token", "expanded_to_permuted",
                       "tile_expert", "tile_row_end", "totals", "workspace"},
        "route_and_layout_out": {"topk_ids", "topk_weights", "counts", "offsets", "permuted_to_expanded",
                                 "permuted_to_token", "expanded_to_permuted", "tile_expert", "tile_row_end",
                                 "totals", "workspace"},
        "gather_out": {"out", "out_scales"},
        "combine_out": {"out"},
    }
    for name, written in expected.items():
        schema = getattr(ops, name).default._schema
        mutated = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
        assert mutated == written, f"{name}: {schema}"
        assert len(schema.returns) == 0
    for name in ("route", "layout", "route_and_layout", "gather", "gather_scaled", "combine"):
        schema = getattr(ops, name).default._schema
        assert not any(a.alias_info is not None for a in schema.arguments), f"{name}: {schema}"


# ----------------------------------------------------------------------------- MoE block


class TiledMoE(torch.nn.Module):
    """A small MoE block on the switchyard ops, free of host syncs: the expert GEMM runs per tile
    of M rows with the tile's expert weight (tile_expert), a dense stand-in for a grouped GEMM."""

    def __init__(self, preset, hidden, tile_size, seed=0):
        super().__init__()
        cfg = sy.presets[preset]
        g = seeded(seed)
        E = cfg.num_experts
        self.preset, self.tile_size = preset, tile_size
        self.router = torch.nn.Parameter(torch.randn(E, hidden, generator=g) / hidden ** 0.5, requires_grad=False)
        self.bias = torch.nn.Parameter(torch.randn(E, generator=g) * 0.01, requires_grad=False) if cfg.has_bias \
            else None
        self.w = torch.nn.Parameter(torch.randn(E, hidden, hidden, generator=g) / hidden ** 0.5, requires_grad=False)

    def forward(self, x):
        logits = x @ self.router.t()
        ids, weights, lay = sy.route_and_layout(logits, self.preset, self.bias, tile_size=self.tile_size)
        x_perm = sy.gather(x, lay, zero_fill_padding=True)  # [R, H]
        num_tiles_cap, hidden = lay.tile_expert.shape[0], x.shape[1]
        # R need not be a multiple of M; the rows past it are never read back by combine.
        padded = torch.nn.functional.pad(x_perm, (0, 0, 0, num_tiles_cap * self.tile_size - x_perm.shape[0]))
        tiles = padded.view(num_tiles_cap, self.tile_size, hidden)
        w_tiles = self.w[lay.tile_expert.clamp(min=0).long()]  # [N, H, H]; unused tiles read expert 0
        y_perm = torch.bmm(tiles, w_tiles).view(-1, hidden)
        return sy.combine(y_perm, lay, weights, out=torch.empty_like(x))


def naive_moe(block, x):
    cfg = sy.presets[block.preset]
    logits = x @ block.router.t()
    ids, w, margin = ref.route(logits.cpu(), cfg, None if block.bias is None else block.bias.cpu())
    safe = ref.safe_rows(margin)  # rows whose routing fp32 rounding cannot flip
    assert int(safe.sum()) >= 0.8 * x.shape[0], "too many near ties in the test data; change the seed"
    out = torch.zeros(x.shape, dtype=torch.float64)
    xd, wd = x.double().cpu(), block.w.double().cpu()
    for t in range(x.shape[0]):
        for k in range(cfg.top_k):
            out[t] += w[t, k] * (xd[t] @ wd[ids[t, k]])
    return out, safe


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("preset", ["deepseek-v3", "mixtral-8x7b"])
def test_moe_block_compiles_fullgraph(preset, device):
    block = TiledMoE(preset, hidden=32, tile_size=8).to(device)
    x = torch.randn(24, 32, generator=seeded(1)).to(device)
    eager = call_or_skip_unsupported(block, x)
    want, safe = naive_moe(block, x)
    torch.testing.assert_close(eager.double().cpu()[safe], want[safe], rtol=1e-4, atol=1e-4)
    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True)
    torch.testing.assert_close(compiled(x), eager, rtol=1e-5, atol=1e-5)
    # A second batch size goes through the symbolic (dynamic-shape) fake implementations.
    x2 = torch.randn(37, 32, generator=seeded(2)).to(device)
    torch.testing.assert_close(compiled(x2), block(x2), rtol=1e-5, atol=1e-5)


def test_functional_ops_trace_with_dynamic_shapes():
    def f(logits, x):
        ids, w, lay = sy.route_and_layout(logits, "qwen3-235b-a22b", tile_size=16)
        lay2 = sy.layout(ids, 128, 16)
        x_perm, s_perm = sy.gather(x, lay2, torch.ones(x.shape[0], device=x.device), True)
        return sy.combine(x_perm * s_perm[:, None], lay, w), lay.counts

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, dynamic=True, backend="aot_eager")
    for T in (5, 19):
        logits = torch.randn(T, 128, generator=seeded(T))
        x = torch.randn(T, 24, generator=seeded(T + 1))
        got, want = compiled(logits, x), f(logits, x)
        torch.testing.assert_close(got[0], want[0])
        assert torch.equal(got[1], want[1])


# ----------------------------------------------------------------------------- CUDA graphs


def test_cuda_graph_capture_and_replay():
    need_cuda()
    cfg = sy.presets["deepseek-v3"]
    T, H, M = 64, 64, 16
    E, K = cfg.num_experts, cfg.top_k
    dev = torch.device("cuda")
    logits = torch.randn(T, E, device=dev)
    bias = torch.randn(E, device=dev) * 0.01
    x = torch.randn(T, H, device=dev)
    # Caller-owned buffers, allocated once.
    ids = torch.empty(T, K, dtype=torch.int32, device=dev)
    w = torch.empty(T, K, device=dev)
    lay = sy.empty_layout(T, K, E, M, device=dev)
    ws = sy.empty_workspace(T, K, E, M, device=dev)
    x_perm = torch.zeros(lay.permuted_to_token.shape[0], H, device=dev)
    out = torch.empty(T, H, device=dev)

    def step():
        sy.route_and_layout(logits, cfg, bias, tile_size=M, out=(ids, w, lay), workspace=ws)
        sy.gather(x, lay, zero_fill_padding=True, out=x_perm)
        sy.combine(x_perm * 2.0, lay, w, out=out)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        call_or_skip_unsupported(step)  # warm-up outside the graph
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for seed in range(3):
        g = seeded(seed)
        logits.copy_(torch.randn(T, E, generator=g))
        x.copy_(torch.randn(T, H, generator=g))
        graph.replay()
        torch.cuda.synchronize()
        want_ids, want_w, want_lay = sy.route_and_layout(logits.cpu(), cfg, bias.cpu(), tile_size=M)
        assert torch.equal(ids.cpu(), want_ids) and torch.equal(w.cpu(), want_w)
        for a, b in zip(lay, want_lay):
            assert torch.equal(a.cpu(), b)
        want_out = sy.combine(sy.gather(x.cpu(), want_lay, zero_fill_padding=True) * 2.0, want_lay, want_w)
        assert torch.equal(out.cpu(), want_out)


def test_compiled_block_replays_in_a_cuda_graph():
    need_cuda()
    block = TiledMoE("qwen3-235b-a22b", hidden=32, tile_size=8).cuda()
    x = torch.randn(16, 32, device="cuda")
    eager = call_or_skip_unsupported(block, x)
    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True, mode="reduce-overhead")
    for _ in range(3):  # warm-up, record, replay
        got = compiled(x)
    torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-5)
