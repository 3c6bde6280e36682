"""switchyard-bench --ep: expert-parallel dispatch and combine of a LoopbackGroup (R ranks on
one GPU), next to what a PyTorch user does today on the same GPU.

One call is a round: every rank's dispatch (or combine), the ranks' kernels running together on
the GPU. Ours: LoopbackGroup.dispatch straight into the expert-major layout, and combine of the
expert rows (identity experts: y = expert_x), timed like the other operations (CUDA graph of
the round, replayed with events). PyTorch: per source rank, the (token, destination rank) pairs
ordered by destination (nonzero), the rows gathered into a send buffer, the all_to_all_single of
a real run done as copies of each (source, destination) chunk into the destination's receive
buffer, then the local permutation (stable sort of the received (row, local expert) pairs,
index_select); combine: the expert rows weighted and summed per received row (index_add_),
copied back, and summed per token at the source (index_add_). It needs the split sizes on the
host, as all_to_all_single does, so it cannot be captured and is timed eagerly.

Bytes are counted as DeepEP counts them: a token once per destination rank, its row (H x dtype
bytes) for dispatch and H x 2 for combine; GB/s is the R ranks' bytes over the round's time.
All traffic of a loopback group goes through one GPU's memory; NVLink figures need several GPUs.
"""

from __future__ import annotations

import argparse
from typing import Any, Dict, List, Sequence, Tuple

EP_SHAPES = {  # hidden, experts, top-k
    "deepseek-v3": (7168, 256, 8),
    "qwen3-235b-a22b": (4096, 128, 8),
}
EP_TOKENS = [128, 4096]
EP_RANKS = 4
EP_NOTE = ("ours: LoopbackGroup dispatch into the expert-major layout / combine of identity experts (fp32 "
           "partials); torch: nonzero + index_select send buffers, chunk copies for all_to_all_single, stable sort "
           "+ index_select for the local permutation; combine: index_add_ per received row, copies back, "
           "index_add_ per token")


