"""Gradients of the Switchyard ops (docs/design.md section 7) on the CPU backend.

- gather and combine: torch.autograd.gradcheck of the ops themselves. The library has no fp64
  dtype, so these run in fp32 on values that are small multiples of 1/16 with eps = 1/16: every
  sum and product is then exact in fp32, the finite differences of these (multi)linear maps are
  exact, and the Jacobians are compared with a tolerance of 1e-6 (tighter than fp64 allows).
- route: gradcheck in fp64 of route_weights (the torch formula whose gradient route's backward
  runs) with the ids the library picks, for every preset and every pre x post pair, on logits
  whose routing decisions are far from ties (so the perturbation cannot change the selection);
  then route's and route_and_layout's own backward (fp32 / bf16 logits) against that fp64
  gradient, and route_weights' forward against the library's weights.
- a whole MoE layer (route_and_layout -> gather -> per-expert SwiGLU -> combine, with and without
  a shared expert): loss.backward() against the same layer written in plain PyTorch.
- torch.compile of a training step with the ops in the graph.
The backward kernels (combine_backward, route_backward) also have C++ tests of their own (CPU
against fp64 references, CUDA against the CPU).
"""

import importlib.util
import pathlib
import subprocess
import sys
import time
import warnings

import pytest

from sy_testing import call_or_skip_unsupported, devices, require_torch, seeded

torch = require_torch()

import switchyard as sy  # noqa: E402
import sy_reference as ref  # noqa: E402

F = torch.nn.functional
EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "moe_layer.py"


def gradcheck(fn, inputs, **kwargs):
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*double precision.*")  # fp32 on purpose, see above
        return torch.autograd.gradcheck(fn, inputs, **kwargs)


def dyadic(*shape, generator, low=-32, high=32):
    """fp32 values k/16 with |k| <= 32: sums and products of a few of them are exact in fp32."""
    return torch.randint(low, high + 1, shape, generator=generator).float() / 16


def random_ids(T, K, E, generator):
    return torch.stack([torch.randperm(E, generator=generator)[:K] for _ in range(T)]).int().reshape(T, K)


EXACT = dict(eps=1 / 16, atol=1e-6, rtol=1e-6)

# (T, K, E, tile_size, local): odd sizes, tile padding, and local experts (picks left unplaced)
LAYOUT_CASES = [(1, 1, 4, 1, None), (3, 2, 8, 4, None), (19, 4, 16, 8, None), (7, 3, 12, 2, (0, 5)),
                (5, 2, 6, 3, sy.LocalExperts(1, 3, 2))]


def make_layout(T, K, E, tile, local, seed, device="cpu"):
    g = seeded(seed)
    ids = random_ids(T, K, E, g).to(device)
    return ids, call_or_skip_unsupported(sy.layout, ids, E, tile, local), g


# ----------------------------------------------------------------------------- gather


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("zero_fill", [False, True])
@pytest.mark.parametrize("T,K,E,tile,local", LAYOUT_CASES)
def test_gradcheck_gather(T, K, E, tile, local, zero_fill, device):
    _, lay, g = make_layout(T, K, E, tile, local, seed=T * 7 + K, device=device)
    x = dyadic(T, 5, generator=g).to(device).requires_grad_()
    assert gradcheck(lambda x: sy.gather(x, lay, zero_fill_padding=zero_fill), (x,), **EXACT)


def test_gather_backward_is_each_tokens_sum_of_its_rows():
    T, K, E, H = 6, 3, 8, 4
    ids, lay, g = make_layout(T, K, E, 4, None, seed=1)
    x = torch.randn(T, H, generator=g, requires_grad=True)
    x_perm = sy.gather(x, lay)
    grad = torch.randn(x_perm.shape, generator=g)
    x_perm.backward(grad)
    e2p = lay.expanded_to_permuted.long()
    want = sum(grad[e2p[:, k]] for k in range(K))  # k order
    assert torch.equal(x.grad, want)


def test_gradcheck_gather_scaled_moves_scale_gradients_with_rows():
    T, K, E = 9, 2, 8
    _, lay, g = make_layout(T, K, E, 4, None, seed=3)
    x = dyadic(T, 6, generator=g).requires_grad_()
    for scales in (dyadic(T, generator=g), dyadic(T, 1, generator=g)):
        scales.requires_grad_()
        assert gradcheck(lambda x, s: sy.gather(x, lay, s, True), (x, scales), **EXACT)
    wide = dyadic(T, 2 * sy.SCALE_GROUP_SIZE, generator=g)  # per 128-column group scales [T, 2]
    scales = dyadic(T, 2, generator=g).requires_grad_()
    assert gradcheck(lambda s: sy.gather(wide, lay, s, True), (scales,), **EXACT)


