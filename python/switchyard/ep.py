"""Expert parallelism (docs/design.md section 6; include/switchyard/ep.h): the CPU reference group.

R ranks are R Python threads of one process. Each rank calls dispatch (and later combine) once
per step with its own tensors; a call returns when the step is complete on every rank. Outputs
are what the GPU transport will produce, so this is the oracle to develop and test an engine's
expert-parallel path against without several GPUs::

    import torch, switchyard.ep as ep
    group = ep.CpuGroup(num_ranks=4, num_experts=16, top_k=2, max_tokens=64, hidden=128,
                        dtype=torch.float32, tile_size=8)
    def rank_step(rank):
        d = group.dispatch(rank, x[rank], ids[rank], weights[rank])
        y = run_experts(d.expert_x, d.layout)          # grouped GEMM over d.layout's tiles
        return group.combine(rank, d.handle, y)
    outs = ep.run_ranks(4, rank_step)

CPU tensors only. Errors: ValueError / TypeError naming the rank and argument (raised on every
rank when any rank's arguments are bad: nothing is written anywhere), TimeoutError when a rank
does not arrive within timeout_seconds (the group is then broken; build a new one).
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Callable, List, Optional

import torch
from torch import Tensor

from . import _ext
from ._core import check_status, max_tiles
from .ops import _DTYPES, Layout, _layout_view, _view

__all__ = ["CpuGroup", "Dispatched", "Handle", "run_ranks"]

_STATS = (_ext.EP_RECV_ROWS, _ext.EP_SENT_ROWS, _ext.EP_DROPPED)


class Handle:
    """What combine needs from a dispatch (who sent which token where), for one rank."""

    def __init__(self, cpp: Any, tokens: int) -> None:
        self._cpp = cpp
        self.tokens = tokens  # the rank's token count at that dispatch

    @property
    def valid(self) -> bool:
        return bool(self._cpp.valid)


@dataclasses.dataclass
class Dispatched:
    """One rank's dispatch result. Rank-major rows (ordered by source rank, then source token)
    are trimmed to the rows received; the expert-major arrays keep their full capacity (rows
    past layout.padded_total hold sentinels / are unused)."""

    x: Tensor  # [rows, H]
    scales: Optional[Tensor]  # [rows, scale_cols] fp32
    src_rank: Tensor  # [rows] int32
    src_token: Tensor  # [rows] int32
    topk_ids: Tensor  # [rows, K] int32: local expert ids, -1 for experts elsewhere
    topk_weights: Tensor  # [rows, K] fp32
    sent: int  # (token, destination rank) pairs this rank sent
    dropped: int  # this rank's input ids outside [0, E) other than -1
    layout: Optional[Layout]  # expert-major layout of the received rows (None if not asked)
    expert_x: Optional[Tensor]  # [max_expert_rows, H]
    expert_scales: Optional[Tensor]
    handle: Handle  # what combine needs

    @property
    def rows(self) -> int:
        return self.x.shape[0]


class CpuGroup:
    """A group of num_ranks simulated ranks; rank r owns experts [r*L, (r+1)*L), L = E / R."""

    def __init__(self, num_ranks: int, num_experts: int, top_k: int, max_tokens: int, hidden: int,
                 dtype: torch.dtype = torch.bfloat16, scale_cols: int = 0, tile_size: int = 1,
                 timeout_seconds: float = 30.0) -> None:
        if dtype not in _DTYPES:
            raise TypeError(f"ep group: argument 'dtype': {dtype} is not supported")
        c = _ext.EpGroupConfig()
        c.num_ranks = int(num_ranks)
        c.num_experts = int(num_experts)
        c.top_k = int(top_k)
        c.max_tokens = int(max_tokens)
        c.hidden = int(hidden)
        c.dtype = _DTYPES[dtype]
        c.scale_cols = int(scale_cols)
        c.tile_size = int(tile_size)
        c.timeout_seconds = float(timeout_seconds)
        check_status(_ext.ep_validate(c))
        self._config = c
        self._dtype = dtype
        self._group = _ext.EpCpuGroup.create(c)
        self.num_ranks = c.num_ranks
        self.experts_per_rank = c.experts_per_rank
        self.max_recv_rows = int(_ext.ep_max_recv_rows(c))
        self.max_expert_rows = int(_ext.ep_max_expert_rows(c))

    @property
    def broken_reason(self) -> str:
        """Non-empty once a wait timed out (or ranks were found in different calls)."""
        return self._group.broken_reason()

    def dispatch(self, rank: int, x: Tensor, topk_ids: Tensor, topk_weights: Tensor,
                 scales: Optional[Tensor] = None, *, expert_major: bool = True, handle: Any = None,
                 reuse: bool = False) -> Dispatched:
        """Sends rank `rank`'s tokens x [T,H] (T <= max_tokens) once to each rank owning one of
        their experts (topk_ids [T,K] int32/int64 global ids, -1 for none; topk_weights [T,K]
        fp32; scales [T, scale_cols] fp32 for fp8 rows). With expert_major the received rows are
        also laid out (docs/design.md section 3) over this rank's experts and gathered into it. With
        reuse=True and the handle of an earlier dispatch of the same routing, the routing is
        checked to be the same (a GPU transport then skips its count exchange)."""
        c = self._config
        op = f"ep dispatch (rank {rank})"
        N, P, H, K, L = self.max_recv_rows, self.max_expert_rows, c.hidden, c.top_k, c.experts_per_rank

        def new(*shape: int, dtype: torch.dtype = torch.int32) -> Tensor:
            return torch.empty(shape, dtype=dtype)

        out_x = new(N, H, dtype=self._dtype)
        out_scales = new(N, c.scale_cols, dtype=torch.float32) if c.scale_cols > 0 else None
        src_rank, src_token = new(N), new(N)
        out_ids, out_w = new(N, K), new(N, K, dtype=torch.float32)
        stats = torch.zeros(_ext.EP_NUM_STATS, dtype=torch.int64)
        i = _ext.EpDispatchInputs()
        i.x = _view(op, "x", x)
        i.scales = _view(op, "scales", scales)
        i.topk_ids = _view(op, "topk_ids", topk_ids)
        i.topk_weights = _view(op, "topk_weights", topk_weights)
        o = _ext.EpDispatchOutputs()
        o.x = _view(op, "out.x", out_x)
        o.scales = _view(op, "out.scales", out_scales)
        o.src_rank = _view(op, "out.src_rank", src_rank)
        o.src_token = _view(op, "out.src_token", src_token)
        o.topk_ids = _view(op, "out.topk_ids", out_ids)
        o.topk_weights = _view(op, "out.topk_weights", out_w)
        o.stats = _view(op, "out.stats", stats)
        lay = expert_x = expert_scales = None
        if expert_major:
            tiles = max_tiles(N, K, L, c.tile_size)
            lay = Layout(new(L), new(L + 1), new(P), new(P), new(N, K), new(tiles), new(tiles), new(3))
            expert_x = new(P, H, dtype=self._dtype)
            expert_scales = new(P, c.scale_cols, dtype=torch.float32) if c.scale_cols > 0 else None
            o.layout = _layout_view(op, "out.layout.", lay)
            o.expert_x = _view(op, "out.expert_x", expert_x)
            o.expert_scales = _view(op, "out.expert_scales", expert_scales)
        if reuse and not isinstance(handle, Handle):
            raise ValueError(f"{op}: argument 'handle': reuse needs the Handle of an earlier dispatch")
        h = Handle(handle._cpp if reuse else _ext.EpHandle(), int(x.shape[0]) if isinstance(x, Tensor) else 0)
        check_status(self._group.dispatch(int(rank), i, o, h._cpp, bool(reuse)))
        rows, sent, dropped = (int(stats[j]) for j in _STATS)
        return Dispatched(out_x[:rows], out_scales[:rows] if out_scales is not None else None, src_rank[:rows],
                          src_token[:rows], out_ids[:rows], out_w[:rows], sent, dropped, lay, expert_x,
                          expert_scales, h)

    def combine(self, rank: int, handle: Any, y: Tensor, *, expert_major: bool = True,
                out: Optional[Tensor] = None, accumulate: bool = False,
                out_dtype: Optional[torch.dtype] = None) -> Tensor:
        """Returns rank `rank`'s tokens [T,H]: the partials of the ranks each token went to,
        summed in rank order in fp32. expert_major: y [>= padded_total, H] holds the expert
        outputs in the dispatch's expert-major layout (weighted here by the routing weights, in
        k order); otherwise y [rows, H] holds one already-reduced row per received row. `out`
        (written, and read too with accumulate) or a new tensor of out_dtype (default y's)."""
        op = f"ep combine (rank {rank})"
        if not isinstance(y, Tensor):
            raise TypeError(f"{op}: argument 'y': expected a torch.Tensor, got {type(y).__name__}")
        need = self.max_expert_rows if expert_major else self.max_recv_rows
        if y.dim() == 2 and y.shape[0] < need:  # the C++ contract takes the full capacity
            full = torch.zeros(need, y.shape[1], dtype=y.dtype)
            full[: y.shape[0]] = y
            y = full
        if not isinstance(handle, Handle):
            raise TypeError(f"{op}: argument 'handle': expected the Handle of a dispatch (Dispatched.handle)")
        if out is None:
            out = torch.empty(handle.tokens, self._config.hidden, dtype=out_dtype or y.dtype)
        ci = _ext.EpCombineInputs()
        ci.expert_major = bool(expert_major)
        ci.y = _view(op, "y", y)
        check_status(self._group.combine(int(rank), handle._cpp, ci, _view(op, "out", out), bool(accumulate)))
        return out


def run_ranks(num_ranks: int, fn: Callable[[int], Any]) -> List[Any]:
    """Runs fn(rank) for every rank on its own thread; returns the results by rank, or raises
    the first rank's exception (by rank)."""
    results: List[Any] = [None] * num_ranks
    errors: List[Optional[BaseException]] = [None] * num_ranks

    def body(r: int) -> None:
        try:
            results[r] = fn(r)
        except BaseException as e:  # noqa: BLE001 - handed to the caller below
            errors[r] = e

    threads = [threading.Thread(target=body, args=(r,)) for r in range(num_ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for e in errors:
        if e is not None:
            raise e
    return results
