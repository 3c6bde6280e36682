"""Router statistics and losses (switchyard.losses) against the formulas written out by hand
with Python loops, their gradients (gradcheck in fp64) and the aux-loss-free bias update."""

import math

import pytest

from sy_testing import require_torch, seeded

torch = require_torch()

import switchyard as sy  # noqa: E402


def test_tokens_per_expert_from_layout_and_ids():
    cfg = sy.presets["deepseek-v3"]
    logits = torch.randn(37, cfg.num_experts, generator=seeded(0))
    ids, _, lay = sy.route_and_layout(logits, cfg, tile_size=16)
    counts = sy.tokens_per_expert(lay)
    assert counts is lay.counts and counts.dtype == torch.int32
    want = [0] * cfg.num_experts
    for e in ids.reshape(-1).tolist():
        want[e] += 1
    assert counts.tolist() == want
    assert sy.tokens_per_expert(ids, cfg.num_experts).tolist() == want
    # ids outside [0, E) (-1: not routed) are not counted
    odd = torch.tensor([[0, -1], [3, 3], [5, 1]])
    assert sy.tokens_per_expert(odd, 4).tolist() == [1, 1, 0, 2]
    with pytest.raises(ValueError, match="num_experts"):
        sy.tokens_per_expert(ids)


@pytest.mark.parametrize("name", ["mixtral-8x7b", "deepseek-v3", "deepseek-v2"])
def test_router_probs(name):
    cfg = sy.presets[name]
    logits = torch.randn(5, cfg.num_experts, generator=seeded(1))
    p = sy.router_probs(logits, cfg)
    torch.testing.assert_close(p.sum(-1), torch.ones(5))
    if cfg.pre == "sigmoid":
        s = torch.sigmoid(logits)
        torch.testing.assert_close(p, s / s.sum(-1, keepdim=True))
    else:
        torch.testing.assert_close(p, torch.softmax(logits, -1))


def hand_load_balancing(probs, ids, E, K):
    T = len(probs)
    total = 0.0
    for e in range(E):
        f = sum(1 for t in range(T) for k in range(K) if ids[t][k] == e) / (T * K)
        P = sum(probs[t][e] for t in range(T)) / T
        total += f * P
    return E * total


@pytest.mark.parametrize("name", ["mixtral-8x7b", "qwen3-235b-a22b", "llama4-maverick"])
def test_load_balancing_loss_matches_hand_formula(name):
    cfg = sy.presets[name]
    T = 19
    logits = torch.randn(T, cfg.num_experts, generator=seeded(2), dtype=torch.float64)
    ids, _, lay = sy.route_and_layout(logits.float(), cfg)
    probs = torch.softmax(logits, -1)
    got = sy.load_balancing_loss(probs, sy.tokens_per_expert(lay), cfg.top_k)
    want = hand_load_balancing(probs.tolist(), ids.tolist(), cfg.num_experts, cfg.top_k)
    assert math.isclose(got.item(), want, rel_tol=1e-6)
    # A uniform router gives 1.
    uniform = torch.full((T, cfg.num_experts), 1.0 / cfg.num_experts)
    flat = torch.full((cfg.num_experts,), T * cfg.top_k / cfg.num_experts)
    assert math.isclose(sy.load_balancing_loss(uniform, flat, cfg.top_k).item(), 1.0, rel_tol=1e-6)


def test_load_balancing_loss_gradient():
    cfg = sy.presets["mixtral-8x7b"]
    logits = torch.randn(9, 8, generator=seeded(3), dtype=torch.float64, requires_grad=True)
    ids, _ = sy.route(logits.detach().float(), cfg)
    counts = sy.tokens_per_expert(ids, 8)
    assert torch.autograd.gradcheck(lambda s: sy.load_balancing_loss(torch.softmax(s, -1), counts, 2).double(),
                                    (logits,))
    # d/dprobs[t,e] = E * f_e / T: only probs carry the gradient.
    probs = torch.softmax(logits.detach(), -1).requires_grad_()
    sy.load_balancing_loss(probs, counts, 2).backward()
    want = (8 * counts.double() / (9 * 2) / 9).expand(9, 8)
    torch.testing.assert_close(probs.grad.double(), want, rtol=1e-6, atol=1e-9)


