"""switchyard.ep: the CPU reference group from Python (ranks as threads), checked against a
brute-force reference of docs/design.md section 6 written here."""

import pytest

from sy_testing import require_torch

torch = require_torch()

import switchyard as sy  # noqa: E402
import switchyard.ep as ep  # noqa: E402


def make_inputs(R, E, K, T, H, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    xs, ids, ws = [], [], []
    for r in range(R):
        t = T[r]
        xs.append(torch.randn(t, H, generator=g).to(dtype))
        idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)]) if t else torch.empty(0, K)
        idx = idx.to(torch.int32)
        if t:
            idx[0, -1] = -1  # a token with one pick less
        ids.append(idx)
        ws.append(torch.rand(t, K, generator=g))
    return xs, ids, ws


def reference_dispatch(R, L, xs, ids, ws, d):
    """Rank d's rank-major rows: (src_rank, src_token, local ids, weights, x row)."""
    rows = []
    for s in range(R):
        for t in range(xs[s].shape[0]):
            e = ids[s][t].tolist()
            if any(0 <= v < R * L and v // L == d for v in e):
                local = [v - d * L if (0 <= v < R * L and v // L == d) else -1 for v in e]
                rows.append((s, t, local, ws[s][t], xs[s][t]))
    return rows


@pytest.mark.parametrize("R,L,K", [(1, 4, 2), (3, 2, 2), (4, 4, 3)])
def test_dispatch_and_combine_match_reference(R, L, K):
    E, H, M = R * L, 24, 3
    T = [5 + r % 3 for r in range(R)]
    xs, ids, ws = make_inputs(R, E, K, T, H, seed=R * 100 + K)
    group = ep.CpuGroup(R, E, K, max_tokens=max(T), hidden=H, dtype=torch.float32, tile_size=M)

    def step(rank):
        d = group.dispatch(rank, xs[rank], ids[rank], ws[rank])
        # "Experts": expert l scales its rows by (l + 1); y has the expert-major rows.
        y = d.expert_x.clone()
        offsets = d.layout.offsets.tolist()
        for l in range(L):
            y[offsets[l]:offsets[l + 1]] *= l + 1
        return d, group.combine(rank, d.handle, y)

    results = ep.run_ranks(R, step)
    for rank, (d, out) in enumerate(results):
        ref = reference_dispatch(R, L, xs, ids, ws, rank)
        assert d.rows == len(ref)
        assert d.src_rank.tolist() == [r[0] for r in ref]
        assert d.src_token.tolist() == [r[1] for r in ref]
        assert d.topk_ids.tolist() == [r[2] for r in ref]
        if ref:
            assert torch.equal(d.topk_weights, torch.stack([r[3] for r in ref]))
            assert torch.equal(d.x, torch.stack([r[4] for r in ref]))
        assert d.sent == sum(1 for t in range(T[rank]) for dd in range(R)
                             if any(0 <= v < E and v // L == dd for v in ids[rank][t].tolist()))
        # Combine: sum over k of w * x * (local expert + 1), fp32; the order differs from the
        # library's (per-rank fma chains summed in rank order), so compare with a tolerance.
        want = torch.zeros(T[rank], H)
        for t in range(T[rank]):
            for k, v in enumerate(ids[rank][t].tolist()):
                if v >= 0:
                    want[t] += ws[rank][t, k] * xs[rank][t] * (v % L + 1)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_one_rank_equals_layout_gather_combine():
    E, K, T, H, M = 6, 2, 9, 16, 4
    xs, ids, ws = make_inputs(1, E, K, [T], H, seed=7)
    group = ep.CpuGroup(1, E, K, max_tokens=T, hidden=H, dtype=torch.float32, tile_size=M)
    d = group.dispatch(0, xs[0], ids[0], ws[0])
    y = torch.randn(d.expert_x.shape)
    out = group.combine(0, d.handle, y)
    lay = sy.layout(ids[0], num_experts=E, tile_size=M)
    want = sy.combine(y[: lay.permuted_to_token.shape[0]], lay, ws[0])
    assert torch.equal(out, want)


def test_bad_argument_on_one_rank_fails_every_rank():
    R, E, K, H = 3, 6, 2, 8
    xs, ids, ws = make_inputs(R, E, K, [4, 4, 4], H, seed=3)
    xs[1] = xs[1][:, :-1]  # wrong hidden size on rank 1
    group = ep.CpuGroup(R, E, K, max_tokens=4, hidden=H, dtype=torch.float32)
    errors = []

    def step(rank):
        try:
            group.dispatch(rank, xs[rank], ids[rank], ws[rank])
        except ValueError as e:
            errors.append(str(e))

    ep.run_ranks(R, step)
    assert len(errors) == R
    assert all("rank 1" in e and "'in.x'" in e for e in errors), errors


def test_missing_rank_times_out():
    R, E, K, H = 2, 4, 1, 8
    xs, ids, ws = make_inputs(R, E, K, [2, 2], H, seed=5)
    group = ep.CpuGroup(R, E, K, max_tokens=2, hidden=H, dtype=torch.float32, timeout_seconds=0.2)
    with pytest.raises(TimeoutError, match="rank"):
        group.dispatch(0, xs[0], ids[0], ws[0])  # rank 1 never comes
    assert group.broken_reason
    with pytest.raises(TimeoutError):
        group.dispatch(0, xs[0], ids[0], ws[0])


def test_bad_config_names_the_field():
    with pytest.raises(ValueError, match="num_experts"):
        ep.CpuGroup(3, 7, 2, max_tokens=4, hidden=8)
    with pytest.raises(ValueError, match="scale_cols"):
        ep.CpuGroup(2, 4, 2, max_tokens=4, hidden=8, dtype=torch.bfloat16, scale_cols=1)


def test_rank_major_combine_and_reuse():
    R, L, K, H = 3, 2, 2, 8
    E = R * L
    T = [4, 6, 5]
    xs, ids, ws = make_inputs(R, E, K, T, H, seed=11)
    group = ep.CpuGroup(R, E, K, max_tokens=max(T), hidden=H, dtype=torch.float32)

    def step(rank):
        d = group.dispatch(rank, xs[rank], ids[rank], ws[rank], expert_major=False)
        assert d.layout is None and d.expert_x is None
        # Rank-major combine: one already-reduced row per received row; here 2 * x.
        out = group.combine(rank, d.handle, 2 * d.x, expert_major=False)
        # The same routing again with reuse and new weights: the same rows come back.
        d2 = group.dispatch(rank, xs[rank], ids[rank], ws[rank] * 0.5, expert_major=False, handle=d.handle,
                            reuse=True)
        return d, d2, out

    results = ep.run_ranks(R, step)
    for rank, (d, d2, out) in enumerate(results):
        # Each token comes back once from every rank it went to: 2 * x * (number of such ranks).
        went = torch.tensor([sum(1 for dd in range(R) if any(0 <= v < E and v // L == dd
                                                                 for v in ids[rank][t].tolist()))
                             for t in range(T[rank])], dtype=torch.float32)
        torch.testing.assert_close(out, 2 * xs[rank] * went[:, None], rtol=0, atol=1e-6)
        assert torch.equal(d2.x, d.x) and torch.equal(d2.src_token, d.src_token)
        assert torch.equal(d2.topk_weights, d.topk_weights * 0.5)


def test_reuse_with_changed_routing_is_refused_on_every_rank():
    R, E, K, H = 2, 4, 2, 8
    xs, ids, ws = make_inputs(R, E, K, [3, 3], H, seed=13)
    group = ep.CpuGroup(R, E, K, max_tokens=3, hidden=H, dtype=torch.float32)
    first = ep.run_ranks(R, lambda r: group.dispatch(r, xs[r], ids[r], ws[r]))
    changed = [ids[0].flip(1), ids[1]]  # rank 0's picks in another order
    errors = []

    def step(rank):
        try:
            group.dispatch(rank, xs[rank], changed[rank], ws[rank], handle=first[rank].handle, reuse=True)
        except ValueError as e:
            errors.append(str(e))

    ep.run_ranks(R, step)
    assert len(errors) == R and all("rank 0" in e and "topk_ids" in e for e in errors), errors