def destinations(torch: Any, ids: Any, R: int, L: int) -> Any:
    """[T,R] bool: whether token t goes to rank d (one of its ids is among d's L experts)."""
    dest = torch.where(ids >= 0, ids // L, R).long()  # R: no destination
    mask = torch.zeros(ids.shape[0], R + 1, dtype=torch.bool, device=ids.device)
    mask.scatter_(1, dest, True)
    return mask[:, :R]


class TorchEp:
    """The PyTorch user's expert-parallel path on one GPU for R simulated ranks (see the module
    docstring); dispatch() keeps what combine() needs."""

    def __init__(self, torch: Any, R: int, L: int) -> None:
        self.torch, self.R, self.L = torch, R, L

    def _chunk(self, s: int, d: int) -> Tuple[int, int, int]:
        """Source s's chunk for destination d: where it starts in s's send buffer and in d's
        receive buffer, and its rows."""
        return sum(self.splits[s][:d]), sum(self.splits[q][d] for q in range(s)), self.splits[s][d]

    def dispatch(self, xs: Sequence[Any], ids: Sequence[Any], ws: Sequence[Any]) -> List[Any]:
        """Every rank's expert-major rows (ordered by local expert, then received row)."""
        torch, R, L = self.torch, self.R, self.L
        sends, self.splits, self.src_tokens = [], [], []
        self.tokens = [x.shape[0] for x in xs]
        for x, i, w in zip(xs, ids, ws):
            mask = destinations(torch, i, R, L)
            d_idx, t_idx = mask.t().nonzero(as_tuple=True)  # ordered by destination, then token
            sends.append([x.index_select(0, t_idx), i.index_select(0, t_idx), w.index_select(0, t_idx)])
            self.splits.append(torch.bincount(d_idx, minlength=R).tolist())  # all_to_all_single's splits
            self.src_tokens.append(t_idx)
        expert_x, self.recv = [], []
        for d in range(R):
            recv = [torch.cat([sends[s][j][self._chunk(s, d)[0]:self._chunk(s, d)[0] + self.splits[s][d]]
                               for s in range(R)]) for j in range(3)]
            local = recv[1] - d * L
            rows, ks = ((local >= 0) & (local < L)).nonzero(as_tuple=True)
            order = torch.sort(local[rows, ks], stable=True).indices
            rows, ks = rows[order], ks[order]
            expert_x.append(recv[0].index_select(0, rows))
            self.recv.append((recv[0].shape[0], rows, recv[2][rows, ks]))
        return expert_x

    def combine(self, ys: Sequence[Any], out_dtype: Any) -> List[Any]:
        """Every rank's tokens: the expert rows ys[d] (dispatch's order) weighted, summed per
        received row, sent back and summed per token, in fp32."""
        torch, R = self.torch, self.R
        partials = []
        for d in range(R):
            n, rows, w = self.recv[d]
            p = torch.zeros(n, ys[d].shape[1], dtype=torch.float32, device=ys[d].device)
            p.index_add_(0, rows, ys[d][: rows.shape[0]].float() * w[:, None])
            partials.append(p.to(out_dtype))
        outs = []
        for s in range(R):
            back = torch.cat([partials[d][self._chunk(s, d)[1]:self._chunk(s, d)[1] + self.splits[s][d]]
                              for d in range(R)])
            acc = torch.zeros(self.tokens[s], ys[0].shape[1], dtype=torch.float32, device=ys[0].device)
            acc.index_add_(0, self.src_tokens[s], back.float())
            outs.append(acc.to(out_dtype))
        return outs


def _pairs(torch: Any, ids: Any, R: int, L: int) -> int:
    """(token, destination rank) pairs of one rank's ids."""
    return int(destinations(torch, ids, R, L).sum())


def run_point(ctx: Any, shape: str, T: int, R: int, dtype_name: str) -> List[Dict[str, Any]]:
    """The dispatch and combine points of one (shape, tokens per rank, ranks)."""
    from .bench import _dtype, make_hidden, make_ids, timing_fields  # noqa: PLC0415 - bench imports this module
    import switchyard.ep as ep  # noqa: PLC0415

    torch = ctx.torch
    H, E, K = EP_SHAPES[shape]
    L = E // R
    dtype = _dtype(torch, dtype_name)
    xs = [make_hidden(torch, T, H, dtype_name, 11 + r, "cuda") for r in range(R)]
    ids = [make_ids(torch, T, E, K, "uniform", 101 + r, "cuda") for r in range(R)]
    ws = [torch.rand(T, K, device="cuda") for _ in range(R)]
    pairs = sum(_pairs(torch, i, R, L) for i in ids)
    group = ep.LoopbackGroup(R, E, K, T, H, dtype=dtype, tile_size=ctx.tile_size, device="cuda")
    base = {"shape": shape, "R": R, "tokens": T, "hidden": H, "experts": E, "top_k": K, "dtype": dtype_name,
            "pairs": pairs, "region_bytes": group.region_bytes, "handle_bytes": group.handle_bytes}
    row_bytes = H * dtype.itemsize

    def ours_dispatch(_: int) -> Any:
        return [group.dispatch(r, xs[r], ids[r], ws[r]) for r in range(R)]

    ds = ours_dispatch(0)

    def ours_combine(_: int) -> Any:
        return [group.combine(r, ds[r].handle, ds[r].expert_x) for r in range(R)]

    ref = TorchEp(torch, R, L)

    def torch_dispatch(_: int) -> Any:
        return ref.dispatch(xs, ids, ws)

    ref_x = torch_dispatch(0)

    def torch_combine(_: int) -> Any:
        return ref.combine(ref_x, dtype)

    # Checks: rows received per rank, and the combined tokens (identity experts: sum of w x over
    # the token's picks, summed in another order: bf16 tolerance).
    ours_out = ours_combine(0)
    theirs_out = torch_combine(0)
    group.synchronize()
    rows_ok = all(ds[d].rows == ref.recv[d][0] for d in range(R))
    err = max(float((a.float() - b.float()).abs().max()) for a, b in zip(ours_out, theirs_out))
    scale = max(float(b.float().abs().max()) for b in theirs_out)
    check = "ok" if rows_ok and err <= 2e-2 * max(scale, 1.0) else (
        f"DIFFERS: rows {'ok' if rows_ok else 'differ'}, max abs error {err:.3g}")

    points = []
    for op, ours_fn, torch_fn, nbytes in (("ep_dispatch", ours_dispatch, torch_dispatch, pairs * row_bytes),
                                          ("ep_combine", ours_combine, torch_combine, pairs * H * 2)):
        p = dict(base, op=op, bytes=float(nbytes), check=check)
        ours = ctx.timer.time(ours_fn)
        group.synchronize()
        p.update(timing_fields(ours, ctx.max_spread))
        p["gbps"] = nbytes / (ours["median_us"] * 1e-6) / 1e9
        p["pct_copy"] = 100.0 * p["gbps"] * 1e9 / ctx.copy_bw
        if ctx.baseline:  # its split sizes go through the host: no graph capture
            theirs = ctx.timer.time_eager(torch_fn)
            torch.cuda.synchronize()
            p.update(timing_fields(theirs, ctx.max_spread, "torch_"))
            p["speedup"] = theirs["median_us"] / ours["median_us"]
        points.append(p)
    del ds, group, ours_dispatch, ours_combine, ours_out, theirs_out, ref, ref_x
    return points


def markdown_table(points: List[Dict[str, Any]]) -> str:
    from .bench import _fmt_us  # noqa: PLC0415

    lines = ["| shape | op | R | T / rank | ours us (p10-p90) | torch us | speedup | DeepEP MB | GB/s | % copy | "
             "check |", "|" + "---|" * 11]
    for p in points:
        if "median_us" not in p:
            lines.append(f"| {p['shape']} | {p.get('op', '-')} | {p['R']} | {p['tokens']} | "
                         f"{p.get('error', 'error')[:80]} | - | - | - | - | - | - |")
            continue
        ours = f"{_fmt_us(p['median_us'])} ({_fmt_us(p['p10_us'])}-{_fmt_us(p['p90_us'])})"
        if p.get("unstable"):
            ours += " UNSTABLE"
        torch_us = _fmt_us(p.get("torch_median_us")) + ("?" if p.get("torch_unstable") else "") \
            if "torch_median_us" in p else "-"
        speed = f"{p['speedup']:.1f}x" if "speedup" in p else "-"
        lines.append(f"| {p['shape']} | {p['op']} | {p['R']} | {p['tokens']} | {ours} | {torch_us} | {speed} | "
                     f"{p['bytes'] / 1e6:.1f} | {p['gbps']:.0f} | {p['pct_copy']:.0f}% | {p['check']} |")
    return "\n".join(lines)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--ep", action="store_true",
                    help="expert parallelism instead: LoopbackGroup dispatch / combine rounds on one GPU against "
                         "the PyTorch equivalent (uses --tokens as tokens per rank, --tile-size, --json, --plot)")
    ap.add_argument("--ep-ranks", type=int, default=EP_RANKS, help=f"simulated ranks for --ep (default {EP_RANKS})")
    ap.add_argument("--ep-shapes", default=",".join(EP_SHAPES),
                    help="comma-separated, for --ep: " + ", ".join(f"{k} (H={v[0]}, E={v[1]}, K={v[2]})"
                                                               for k, v in EP_SHAPES.items()))
