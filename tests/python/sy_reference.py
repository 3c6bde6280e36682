"""Plain PyTorch references written from docs/design.md (sections 2-4), independent of Switchyard:
softmax / sigmoid, stable sort for the top-K, stable sort for the layout, index_select for
gather, a weighted sum for combine. Routing runs in float64 and reports, per row, how far the
decision was from a tie, so tests compare ids exactly only where fp32 rounding cannot flip them.
"""

import math

import torch


def pre_scores(logits, pre):
    s = logits.double()
    if pre == "none":
        return s
    if pre == "softmax":
        return torch.softmax(s, dim=-1)
    if pre == "sigmoid":
        return torch.sigmoid(s)
    if pre == "sqrtsoftplus":
        return torch.sqrt(torch.nn.functional.softplus(s))
    raise ValueError(pre)


def _gap_margin(sorted_desc, upto):
    """Smallest non-zero gap between consecutive sorted values in positions [0, upto]; exact
    ties (gap 0) are fine: both sides break them by the lower index."""
    cols = min(upto + 1, sorted_desc.shape[-1])
    v = sorted_desc[..., :cols]
    if cols < 2:
        return torch.full(v.shape[:-1], math.inf, dtype=torch.float64)
    gaps = (v[..., :-1] - v[..., 1:]).abs()
    gaps = torch.where(gaps == 0, torch.full_like(gaps, math.inf), gaps)
    return gaps.min(dim=-1).values