@pytest.mark.skipif(not hasattr(torch, "float8_e4m3fn"), reason="torch without float8_e4m3fn")
def test_gather_of_fp8_x_has_no_gradient():
    T, K, E = 4, 2, 8
    _, lay, g = make_layout(T, K, E, 1, None, seed=4)
    x = torch.randn(T, 8, generator=g).to(torch.float8_e4m3fn).requires_grad_()
    x_perm = sy.gather(x, lay)
    with pytest.raises(TypeError, match="fp8 x has no gradient"):
        x_perm.float().sum().backward()


def test_gather_out_form_refuses_inputs_that_need_grad():
    _, lay, g = make_layout(4, 2, 8, 1, None, seed=5)
    x = torch.randn(4, 8, generator=g, requires_grad=True)
    with pytest.raises(ValueError, match="argument 'out'.*autograd"):
        sy.gather(x, lay, out=torch.zeros(lay.permuted_to_token.shape[0], 8))
    with torch.no_grad():
        sy.gather(x, lay, out=torch.zeros(lay.permuted_to_token.shape[0], 8))


# ----------------------------------------------------------------------------- combine


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("weighted", [True, False], ids=["weights", "no_weights"])
@pytest.mark.parametrize("T,K,E,tile,local", LAYOUT_CASES)
def test_gradcheck_combine(T, K, E, tile, local, weighted, device):
    _, lay, g = make_layout(T, K, E, tile, local, seed=T * 11 + K, device=device)
    R = lay.permuted_to_token.shape[0]
    # y_perm may have more rows than the layout's capacity
    y = dyadic(R + 2, 5, generator=g).to(device).requires_grad_()
    if weighted:
        w = dyadic(T, K, generator=g, low=-16, high=16).to(device).requires_grad_()
        assert gradcheck(lambda y, w: sy.combine(y, lay, w), (y, w), **EXACT)
    else:
        assert gradcheck(lambda y: sy.combine(y, lay), (y,), **EXACT)