def test_sequence_load_balancing_loss_matches_hand_formula():
    cfg = sy.presets["deepseek-v3"]
    B, S, E, K = 3, 11, cfg.num_experts, cfg.top_k
    logits = torch.randn(B * S, E, generator=seeded(4))
    ids, _ = sy.route(logits, cfg)
    probs = sy.router_probs(logits, cfg)
    got = sy.sequence_load_balancing_loss(probs, ids, seq_len=S)
    got3 = sy.sequence_load_balancing_loss(probs.view(B, S, E), ids.view(B, S, K))
    want = 0.0
    pl, il = probs.double().tolist(), ids.tolist()
    for b in range(B):
        rows = range(b * S, (b + 1) * S)
        loss = 0.0
        for i in range(E):
            f = E / (K * S) * sum(1 for t in rows for k in range(K) if il[t][k] == i)
            P = sum(pl[t][i] for t in rows) / S
            loss += f * P
        want += loss / B
    assert math.isclose(got.item(), want, rel_tol=1e-5)
    assert math.isclose(got3.item(), want, rel_tol=1e-5)
    # One sequence: the Switch / GShard form.
    one = sy.sequence_load_balancing_loss(probs, ids)
    full = sy.load_balancing_loss(probs, sy.tokens_per_expert(ids, E), K)
    assert math.isclose(one.item(), full.item(), rel_tol=1e-5)
    with pytest.raises(ValueError, match="seq_len"):
        sy.sequence_load_balancing_loss(probs, ids, seq_len=5)


def test_sequence_load_balancing_loss_gradient():
    cfg = sy.presets["dbrx"]
    logits = torch.randn(12, cfg.num_experts, generator=seeded(5), dtype=torch.float64, requires_grad=True)
    ids, _ = sy.route(logits.detach().float(), cfg)
    assert torch.autograd.gradcheck(
        lambda s: sy.sequence_load_balancing_loss(torch.softmax(s, -1).double(), ids, seq_len=4).double(),
        (logits,))


def test_z_loss_matches_hand_formula_and_gradient():
    logits = torch.randn(7, 16, generator=seeded(6), dtype=torch.float64)
    want = sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in logits.tolist()) / 7
    assert math.isclose(sy.z_loss(logits).item(), want, rel_tol=1e-6)
    s = logits.clone().requires_grad_()
    sy.z_loss(s).backward()
    lse = torch.logsumexp(logits, -1, keepdim=True)
    torch.testing.assert_close(s.grad, (2 * lse * torch.softmax(logits, -1) / 7), rtol=1e-5, atol=1e-7)


def test_update_expert_bias():
    bias = torch.tensor([0.1, 0.0, -0.2, 0.3])
    counts = torch.tensor([10, 2, 4, 4], dtype=torch.int32)  # mean 5
    got = sy.update_expert_bias(bias, counts, rate=0.01)
    assert got is bias
    torch.testing.assert_close(bias, torch.tensor([0.1 - 0.01, 0.01, -0.2 + 0.01, 0.3 + 0.01]))
    at_mean = torch.zeros(3)
    sy.update_expert_bias(at_mean, torch.tensor([2, 2, 2]), rate=1.0)
    assert at_mean.tolist() == [0.0, 0.0, 0.0]
    bf = torch.zeros(4, dtype=torch.bfloat16)
    sy.update_expert_bias(bf, counts, rate=0.5)
    assert bf.tolist() == [-0.5, 0.5, 0.5, 0.5]
    with pytest.raises(ValueError, match="counts"):
        sy.update_expert_bias(bias, counts[:3], 0.1)


def test_bias_update_balances_a_skewed_router():
    """The aux-loss-free rule spreads the load: after a few hundred updates the busiest expert
    carries far less than at the start (a fixed skewed router, only the bias moves)."""
    cfg = sy.presets["glm-4.5"]
    E = cfg.num_experts
    logits = torch.randn(256, E, generator=seeded(7)) + torch.linspace(0, 2, E)  # high experts favoured
    bias = torch.zeros(E)
    first = None
    for _ in range(300):
        ids, _ = sy.route(logits, cfg, bias)
        counts = sy.tokens_per_expert(ids, E)
        first = counts.max().item() if first is None else first
        sy.update_expert_bias(bias, counts, rate=1e-3)
    mean = 256 * cfg.top_k / E
    assert counts.max().item() < 0.5 * first and counts.max().item() < 3 * mean
