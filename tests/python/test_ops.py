"""Numerics of switchyard.route / layout / route_and_layout / gather / combine against the plain
PyTorch references of sy_reference.py, on the CPU backend and (where present) the CUDA backend,
and the CUDA backend against the CPU backend bit for bit."""

import pytest

from sy_testing import (call_or_skip_unsupported, devices, need_cuda, poison_like, require_torch,
                        seeded)

torch = require_torch()

import switchyard as sy  # noqa: E402
import sy_reference as ref  # noqa: E402

ROUTING_PRESETS = ["mixtral-8x7b", "qwen3-235b-a22b", "qwen3-next-80b", "deepseek-v3", "deepseek-v2", "kimi-k2",
                   "glm-4.5", "llama4-maverick", "gpt-oss-120b", "dbrx", "wide-2048"]
LOGIT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def make_logits(T, E, dtype, seed, device="cpu"):
    g = seeded(seed)
    return (torch.randn(T, E, generator=g) * 2).to(dtype).to(device)


def make_bias(cfg, seed, device="cpu"):
    if not getattr(cfg, "has_bias", False):
        return None
    return (torch.randn(cfg.num_experts, generator=seeded(seed + 1)) * 0.05).to(device)


def check_route(ids, weights, logits, cfg, bias):
    T, K, E = logits.shape[0], cfg.top_k, cfg.num_experts
    assert ids.shape == (T, K) and weights.shape == (T, K)
    ids_c = ids.long().cpu()
    assert bool(((ids_c >= 0) & (ids_c < E)).all())
    for t in range(T):
        assert len(set(ids_c[t].tolist())) == K, f"row {t}: repeated ids {ids_c[t].tolist()}"
    assert bool(torch.isfinite(weights.float()).all())
    r_ids, r_w, margin = ref.route(logits.cpu(), cfg, bias.cpu() if bias is not None else None)
    safe = ref.safe_rows(margin, values_scale=float(logits.float().abs().max()) if cfg.pre == "none" else 1.0)
    assert int(safe.sum()) >= max(1, int(0.8 * T)), "too many near ties in the test data; change the seed"
    torch.testing.assert_close(ids_c[safe], r_ids[safe], rtol=0, atol=0)
    tol = 1e-5 if weights.dtype == torch.float32 else 1e-2
    torch.testing.assert_close(weights.double().cpu()[safe], r_w[safe], rtol=tol, atol=tol * 1e-1)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", LOGIT_DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("num_tokens", [1, 19, 111])
@pytest.mark.parametrize("preset", ROUTING_PRESETS)
def test_route_matches_reference(preset, num_tokens, dtype, device):
    cfg = sy.presets[preset]
    logits = make_logits(num_tokens, cfg.num_experts, dtype, seed=num_tokens, device=device)
    bias = make_bias(cfg, seed=num_tokens, device=device)
    ids, weights = call_or_skip_unsupported(sy.route, logits, preset, bias=bias)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32 and ids.device == logits.device
    check_route(ids, weights, logits, cfg, bias)


@pytest.mark.parametrize("device", devices())
def test_route_custom_configs(device):
    configs = [
        sy.RoutingConfig(64, 6, pre="sqrtsoftplus", post="normalize", scale=1.5),
        sy.RoutingConfig(64, 8, pre="sigmoid", post="normalize", group_rule="topk_sum", n_group=8, topk_group=4),
        sy.RoutingConfig(32, 3, pre="softmax", post="softmax"),
        sy.RoutingConfig(16, 16, post="softmax"),  # K = E
    ]
    for i, cfg in enumerate(configs):
        logits = make_logits(37, cfg.num_experts, torch.float32, seed=100 + i, device=device)
        ids, weights = call_or_skip_unsupported(sy.route, logits, cfg)
        check_route(ids, weights, logits, cfg, None)