def route(logits, cfg, bias=None):
    """(ids int64 [T,K], weights float64 [T,K], margin float64 [T]) for finite logits."""
    T, E = logits.shape
    K = cfg.top_k
    p = pre_scores(logits, cfg.pre)
    q = p + (bias.double() if bias is not None else 0.0)
    margin = torch.full((T,), math.inf, dtype=torch.float64)
    if cfg.group_rule != "none":
        G = cfg.n_group
        qg = q.view(T, G, E // G)
        desc = torch.sort(qg, dim=-1, descending=True, stable=True).values
        if cfg.group_rule == "top2_sum":
            score = desc[..., :2].sum(-1)
        elif cfg.group_rule == "max":
            score = desc[..., 0]
        else:  # topk_sum
            score = desc[..., : K // cfg.topk_group].sum(-1)
        gs = torch.sort(score, dim=-1, descending=True, stable=True)
        kept = gs.indices[:, : cfg.topk_group]
        # Only the boundary between the last kept and the first dropped group matters.
        if cfg.topk_group < G:
            boundary = gs.values[:, cfg.topk_group - 1] - gs.values[:, cfg.topk_group]
            boundary = torch.where(boundary == 0, torch.full_like(boundary, math.inf), boundary)
            margin = torch.minimum(margin, boundary)
        group_mask = torch.zeros(T, G, dtype=torch.bool)
        group_mask.scatter_(1, kept, True)
        mask = group_mask.repeat_interleave(E // G, dim=1)
        q = q.masked_fill(~mask, -math.inf)
    order = torch.sort(q, dim=-1, descending=True, stable=True)
    ids = order.indices[:, :K]
    finite = torch.isfinite(order.values)
    sorted_q = torch.where(finite, order.values, torch.full_like(order.values, -1e300))
    margin = torch.minimum(margin, _gap_margin(sorted_q, K))
    sel = p.gather(1, ids)
    if cfg.post == "none":
        w = sel
    elif cfg.post == "softmax":
        w = torch.softmax(sel, dim=-1)
    elif cfg.post == "sigmoid":
        w = torch.sigmoid(sel)
    else:  # normalize
        w = sel / (sel.sum(-1, keepdim=True) + 1e-20)
    return ids, w * cfg.scale, margin


def safe_rows(margin, values_scale=1.0, tol=1e-5):
    """Rows whose routing decisions are at least `tol` (relative) away from any near tie."""
    return margin > tol * max(values_scale, 1.0)


class RefLayout:
    pass


def layout(topk_ids, num_experts, tile_size, local_start=0, local_count=-1, local_stride=1, expert_map=None):
    """The layout of docs/design.md section 3, from a stable sort of the local expert index."""
    T, K = topk_ids.shape
    E, M = num_experts, tile_size
    L = num_experts if local_count < 0 else local_count
    flat = topk_ids.reshape(-1).long().cpu()
    in_range = (flat >= 0) & (flat < E)
    if expert_map is not None:
        m = expert_map.long().cpu()
        lid = torch.where(in_range, m[flat.clamp(0, E - 1)], torch.full_like(flat, -1))
        lid = torch.where((lid >= 0) & (lid < L), lid, torch.full_like(lid, -1))
    else:
        rel = flat - local_start
        ok = in_range & (rel >= 0) & (rel % local_stride == 0) & (rel // local_stride < L)
        lid = torch.where(ok, rel // local_stride, torch.full_like(flat, -1))
    placed = lid >= 0
    counts = torch.bincount(lid[placed], minlength=L)[:L] if L > 0 else torch.zeros(0, dtype=torch.long)
    padded = (counts + M - 1) // M * M
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(padded, 0)])
    padded_total = int(offsets[-1])
    picks = T * K
    rows = picks + min(L, picks) * (M - 1) if (T > 0 and L > 0) else 0
    tiles = (rows + M - 1) // M
    key = torch.where(placed, lid, torch.full_like(lid, L))
    order = torch.sort(key, stable=True).indices  # ascending x within each expert
    p2x = torch.full((rows,), picks, dtype=torch.long)
    start = 0
    for l in range(L):
        c = int(counts[l])
        o = int(offsets[l])
        p2x[o : o + c] = order[start : start + c]
        start += c
    p2t = torch.where(p2x == picks, torch.full_like(p2x, T), p2x // K)
    x2p = torch.full((picks,), -1, dtype=torch.long)
    real = p2x < picks
    x2p[p2x[real]] = torch.arange(rows)[real]
    num_tiles = padded_total // M
    tile_expert = torch.full((tiles,), -1, dtype=torch.long)
    tile_row_end = torch.arange(tiles, dtype=torch.long) * M
    for l in range(L):
        o, c = int(offsets[l]), int(counts[l])
        for i in range(o // M, int(offsets[l + 1]) // M):
            tile_expert[i] = l
            tile_row_end[i] = min((i + 1) * M, o + c)
    dropped = int((~in_range & (flat != -1)).sum())
    r = RefLayout()
    r.counts = counts
    r.offsets = offsets
    r.permuted_to_expanded = p2x
    r.permuted_to_token = p2t
    r.expanded_to_permuted = x2p.view(T, K)
    r.tile_expert = tile_expert
    r.tile_row_end = tile_row_end
    r.totals = torch.tensor([padded_total, num_tiles, dropped])
    return r


def gather(x, permuted_to_token, padded_total, out, zero_fill_padding):
    """Reference gather into a copy of `out` (rows the operation must not touch stay)."""
    T = x.shape[0]
    res = out.clone()
    p2t = permuted_to_token[:padded_total].long().to(x.device)
    holds = p2t < T
    rows = torch.arange(padded_total, device=x.device)[holds]
    res[rows] = torch.index_select(x, 0, p2t[holds])
    if zero_fill_padding:
        res[torch.arange(padded_total, device=x.device)[~holds]] = 0
    return res


def combine(y_perm, expanded_to_permuted, weights, out_dtype, accumulate_into=None):
    """Weighted sum over placed picks, in float64 (the caller compares with a tolerance)."""
    T, K = expanded_to_permuted.shape
    H = y_perm.shape[1]
    acc = torch.zeros(T, H, dtype=torch.float64, device=y_perm.device)
    for k in range(K):
        rows = expanded_to_permuted[:, k].long()
        placed = rows >= 0
        contrib = torch.index_select(y_perm.double(), 0, rows.clamp(min=0))
        w = weights[:, k].double().unsqueeze(1) if weights is not None else torch.ones(T, 1, dtype=torch.float64,
                                                                                         device=y_perm.device)
        acc += torch.where(placed.unsqueeze(1), w * contrib, torch.zeros_like(contrib))
    if accumulate_into is not None:
        acc += accumulate_into.double()
    return acc.to(out_dtype)