def test_combine_backward_formulas():
    T, K, E, H = 7, 3, 12, 5
    _, lay, g = make_layout(T, K, E, 2, (0, 5), seed=6)
    R = lay.permuted_to_token.shape[0]
    y = torch.randn(R, H, generator=g, requires_grad=True)
    w = torch.rand(T, K, generator=g, requires_grad=True)
    out = sy.combine(y, lay, w)
    dout = torch.randn(T, H, generator=g)
    out.backward(dout)
    e2p = lay.expanded_to_permuted.long()
    want_dy, want_dw = torch.zeros(R, H), torch.zeros(T, K)
    for t in range(T):
        for k in range(K):
            p = int(e2p[t, k])
            if p >= 0:
                want_dy[p] = w[t, k].detach() * dout[t]
                want_dw[t, k] = torch.dot(dout[t].double(), y[p].detach().double()).float()
    assert torch.equal(y.grad, want_dy)  # one product per element, no sum: exact
    torch.testing.assert_close(w.grad, want_dw, rtol=1e-6, atol=1e-6)
    assert bool((w.grad[e2p < 0] == 0).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_combine_backward_dtypes(dtype):
    T, K, E, H = 5, 2, 8, 16
    _, lay, g = make_layout(T, K, E, 4, None, seed=7)
    R = lay.permuted_to_token.shape[0]
    y32 = torch.randn(R, H, generator=g)
    w32 = torch.rand(T, K, generator=g)
    dout = torch.randn(T, H, generator=g)
    y = y32.to(dtype).requires_grad_()
    w = w32.bfloat16().requires_grad_()
    sy.combine(y, lay, w).backward(dout.to(dtype))
    assert y.grad.dtype == dtype and w.grad.dtype == torch.bfloat16
    y_ref = y.detach().float().requires_grad_()
    w_ref = w.detach().float().requires_grad_()
    sy.combine(y_ref, lay, w_ref).backward(dout.to(dtype).float())
    torch.testing.assert_close(y.grad.float(), y_ref.grad, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(w.grad.float(), w_ref.grad, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("device", devices())
def test_backward_ops_pass_opcheck(device):
    """The backward kernels' custom ops (switchyard::combine_backward, switchyard::route_backward):
    schema, fake implementation and their use under torch.compile."""
    T, K, E, H = 6, 2, 8, 16
    _, lay, g = make_layout(T, K, E, 2, None, seed=9, device=device)
    R = lay.permuted_to_token.shape[0]
    y = torch.randn(R + 1, H, generator=g).to(device)
    w = torch.rand(T, K, generator=g).to(device)
    dout = torch.randn(T, H, generator=g).to(device)
    for need_dy, need_dw in ((True, True), (True, False), (False, True)):
        torch.library.opcheck(torch.ops.switchyard.combine_backward.default,
                              (dout, y, lay.expanded_to_permuted, lay.permuted_to_token, w, need_dy, need_dw))
    cfg = sy.presets["deepseek-v3"]
    logits = torch.randn(T, cfg.num_experts, generator=g).to(device)
    bias = (torch.randn(cfg.num_experts, generator=g) * 0.1).to(device)
    ids, _ = call_or_skip_unsupported(sy.route, logits, cfg, bias=bias)
    dw = torch.randn(T, cfg.top_k, generator=g).to(device)
    torch.library.opcheck(torch.ops.switchyard.route_backward.default, (logits, bias, ids, dw, 2, 3, 2.5))


def test_combine_out_accumulate_is_on_the_tape():
    T, K, E, H = 6, 2, 8, 4
    _, lay, g = make_layout(T, K, E, 2, None, seed=8)
    R = lay.permuted_to_token.shape[0]
    y = torch.randn(R, H, generator=g, requires_grad=True)
    w = torch.rand(T, K, generator=g, requires_grad=True)
    base = torch.randn(T, H, generator=g, requires_grad=True)
    out = base * 1.0
    got = sy.combine(y, lay, w, out=out, accumulate=True)
    assert got is out
    got.sum().backward()
    assert torch.equal(base.grad, torch.ones(T, H))
    with torch.no_grad():
        torch.testing.assert_close(got, base + sy.combine(y, lay, w))
    assert y.grad is not None and w.grad is not None


# ----------------------------------------------------------------------------- route

PRE_POST = [(pre, post) for pre in ("none", "softmax", "sigmoid", "sqrtsoftplus")
            for post in ("none", "softmax", "sigmoid", "normalize")]
GROUP_CONFIGS = [sy.RoutingConfig(16, 4, "sigmoid", "normalize", "top2_sum", 4, 2, 2.5),
                 sy.RoutingConfig(16, 4, "softmax", "none", "max", 4, 3, 16.0),
                 sy.RoutingConfig(16, 4, "sqrtsoftplus", "softmax", "topk_sum", 4, 2, 1.5)]


def separated_logits(T, E, seed, spread=3.0):
    """fp64 logits whose values in a row are a permutation of an evenly spread set with a little
    jitter, so no two selection scores (nor group sums) are near each other."""
    g = seeded(seed)
    base = torch.linspace(-spread, spread, E, dtype=torch.float64)
    jitter = torch.rand(T, E, generator=g, dtype=torch.float64) * (0.3 * 2 * spread / E)
    return torch.stack([base[torch.randperm(E, generator=g)] for _ in range(T)]) + jitter


def bias_for(cfg, seed):
    if not getattr(cfg, "has_bias", False):
        return None
    return torch.randn(cfg.num_experts, generator=seeded(seed)) * 1e-3


def far_from_ties(T, cfg, bias, seed, tol=1e-5):
    """separated_logits whose selection scores and group scores are all more than `tol` apart
    at the decisions (the fp64 reference's margin), trying seeds from `seed` on. gradcheck
    perturbs by 1e-6, which moves a pre-score by at most 2.5e-7 (sigmoid) or 1e-6."""
    for s in range(seed, seed + 50):
        logits = separated_logits(T, cfg.num_experts, s)
        _, _, margin = ref.route(logits.float(), cfg, bias)
        if bool((margin > tol).all()):
            return logits
    raise AssertionError("no test logits far enough from routing ties")


def route_fp64(cfg, bias):
    """logits (fp64) -> weights (fp64): the library's selection, route_weights' weights."""

    def f(logits):
        ids, _ = sy.route(logits.detach().float(), cfg, bias)
        return sy.route_weights(logits, ids, cfg, bias)

    return f


def all_configs():
    out = [pytest.param(sy.presets[name], id=name) for name in sy.presets]
    out += [pytest.param(sy.RoutingConfig(16, 4, pre, post, scale=1.7), id=f"{pre}-{post}") for pre, post in PRE_POST]
    out += [pytest.param(c, id=f"group-{c.group_rule}") for c in GROUP_CONFIGS]
    return out


@pytest.mark.parametrize("cfg", all_configs())
def test_gradcheck_route_fp64(cfg):
    T = 3
    bias = bias_for(cfg, 1)
    logits = far_from_ties(T, cfg, bias, seed=cfg.num_experts + cfg.top_k)
    logits.requires_grad_()
    fast = cfg.num_experts > 160  # random projections of the Jacobian: the full one takes T*E evaluations
    assert gradcheck(route_fp64(cfg, bias), (logits,), eps=1e-6, atol=1e-8, rtol=1e-6, fast_mode=fast)


@pytest.mark.parametrize("cfg", all_configs())
@pytest.mark.parametrize("op", ["route", "route_and_layout"])
def test_route_backward_matches_fp64(cfg, op):
    T = 5
    bias = bias_for(cfg, 2)
    logits64 = far_from_ties(T, cfg, bias, seed=cfg.top_k + 17)
    logits = logits64.float().requires_grad_()
    if op == "route":
        ids, w = sy.route(logits, cfg, bias)
    else:
        ids, w, lay = sy.route_and_layout(logits, cfg, bias, tile_size=4)
        assert int(lay.counts.sum()) == T * cfg.top_k
    grad_w = torch.randn(T, cfg.top_k, generator=seeded(3))
    (w * grad_w).sum().backward()

    want_logits = logits64.clone().requires_grad_()
    want_w = sy.route_weights(want_logits, ids, cfg, bias)
    (want_w * grad_w.double()).sum().backward()
    torch.testing.assert_close(w.detach().double(), want_w.detach(), rtol=2e-6, atol=1e-6)
    scale = want_logits.grad.abs().max().item()
    torch.testing.assert_close(logits.grad.double(), want_logits.grad, rtol=1e-4, atol=1e-6 * max(scale, 1e-3))


@pytest.mark.parametrize("name", ["deepseek-v3", "qwen3-235b-a22b"])
def test_route_backward_bf16_logits_and_weights(name):
    cfg = sy.presets[name]
    T = 4
    logits64 = separated_logits(T, cfg.num_experts, seed=9)
    logits = logits64.bfloat16().requires_grad_()
    ids, w = sy.route(logits, cfg, weights_dtype=torch.bfloat16)
    grad_w = torch.randn(T, cfg.top_k, generator=seeded(4))
    (w.float() * grad_w).sum().backward()
    assert logits.grad.dtype == torch.bfloat16
    want = logits.detach().double().requires_grad_()
    (sy.route_weights(want, ids, cfg) * grad_w.double()).sum().backward()
    torch.testing.assert_close(logits.grad.double(), want.grad, rtol=2e-2, atol=2e-2 * want.grad.abs().max().item())


def test_route_weights_gradient_matches_autograd_of_its_formula():
    """The hand-written backward against torch autograd of the same forward formula."""
    from switchyard import _autograd

    for pre, post in PRE_POST:
        cfg = sy.RoutingConfig(16, 4, pre, post, scale=1.3)
        logits = separated_logits(6, 16, seed=5).requires_grad_()
        ids, _ = sy.route(logits.detach().float(), cfg)
        args = cfg._op_args
        w = _autograd.route_weights_value(logits, None, ids.long(), args[2], args[3], args[7])
        grad_w = torch.randn(w.shape, generator=seeded(6), dtype=torch.float64)
        (want,) = torch.autograd.grad(w, logits, grad_w)
        got = _autograd.route_weights_backward(logits.detach(), None, ids.long(), grad_w, args[2], args[3], args[7])
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14, msg=f"{pre}-{post}")


def test_route_gradient_with_non_finite_logits():
    cfg = sy.RoutingConfig(8, 3, "softmax", "normalize")
    logits = torch.tensor([[0.5, float("nan"), 2.0, -1.0, float("-inf"), 1.0, 0.2, 3.0],
                           [float("-inf")] * 6 + [1.0, 2.0]]).requires_grad_()
    ids, w = sy.route(logits, cfg)
    assert bool((w[1, 2] == 0).all())  # a pick with a non-finite score: weight 0
    w.sum().backward()
    grad = logits.grad
    assert bool(torch.isfinite(grad).all())
    assert bool((grad[~torch.isfinite(logits.detach())] == 0).all())


def test_bias_gets_no_gradient_and_selection_none():
    cfg = sy.presets["deepseek-v3"]
    logits = separated_logits(4, cfg.num_experts, seed=8).float().requires_grad_()
    bias = (torch.randn(cfg.num_experts, generator=seeded(8)) * 1e-3).requires_grad_()
    _, w = sy.route(logits, cfg, bias)
    w.pow(2).sum().backward()
    assert bias.grad is None or bool((bias.grad == 0).all())
    assert logits.grad is not None


def test_route_out_form_refuses_logits_that_need_grad():
    cfg = sy.presets["mixtral-8x7b"]
    logits = torch.randn(3, 8, requires_grad=True)
    out = (torch.empty(3, 2, dtype=torch.int32), torch.empty(3, 2))
    with pytest.raises(ValueError, match="argument 'out'"):
        sy.route(logits, cfg, out=out)


# ----------------------------------------------------------------------------- MoE layer


def load_example():
    spec = importlib.util.spec_from_file_location("moe_layer_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def plain_route(logits, cfg, bias):
    """Routing in plain PyTorch (autograd through softmax / sigmoid / gather): ids, weights."""
    T, E = logits.shape
    s = logits.float()
    if cfg.pre == "softmax":
        p = torch.softmax(s, -1)
    elif cfg.pre == "sigmoid":
        p = torch.sigmoid(s)
    elif cfg.pre == "sqrtsoftplus":
        p = torch.sqrt(F.softplus(s))
    else:
        p = s
    q = p.detach() + (0 if bias is None else bias.float())
    if cfg.group_rule != "none":
        G = E // cfg.n_group
        take = {"top2_sum": 2, "max": 1, "topk_sum": cfg.top_k // cfg.topk_group}[cfg.group_rule]
        scores = q.view(T, cfg.n_group, G).topk(take, -1).values.sum(-1)
        keep = torch.zeros(T, cfg.n_group, dtype=torch.bool, device=q.device)
        keep.scatter_(1, scores.topk(cfg.topk_group, -1).indices, True)
        q = q.masked_fill(~keep.repeat_interleave(G, 1), float("-inf"))
    ids = q.topk(cfg.top_k, -1).indices
    sel = p.gather(1, ids)
    if cfg.post == "softmax":
        w = torch.softmax(sel, -1)
    elif cfg.post == "sigmoid":
        w = torch.sigmoid(sel)
    elif cfg.post == "normalize":
        w = sel / (sel.sum(-1, keepdim=True) + 1e-20)
    else:
        w = sel
    return ids, w * cfg.scale


def plain_moe(layer, x):
    """The example's layer in plain PyTorch: the same parameters, index_add over experts."""
    cfg = layer.config
    logits = F.linear(x, layer.router)
    bias = None if layer.selection_bias is None else layer.selection_bias.detach()
    ids, w = plain_route(logits, cfg, bias)
    out = torch.zeros_like(x)
    if layer.shared_gate_up is not None:
        out = out + layer.swiglu(x, layer.shared_gate_up, layer.shared_down)
    for e in range(cfg.num_experts):  # torch's CUDA index_add uses atomics: fine for a reference
        t, k = (ids == e).nonzero(as_tuple=True)
        if t.numel():
            out = out.index_add(0, t, w[t, k, None] * layer.expert(e, x[t]))
    return out, ids


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("shared", [False, True], ids=["routed", "with_shared_expert"])
@pytest.mark.parametrize("preset,tokens,tile_size", [("deepseek-v3", 48, 16), ("qwen3-235b-a22b", 40, 8),
                                                     ("mixtral-8x7b", 33, 4), ("deepseek-v2", 24, 4)])
def test_moe_layer_gradients_match_plain_pytorch(preset, tokens, tile_size, shared, device):
    example = load_example()
    hidden, intermediate = 32, 16
    layer = example.SwitchyardMoE(preset, hidden, intermediate, tile_size,
                                  shared_intermediate_size=24 if shared else None, seed=tokens,
                                  device=torch.device(device))
    x = torch.randn(tokens, hidden, generator=seeded(tokens + 1)).to(device)
    target = torch.randn(tokens, hidden, generator=seeded(tokens + 2)).to(device)
    params = [p for p in layer.parameters() if p.requires_grad]

    def loss_and_grads(forward):
        xi = x.clone().requires_grad_()
        out = forward(xi)
        loss = F.mse_loss(out, target)
        grads = torch.autograd.grad(loss, [xi] + params)
        return loss.detach(), grads

    with torch.no_grad():
        ids, _ = sy.route(F.linear(x, layer.router), layer.config,
                          None if layer.selection_bias is None else layer.selection_bias)
        _, plain_ids = plain_moe(layer, x)
    # The same experts (possibly in another order): the selection has no gradient to compare.
    assert torch.equal(ids.long().sort(-1).values, plain_ids.sort(-1).values)

    got_loss, got = call_or_skip_unsupported(loss_and_grads, layer)
    want_loss, want = loss_and_grads(lambda xi: plain_moe(layer, xi)[0])
    # fp32 both ways, sums in different orders: ~1e-6 relative; 1e-4 of each tensor's largest entry.
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-7)
    names = ["x"] + [n for n, p in layer.named_parameters() if p.requires_grad]
    for name, g, w in zip(names, got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4 * w.abs().max().item() + 1e-12, msg=name)


# ----------------------------------------------------------------------------- torch.compile


class TiledTrainableMoE(torch.nn.Module):
    """A layer with no host synchronization (one bmm per tile), so the whole training step is
    one graph: route_and_layout, gather and combine in it, with their backward."""

    def __init__(self, preset, hidden, tile_size, seed=0):
        super().__init__()
        cfg = sy.presets[preset]
        g = seeded(seed)
        E = cfg.num_experts
        self.preset, self.tile_size = preset, tile_size
        self.router = torch.nn.Parameter(torch.randn(E, hidden, generator=g) / hidden ** 0.5)
        self.w = torch.nn.Parameter(torch.randn(E, hidden, hidden, generator=g) / hidden ** 0.5)

    def forward(self, x):
        logits = x @ self.router.t()
        _, weights, lay = sy.route_and_layout(logits, self.preset, tile_size=self.tile_size)
        x_perm = sy.gather(x, lay, zero_fill_padding=True)
        tiles_cap, hidden = lay.tile_expert.shape[0], x.shape[1]
        padded = F.pad(x_perm, (0, 0, 0, tiles_cap * self.tile_size - x_perm.shape[0]))
        tiles = padded.view(tiles_cap, self.tile_size, hidden)
        y_perm = torch.bmm(tiles, self.w[lay.tile_expert.clamp(min=0).long()]).view(-1, hidden)
        return sy.combine(y_perm, lay, weights)


def training_step(layer, x, target):
    out = layer(x)
    return F.mse_loss(out, target) + 1e-3 * sy.z_loss(x @ layer.router.t())


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_training_step_matches_eager(backend, device):
    layer = TiledTrainableMoE("mixtral-8x7b", 16, 4).to(device)
    x = torch.randn(20, 16, generator=seeded(1)).to(device).requires_grad_()
    target = torch.randn(20, 16, generator=seeded(2)).to(device)
    params = [x] + list(layer.parameters())

    loss = training_step(layer, x, target)
    want = torch.autograd.grad(loss, params)

    torch._dynamo.reset()
    compiled = torch.compile(training_step, fullgraph=True, backend=backend)
    start = time.perf_counter()
    try:
        got_loss = compiled(layer, x, target)
    except Exception as e:  # noqa: BLE001 - a missing C++ toolchain shows up here for inductor
        if backend == "inductor":
            pytest.skip(f"inductor could not compile on this machine: {type(e).__name__}: {str(e)[:200]}")
        raise
    got = torch.autograd.grad(got_loss, params)
    elapsed = time.perf_counter() - start
    torch.testing.assert_close(got_loss, loss, rtol=1e-5, atol=1e-6)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    print(f"torch.compile({backend}) training step: first call with backward {elapsed:.1f} s")


def test_example_trains_like_plain_pytorch():
    result = subprocess.run([sys.executable, str(EXAMPLE), "--preset", "mixtral-8x7b", "--tokens", "32", "--hidden",
                             "16", "--intermediate", "8", "--device", "cpu", "--train-steps", "4"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    summary = result.stdout.strip().splitlines()[-1]
    assert "went down: True" in summary, result.stdout
    assert float(summary.rsplit(" ", 1)[-1]) < 1e-4, result.stdout  # largest relative difference