@pytest.mark.parametrize("device", devices())
def test_route_output_dtypes_strides_and_out(device):
    cfg = sy.presets["deepseek-v3"]
    E = cfg.num_experts
    big = make_logits(23, E + 40, torch.float32, seed=5, device=device)
    logits = big[:, 7:7 + E]  # row stride E + 40: accepted as is
    assert not logits.is_contiguous()
    bias = make_bias(cfg, 5, device)
    ids, w = call_or_skip_unsupported(sy.route, logits, cfg, bias)
    ids64, w16 = sy.route(logits.contiguous(), cfg, bias, ids_dtype=torch.int64, weights_dtype=torch.bfloat16)
    assert ids64.dtype == torch.int64 and w16.dtype == torch.bfloat16
    assert torch.equal(ids64, ids.long())
    torch.testing.assert_close(w16.float(), w, rtol=1e-2, atol=1e-2)
    out = (poison_like(ids), poison_like(w))
    r = sy.route(logits, cfg, bias, out=out)
    assert r[0] is out[0] and torch.equal(out[0], ids) and torch.equal(out[1], w)


@pytest.mark.parametrize("device", devices())
def test_route_bias_selects_but_does_not_weigh(device):
    cfg = sy.presets["kimi-k2"]
    logits = make_logits(9, cfg.num_experts, torch.float32, seed=3, device=device)
    bias = torch.zeros(cfg.num_experts, device=device)
    bias[17] = 100.0  # expert 17 wins every row; its weight still comes from the logits
    ids, w = call_or_skip_unsupported(sy.route, logits, cfg, bias)
    assert bool((ids[:, 0] == 17).all())
    check_route(ids, w, logits, cfg, bias)


@pytest.mark.parametrize("device", devices())
def test_route_zero_tokens(device):
    logits = torch.empty(0, 256, device=device)
    ids, w = call_or_skip_unsupported(sy.route, logits, "deepseek-v3")
    assert ids.shape == (0, 8) and w.shape == (0, 8)


# ----------------------------------------------------------------------------- layout

LOCALS = [
    ("all", None),
    ("range", (8, 16)),
    ("strided", sy.LocalExperts.range(1, 10, 3)),
    ("pyrange", range(32, 64)),
    ("map", "map"),
]


def make_ids(T, K, E, seed, device, specials=True):
    g = seeded(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else torch.empty(0, K)
    ids = ids.to(torch.int32)
    if specials and T * K >= 4:
        flat = ids.view(-1)
        flat[1] = -1  # not placed, not dropped
        flat[2] = E + 3  # dropped
        flat[3] = -9  # dropped
    return ids.to(device)


def expert_map_for(E, device):
    m = torch.full((E,), -1, dtype=torch.int32)
    m[torch.arange(0, E, 5)] = torch.arange(len(range(0, E, 5)), dtype=torch.int32).flip(0)
    m[1] = 99  # outside [-1, L): counts as -1
    return m.to(device), len(range(0, E, 5))


def resolve_local_for_test(local, E, device):
    if local == "map":
        m, L = expert_map_for(E, device)
        return sy.LocalExperts.map(m, L), dict(local_count=L, expert_map=m)
    loc = sy._core.resolve_local(local)
    return local, dict(local_start=loc.start, local_count=loc.count, local_stride=loc.stride)


def check_layout(lay, r):
    for name in ("counts", "offsets", "permuted_to_expanded", "permuted_to_token", "expanded_to_permuted",
                 "tile_expert", "tile_row_end", "totals"):
        got = getattr(lay, name)
        assert got.dtype == torch.int32, name
        torch.testing.assert_close(got.long().cpu(), getattr(r, name).long(), rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("local_name,local", LOCALS, ids=[n for n, _ in LOCALS])
@pytest.mark.parametrize("tile_size", [1, 3, 128])
@pytest.mark.parametrize("num_tokens", [0, 1, 19, 111])
def test_layout_matches_reference(num_tokens, tile_size, local_name, local, device):
    E, K = 64, 6
    ids = make_ids(num_tokens, K, E, seed=num_tokens + tile_size, device=device)
    local_arg, ref_kw = resolve_local_for_test(local, E, device)
    # Out-variant into poisoned buffers: every element must be written.
    out = sy.empty_layout(num_tokens, K, E, tile_size, local_arg, device=device)
    out = sy.Layout(*[poison_like(t) for t in out])
    lay = call_or_skip_unsupported(sy.layout, ids, E, tile_size, local_arg, out=out)
    r = ref.layout(ids.cpu(), E, tile_size, **ref_kw)
    check_layout(lay, r)
    # The functional form gives the same arrays.
    check_layout(sy.layout(ids, E, tile_size, local_arg), r)
    assert lay.dropped == (2 if num_tokens * K >= 4 else 0)


def moe_align_block_size_reference(topk_ids, num_experts, block_size):
    """vLLM's moe_align_block_size contract, from its documentation: the flat pick indices sorted
    by expert, each expert's run padded with topk_ids.numel() to a multiple of block_size (no
    blocks for an expert without picks), the expert of every block, and the padded total. Order
    inside an expert is not part of that contract; ascending here."""
    flat = topk_ids.reshape(-1).long().cpu()
    numel = flat.numel()
    sorted_ids, expert_ids = [], []
    for e in range(num_experts):
        picks = torch.nonzero(flat == e).reshape(-1).tolist()
        padded = -(-len(picks) // block_size) * block_size
        sorted_ids += picks + [numel] * (padded - len(picks))
        expert_ids += [e] * (padded // block_size)
    return sorted_ids, expert_ids, len(sorted_ids)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize("num_tokens", [0, 1, 37, 300])
def test_layout_as_moe_align_block_size(num_tokens, block_size, device):
    E, K = 32, 4
    ids = make_ids(num_tokens, K, E, seed=7 * num_tokens + block_size, device=device, specials=False)
    lay = call_or_skip_unsupported(sy.layout, ids, E, block_size)
    sorted_ids, expert_ids, post_pad = lay.as_moe_align_block_size()
    # Views of the layout's own arrays: nothing is copied.
    assert sorted_ids.data_ptr() == lay.permuted_to_expanded.data_ptr()
    assert expert_ids.data_ptr() == lay.tile_expert.data_ptr()
    assert post_pad.shape == (1,) and post_pad.dtype == torch.int32
    r_sorted, r_experts, r_total = moe_align_block_size_reference(ids, E, block_size)
    assert int(post_pad.item()) == r_total
    assert sorted_ids[:r_total].long().cpu().tolist() == r_sorted
    assert expert_ids[:len(r_experts)].long().cpu().tolist() == r_experts
    # Past the used part: padding ids and no expert, as moe_align_block_size's consumers expect.
    assert bool((sorted_ids[r_total:] == num_tokens * K).all())
    assert bool((expert_ids[len(r_experts):] == -1).all())


@pytest.mark.parametrize("device", devices())
def test_layout_int64_ids_and_checked_mode(device):
    ids = make_ids(19, 4, 16, seed=1, device=device, specials=False).long()
    lay = call_or_skip_unsupported(sy.layout, ids, 16, 4, checked=True)
    check_layout(lay, ref.layout(ids.cpu(), 16, 4))
    bad = ids.clone()
    bad[0, 0] = 16
    with pytest.raises(ValueError, match="topk_ids"):
        sy.layout(bad, 16, 4, checked=True)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("preset", ["deepseek-v3", "qwen3-235b-a22b", "mixtral-8x7b"])
def test_route_and_layout_equals_route_then_layout(preset, device):
    cfg = sy.presets[preset]
    logits = make_logits(45, cfg.num_experts, torch.bfloat16, seed=11, device=device)
    bias = make_bias(cfg, 11, device)
    ids, w, lay = call_or_skip_unsupported(sy.route_and_layout, logits, preset, bias, tile_size=16)
    ids2, w2 = sy.route(logits, preset, bias)
    assert torch.equal(ids, ids2) and torch.equal(w, w2)
    check_layout(lay, ref.layout(ids.cpu(), cfg.num_experts, 16))
    # Out-variant with local experts and a preallocated workspace.
    T, K, E = 45, cfg.top_k, cfg.num_experts
    local = (E // 4, E // 4)
    out = (poison_like(ids), poison_like(w), sy.Layout(*[poison_like(t) for t in
                                                         sy.empty_layout(T, K, E, 16, local, device)]))
    ws = sy.empty_workspace(T, K, E, 16, local, device)
    ids3, w3, lay3 = sy.route_and_layout(logits, cfg, bias, tile_size=16, local=local, out=out, workspace=ws)
    assert torch.equal(ids3, ids) and torch.equal(w3, w)
    check_layout(lay3, ref.layout(ids.cpu(), E, 16, local_start=E // 4, local_count=E // 4))


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("num_tokens", [3, 1100])
def test_independent_blocks_same_layout(num_tokens, device):
    """independent_blocks=True changes only how the CUDA backend schedules the call (1100 tokens x
    8 picks take a 16-block cluster by default, the multi-launch pipeline with the flag)."""
    cfg = sy.presets["deepseek-v3"]
    E, K = cfg.num_experts, cfg.top_k
    ids = make_ids(num_tokens, K, E, seed=num_tokens, device=device)
    lay = call_or_skip_unsupported(sy.layout, ids, E, 128, independent_blocks=True)
    check_layout(lay, ref.layout(ids.cpu(), E, 128))
    out = sy.Layout(*[poison_like(t) for t in sy.empty_layout(num_tokens, K, E, 128, device=device)])
    check_layout(sy.layout(ids, E, 128, out=out, independent_blocks=True), ref.layout(ids.cpu(), E, 128))
    logits = make_logits(num_tokens, E, torch.float32, seed=num_tokens, device=device)
    bias = make_bias(cfg, num_tokens, device)
    r_ids, r_w, r_lay = sy.route_and_layout(logits, cfg, bias, tile_size=128)
    i_ids, i_w, i_lay = sy.route_and_layout(logits, cfg, bias, tile_size=128, independent_blocks=True)
    assert torch.equal(i_ids, r_ids) and torch.equal(i_w, r_w)
    for name in sy.Layout._fields:
        assert torch.equal(getattr(i_lay, name), getattr(r_lay, name)), name


# ----------------------------------------------------------------------------- gather / combine

X_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn]


def bits(t):
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int16 if t.element_size() == 2 else
                                                                     torch.int32)


def make_x(T, H, dtype, seed, device):
    x = torch.randn(T, H, generator=seeded(seed)) * 3
    return x.to(dtype).to(device)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("zero_fill", [False, True])
@pytest.mark.parametrize("scales", ["none", "token", "group"])
@pytest.mark.parametrize("dtype", X_DTYPES, ids=["fp32", "bf16", "fp16", "fp8"])
def test_gather_matches_reference(dtype, scales, zero_fill, device):
    T, K, E, M, H = 37, 4, 16, 8, 300
    ids = make_ids(T, K, E, seed=2, device=device)
    lay = call_or_skip_unsupported(sy.layout, ids, E, M)
    big = make_x(T, H + 20, dtype, seed=3, device=device)
    x = big[:, :H]  # row stride H + 20
    x_scales = None
    if scales == "token":
        x_scales = torch.rand(T, generator=seeded(4)).to(device)
    elif scales == "group":
        x_scales = torch.rand(T, (H + 127) // 128, generator=seeded(4)).to(device)
    R = lay.permuted_to_token.shape[0]
    out = torch.full((R, H), 7, dtype=torch.float32).to(dtype).to(device)
    out_scales = None if x_scales is None else torch.full((R,) + tuple(x_scales.shape[1:]), -5.0, device=device)
    res = call_or_skip_unsupported(sy.gather, x, lay, x_scales, zero_fill, out=out, out_scales=out_scales)
    padded_total = lay.padded_total
    want = ref.gather(bits(x).contiguous(), lay.permuted_to_token, padded_total, bits(out.clone()), zero_fill)
    if x_scales is None:
        assert res is out
    else:
        assert res[0] is out and res[1] is out_scales
        want_s = ref.gather(x_scales.view(T, -1), lay.permuted_to_token, padded_total,
                            out_scales.view(R, -1).clone(), zero_fill)
        assert torch.equal(out_scales.view(R, -1), want_s.to(out_scales.dtype))
    assert torch.equal(bits(out), want)
    # Functional: a fresh, zero-initialized result.
    fres = sy.gather(x, lay, x_scales, zero_fill)
    f_out = fres if x_scales is None else fres[0]
    want_f = ref.gather(bits(x).contiguous(), lay.permuted_to_token, padded_total, bits(torch.zeros_like(out)), True)
    assert torch.equal(bits(f_out), want_f)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("weights_kind", ["fp32", "bf16", "none"])
@pytest.mark.parametrize("y_dtype,out_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                (torch.float16, torch.float16), (torch.bfloat16, torch.float32)])
def test_combine_matches_reference(y_dtype, out_dtype, weights_kind, device):
    T, K, E, M, H = 41, 6, 32, 4, 96
    ids = make_ids(T, K, E, seed=7, device=device)
    lay = call_or_skip_unsupported(sy.layout, ids, E, M, (0, 24))  # some picks are not local: not placed
    R = lay.permuted_to_token.shape[0]
    big = make_x(R, H + 8, y_dtype, seed=8, device=device)
    y_perm = big[:, :H]
    weights = None
    if weights_kind != "none":
        weights = torch.rand(T, K, generator=seeded(9)).to(torch.float32 if weights_kind == "fp32"
                                                             else torch.bfloat16).to(device)
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}[out_dtype]
    out = torch.full((T, H), float("nan"), dtype=out_dtype, device=device)
    res = call_or_skip_unsupported(sy.combine, y_perm, lay, weights, out)
    assert res is out
    want = ref.combine(y_perm, lay.expanded_to_permuted, weights, out_dtype)
    torch.testing.assert_close(out.double(), want.double(), rtol=tol, atol=tol)
    # accumulate: out += result (a shared expert's output already in out)
    shared = make_x(T, H, out_dtype, seed=10, device=device)
    acc = shared.clone()
    sy.combine(y_perm, lay, weights, out=acc, accumulate=True)
    want_acc = ref.combine(y_perm, lay.expanded_to_permuted, weights, out_dtype, accumulate_into=shared)
    torch.testing.assert_close(acc.double(), want_acc.double(), rtol=tol, atol=tol * 4)
    # Functional: result in y_perm's dtype, equal to the out-variant when dtypes agree.
    f = sy.combine(y_perm, lay, weights)
    assert f.dtype == y_dtype and f.shape == (T, H)
    if y_dtype == out_dtype:
        assert torch.equal(bits(f), bits(out))


def test_combine_is_deterministic_and_zero_for_unplaced_tokens():
    T, K, E, H = 8, 2, 8, 16
    ids = torch.tensor([[0, 1]] * (T - 1) + [[-1, -1]], dtype=torch.int32)
    lay = sy.layout(ids, E)
    y = make_x(lay.permuted_to_token.shape[0], H, torch.float32, seed=1, device="cpu")
    w = torch.rand(T, K, generator=seeded(2))
    a = sy.combine(y, lay, w)
    b = sy.combine(y, lay, w)
    assert torch.equal(a, b)
    assert bool((a[T - 1] == 0).all())


# ----------------------------------------------------------------------------- CPU vs CUDA backend


@pytest.mark.parametrize("preset", ["deepseek-v3", "qwen3-next-80b", "mixtral-8x7b", "deepseek-v2", "wide-2048"])
def test_cuda_backend_matches_cpu_backend_bit_for_bit(preset):
    need_cuda()
    cfg = sy.presets[preset]
    T, H, M = 333, 160, 64
    logits = make_logits(T, cfg.num_experts, torch.bfloat16, seed=21)
    bias = make_bias(cfg, 21)
    x = make_x(T, H, torch.bfloat16, seed=22, device="cpu")
    cuda = torch.device("cuda")

    def pipeline(dev):
        ids, w, lay = sy.route_and_layout(logits.to(dev), cfg, None if bias is None else bias.to(dev), tile_size=M)
        ids_only, w_only = sy.route(logits.to(dev), cfg, None if bias is None else bias.to(dev))
        lay_only = sy.layout(ids, cfg.num_experts, M)
        xp = sy.gather(x.to(dev), lay, zero_fill_padding=True)
        y = sy.combine(xp, lay, w)
        return [ids, w, *lay, ids_only, w_only, *lay_only, xp, y]

    cpu_res = pipeline("cpu")
    gpu_res = call_or_skip_unsupported(pipeline, cuda)
    torch.cuda.synchronize()
    for i, (a, b) in enumerate(zip(cpu_res, gpu_res)):
        assert b.device.type == "cuda"
        assert torch.equal(bits(a.contiguous()), bits(b.cpu().contiguous())), f"output {i} differs"


def test_cuda_ops_run_on_the_current_stream():
    need_cuda()
    cfg = sy.presets["deepseek-v3"]
    logits = make_logits(64, 256, torch.float32, seed=1, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ids, w = call_or_skip_unsupported(sy.route, logits, cfg)
        lay = sy.layout(ids, 256, 8)
    torch.cuda.current_stream().wait_stream(side)
    ids_ref, w_ref = sy.route(logits.cpu(), cfg)
    assert torch.equal(ids.cpu(), ids_ref) and torch.equal(w.cpu(), w_ref)
    check_layout(lay, ref.layout(ids_ref, 256, 8))


def test_first_eager_call_does_not_load_the_compiler():
    """torch.library.custom_op's kernels import torch._dynamo on their first call (seconds);
    ops._eager_without_dynamo keeps that off the eager path until torch.compile is used."""
    import subprocess
    import sys
    code = ("import sys, torch, switchyard as sy\n"
            "ids, w, lay = sy.route_and_layout(torch.randn(16, 160), 'deepseek-v2', tile_size=4)\n"
            "y = sy.combine(sy.gather(torch.randn(16, 8), lay), lay, w)\n"
            "sy.layout(ids, 160, out=sy.empty_layout(16, 6, 160))\n"
            "print('torch._dynamo' in sys.modules)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False", "an eager call imported torch._dynamo"


def test_eager_fast_path_leaves_tracing_modes_and_autograd_to_the_ops():
    """Plain eager calls skip the dispatcher (ops._eager_kernel); under a dispatch mode (here
    FakeTensorMode, as torch.compile traces) and with a gradient to record they go through the
    registered ops, fake implementations and autograd included."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    ids = torch.stack([torch.randperm(8)[:2] for _ in range(5)]).to(torch.int32)
    x = torch.randn(5, 4)
    assert sy.ops._eager_kernel(sy.ops._layout_functional, ids) is not None
    with FakeTensorMode() as mode:
        fake_ids, fake_x = mode.from_tensor(ids), mode.from_tensor(x)
        assert sy.ops._eager_kernel(sy.ops._layout_functional, fake_ids) is None
        lay = sy.layout(fake_ids, 8)
        assert lay.counts.shape == (8,) and sy.gather(fake_x, lay).shape == (lay.permuted_to_token.shape[0], 4)
    lay = sy.layout(ids, 8)
    xg = x.clone().requires_grad_()
    assert sy.ops._eager_kernel(sy.ops._gather_functional, xg) is None
    sy.gather(xg, lay).sum().backward()
    assert torch.equal(xg.grad, torch.full((5, 4), 2.0))  # each token's two rows
    with torch.no_grad():
        assert sy.ops._eager_kernel(sy.ops._gather_functional, xg) is not None
