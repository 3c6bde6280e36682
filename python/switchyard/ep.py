"""Expert parallelism (docs/design.md section 6; include/switchyard/ep.h): the CPU reference group
(CpuGroup) and the GPU transport (LoopbackGroup: R ranks on one GPU; GpuGroup: one rank per
process over a torch.distributed process group).

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

CpuGroup takes CPU tensors only. Errors: ValueError / TypeError naming the rank and argument
(raised on every rank when any rank's arguments are bad: nothing is written anywhere),
TimeoutError when a rank does not arrive within timeout_seconds (the group is then broken; build
a new one).

The GPU groups (LoopbackGroup, GpuGroup) offer the same dispatch / combine / Handle surface on
CUDA tensors; see their docstrings for how calls are ordered on streams. Every group's dispatch
and combine are the torch custom ops switchyard::ep_dispatch / switchyard::ep_combine (with fake
implementations), so they can sit in torch.compile(fullgraph=True) graphs and CUDA graphs.

Gradients (docs/design.md section 7): when x or topk_weights require grad, dispatch and combine of
CpuGroup and GpuGroup are on the autograd tape. Dispatch's backward is a combine over the same
handle (each source token sums its copies' gradients; the received weights' gradients come back
with it), combine's backward a dispatch of the output gradient reusing the handle. Both are
collectives: every rank runs its backward, in the order of its forward calls. Gradients travel in
the group's row dtype.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import os
import threading
import weakref
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor

from . import _ext
from ._core import UnsupportedError, check_status, max_tiles
from .ops import _DTYPES, Layout, _eager_kernel, _eager_without_dynamo, _layout_view, _view

__all__ = ["CpuGroup", "Dispatched", "GpuDispatched", "GpuGroup", "Handle", "LoopbackGroup", "run_ranks"]



def _group_config(num_ranks: int, num_experts: int, top_k: int, max_tokens: int, hidden: int, dtype: torch.dtype,
                  scale_cols: int, tile_size: int, timeout_seconds: float, partial_dtype: torch.dtype) -> Any:
    """The validated C++ GroupConfig; ValueError / TypeError naming the bad field."""
    for name, value in (("dtype", dtype), ("partial_dtype", partial_dtype)):
        if value not in _DTYPES:
            raise TypeError(f"ep group: argument '{name}': {value} is not supported")
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
    c.partial_dtype = _DTYPES[partial_dtype]
    check_status(_ext.ep_validate(c))
    return c


# ----------------------------------------------------------------------------- the ops
#
# Every group's dispatch and combine run through two torch custom ops, switchyard::ep_dispatch
# and switchyard::ep_combine, so that torch.compile(fullgraph=True) keeps them in its graph and
# CUDA graphs capture them. The ops name their group by a registry id and "mutate" the group's
# one-element `state` tensor: that keeps the collectives in program order and out of
# dead-code elimination. A handle is plain data (Handle: its memory tensor, token count and
# whether the dispatch wrote the expert-major output), so it travels through graphs as tensors.

_GROUPS: Dict[int, "weakref.ref[Any]"] = {}
_GROUP_IDS = itertools.count(1)

# ep_dispatch's outputs, in order: the rank-major rows, the expert-major layout and rows, then
# the handle memory (empty on reuse: the reused handle's memory is an input).
_OUT_X, _OUT_SCALES, _OUT_SRC_RANK, _OUT_SRC_TOKEN, _OUT_IDS, _OUT_WEIGHTS, _OUT_STATS = range(7)
_OUT_LAYOUT = 7  # 8 arrays, Layout's order
_OUT_EXPERT_X, _OUT_EXPERT_SCALES, _OUT_HANDLE = 15, 16, 17
# A tuple, not Tensor[]: functionalization takes a mutating op's outputs only as a fixed tuple.
_DispatchOuts = Tuple[(Tensor,) * 18]
# The outputs a gradient flows back through: the received rows and weights.
_DIFFERENTIABLE_OUTS = (_OUT_X, _OUT_WEIGHTS, _OUT_EXPERT_X)


def _registered(group_id: int, op: str) -> Any:
    ref = _GROUPS.get(group_id)
    group = ref() if ref is not None else None
    if group is None:
        raise ValueError(f"{op}: expert-parallel group {group_id} no longer exists")
    return group


def _need_tensor(op: str, name: str, t: Any, optional: bool = False) -> None:
    if not (isinstance(t, Tensor) or (optional and t is None)):
        raise TypeError(f"{op}: argument '{name}': expected a torch.Tensor, got {type(t).__name__}")


@torch.library.custom_op("switchyard::ep_dispatch", mutates_args=("state",))
def _ep_dispatch(state: Tensor, group_id: int, rank: int, x: Tensor, topk_ids: Tensor, topk_weights: Tensor,
                 scales: Optional[Tensor], expert_major: bool, reuse_memory: Optional[Tensor]) -> _DispatchOuts:
    """One rank's dispatch on group `group_id`: the outputs in _OUT_* order, full capacity."""
    return tuple(_registered(group_id, f"ep dispatch (rank {rank})")._dispatch_impl(
        rank, x, topk_ids, topk_weights, scales, expert_major, reuse_memory))


@_ep_dispatch.register_fake
def _(state, group_id, rank, x, topk_ids, topk_weights, scales, expert_major, reuse_memory):
    return tuple(_registered(group_id, f"ep dispatch (rank {rank})")._dispatch_shapes(
        expert_major, reuse_memory is not None, x.new_empty))


@torch.library.custom_op("switchyard::ep_combine", mutates_args=("state", "out", "pick_values_out"))
def _ep_combine(state: Tensor, group_id: int, rank: int, handle_memory: Tensor, tokens: int,
                dispatch_expert_major: bool, y: Tensor, expert_major: bool, out: Tensor, accumulate: bool,
                weighted: bool, pick_values: Optional[Tensor], pick_values_out: Tensor) -> None:
    """One rank's combine on group `group_id` into out [tokens, H] (read too with accumulate).
    weighted=False sums the expert-major rows without weights; pick_values [max_recv_rows, K] fp32
    are sent back, summed per token into pick_values_out [tokens, K] (an empty tensor: not asked)."""
    _registered(group_id, f"ep combine (rank {rank})")._combine_impl(
        rank, handle_memory, tokens, dispatch_expert_major, y, expert_major, out, accumulate,
        _CombineExtras(weighted, pick_values, pick_values_out if pick_values_out.numel() > 0 else None))


@_ep_combine.register_fake
def _(state, group_id, rank, handle_memory, tokens, dispatch_expert_major, y, expert_major, out, accumulate,
      weighted, pick_values, pick_values_out):
    return None


class _CombineExtras(NamedTuple):
    """The training fields of a combine (ep.h CombineInputs): unweighted rows, pick values."""

    weighted: bool = True
    pick_values: Optional[Tensor] = None
    pick_values_out: Optional[Tensor] = None

    def apply(self, op: str, ci: Any) -> None:
        ci.weighted = bool(self.weighted)
        ci.pick_values = _view(op, "pick_values", self.pick_values)
        ci.pick_values_out = _view(op, "pick_values_out", self.pick_values_out)


_eager_without_dynamo(_ep_dispatch)
_eager_without_dynamo(_ep_combine)


# ----------------------------------------------------------------------------- gradients
#
# docs/design.md section 7, DeepEP's pairing: dispatch's backward is a combine of the received
# rows' gradients over the same handle (unweighted: each source token sums its copies' gradients
# in rank order, each rank first summing its local picks' rows in k order), which also sends the
# received weights' gradients back (pick values); combine's backward is a dispatch of the output
# gradient reusing the handle (in the group's row dtype), followed by the local products
#   dy[p] = w(p) * dout_recv[p]   (fp32 product, stored in y's dtype)
#   dw[n,k] = <dout_recv[row(n,k)], y[row(n,k)]>   (fp32 dot product; 0 for picks elsewhere).
# Both backwards are collectives: every rank's backward makes them in the same order, as the
# forward calls were made.


def _records_grad(*tensors: Optional[Tensor]) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


class _EpDispatchGrad(torch.autograd.Function):
    """ep_dispatch on the autograd tape: gradients flow to x and topk_weights from the received
    rows (rank-major x, expert-major expert_x) and the received weights."""

    @staticmethod
    def forward(ctx, group, rank, x, topk_ids, topk_weights, scales, expert_major, reuse_memory):
        outs = torch.ops.switchyard.ep_dispatch(group._state, group.group_id, rank, x, topk_ids, topk_weights,
                                                scales, expert_major, reuse_memory)
        ctx.mark_non_differentiable(*(o for i, o in enumerate(outs) if i not in _DIFFERENTIABLE_OUTS))
        ctx.set_materialize_grads(False)  # None for outputs no gradient reached
        ctx.group, ctx.rank, ctx.expert_major = group, rank, expert_major
        ctx.x_dtype, ctx.tokens = x.dtype, x.shape[0]
        ctx.save_for_backward(reuse_memory if reuse_memory is not None else outs[_OUT_HANDLE])
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        (memory,) = ctx.saved_tensors
        dx, dw = ctx.group._dispatch_backward(
            ctx.rank, Handle(memory, ctx.tokens, ctx.expert_major), grads[_OUT_X], grads[_OUT_WEIGHTS],
            grads[_OUT_EXPERT_X], ctx.x_dtype, ctx.needs_input_grad[2], ctx.needs_input_grad[4])
        return None, None, dx, None, dw, None, None, None


class _EpCombineGrad(torch.autograd.Function):
    """ep_combine on the autograd tape: gradients flow to y, to the received weights (expert-major)
    and, with accumulate, to what `out` held."""

    @staticmethod
    def forward(ctx, group, rank, handle, expert_major, y, received_weights, out, accumulate):
        group._combine_call(rank, handle, y, expert_major, out, accumulate)
        ctx.mark_dirty(out)
        ctx.group, ctx.rank, ctx.handle = group, rank, handle
        ctx.expert_major, ctx.accumulate = expert_major, accumulate
        ctx.save_for_backward(y, received_weights)
        return out

    @staticmethod
    def backward(ctx, g_out):
        y, received_weights = ctx.saved_tensors
        dy, dw = ctx.group._combine_backward(ctx.rank, ctx.handle, ctx.expert_major, g_out, y, received_weights,
                                             ctx.needs_input_grad[4], ctx.needs_input_grad[5])
        return None, None, None, None, dy, dw, g_out if ctx.accumulate else None, None


class Handle(NamedTuple):
    """What combine needs from one rank's dispatch: its handle memory (GPU groups: the
    handle_bytes of device memory the dispatch wrote; CpuGroup: a one-element key into the
    group's host-side plans), the rank's token count then, and whether that dispatch wrote the
    expert-major output. Plain data: it passes through torch.compile graphs."""

    memory: Tensor
    tokens: int
    expert_major: bool
    # For gradients (docs/design.md section 7): the source's routing, which the backward's
    # dispatch of the output gradient reuses, and the received weights [max_recv_rows, K] that
    # combine applies (the dispatch's topk_weights output, through which their gradient flows).
    source_ids: Optional[Tensor] = None
    source_weights: Optional[Tensor] = None
    received_weights: Optional[Tensor] = None

    @property
    def valid(self) -> bool:
        return isinstance(self.memory, Tensor) and self.memory.numel() > 0


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


class GpuDispatched:
    """One rank's dispatch with full-capacity outputs: what the GPU groups return (and CpuGroup
    with trim=False). The calls only enqueue, so nothing here is trimmed to the received rows:
    the rank-major tensors have max_recv_rows rows (rows past the received count are left as
    torch.empty allocated them) and the counts stay on the device in `stats` ([3] int64:
    received rows, sent pairs, dropped ids). `rows`, `sent`, `dropped` and `trimmed()` read them
    back to the host (a synchronization). On a LoopbackGroup they may only be read once every
    rank has made this dispatch."""

    def __init__(self, group: Any, rank: int, outs: Sequence[Tensor], expert_major: bool, handle: Handle) -> None:
        has_scales = group.scale_cols > 0
        self._group = group
        self._rank = rank
        self.x = outs[_OUT_X]  # [max_recv_rows, H]
        self.scales = outs[_OUT_SCALES] if has_scales else None  # [max_recv_rows, scale_cols] fp32
        self.src_rank = outs[_OUT_SRC_RANK]  # [max_recv_rows] int32
        self.src_token = outs[_OUT_SRC_TOKEN]  # [max_recv_rows] int32
        self.topk_ids = outs[_OUT_IDS]  # [max_recv_rows, K] int32 local expert ids, -1 elsewhere
        self.topk_weights = outs[_OUT_WEIGHTS]  # [max_recv_rows, K] fp32
        self.stats = outs[_OUT_STATS]  # [3] int64
        # The expert-major layout of the received rows and its rows [max_expert_rows, H] (None if
        # not asked).
        self.layout = Layout(*outs[_OUT_LAYOUT:_OUT_LAYOUT + 8]) if expert_major else None
        self.expert_x = outs[_OUT_EXPERT_X] if expert_major else None
        self.expert_scales = outs[_OUT_EXPERT_SCALES] if expert_major and has_scales else None
        self.handle = handle

    def _read_stat(self, j: int) -> int:
        self._group._require_complete(self.handle.memory.data_ptr(), "reading a dispatch's counts")
        return int(self.stats[j])

    @property
    def rows(self) -> int:
        """Rows this rank received: received_rows() in exact mode (worst_case=False) for the
        rank's latest dispatch, else stats[0] read back (synchronizes the current stream)."""
        if not self._group.worst_case and self._group._is_latest(self._rank, self.handle.memory):
            return self._group.received_rows(self._rank)  # no stream synchronization
        return self._read_stat(_ext.EP_RECV_ROWS)

    @property
    def sent(self) -> int:
        return self._read_stat(_ext.EP_SENT_ROWS)

    @property
    def dropped(self) -> int:
        return self._read_stat(_ext.EP_DROPPED)

    def trimmed(self) -> Dispatched:
        """CpuGroup's form of this result: rank-major rows trimmed to the rows received, counts
        as ints (synchronizes)."""
        n = self.rows
        sc = self.scales[:n] if self.scales is not None else None
        return Dispatched(self.x[:n], sc, self.src_rank[:n], self.src_token[:n], self.topk_ids[:n],
                          self.topk_weights[:n], self.sent, self.dropped, self.layout, self.expert_x,
                          self.expert_scales, self.handle)


class _Group:
    """What every group shares: the registry entry and state tensor of its ops, the outputs'
    shapes, the arguments' first checks, and the dispatch / combine methods that call the ops.
    A subclass provides _dispatch_impl and _combine_impl (the ops' real kernels), _local_ranks,
    and may hook _require_complete / _is_latest."""

    _what = "ep group"
    worst_case = True

    def _register(self, config: Any, dtype: torch.dtype, device: torch.device) -> None:
        self._config = config
        self._dtype = dtype
        self.device = device
        # Plain ints (torch.compile traces reads of these, not of the C++ config).
        self.num_ranks = int(config.num_ranks)
        self.experts_per_rank = int(config.experts_per_rank)
        self.hidden = int(config.hidden)
        self.scale_cols = int(config.scale_cols)
        self.max_recv_rows = int(_ext.ep_max_recv_rows(config))
        self.max_expert_rows = int(_ext.ep_max_expert_rows(config))
        self.group_id = next(_GROUP_IDS)
        _GROUPS[self.group_id] = weakref.ref(self)
        weakref.finalize(self, _GROUPS.pop, self.group_id, None)
        self._state = torch.zeros(1, dtype=torch.int64, device=device)
        # ep_combine's pick_values_out when none is asked for (the op's schema takes a tensor).
        self._no_pick_values = torch.empty(0, dtype=torch.float32, device=device)

    def _local_ranks(self) -> Sequence[int]:
        return range(self.num_ranks)

    def _handle_numel(self) -> int:
        return 1

    def _handle_dtype(self) -> torch.dtype:
        return torch.int64

    def _require_complete(self, memory_ptr: int, what: str) -> None:
        """Raises when the dispatch whose handle memory is at memory_ptr is not yet complete on
        every rank (LoopbackGroup: before every rank has made it)."""

    def _is_latest(self, rank: int, memory: Tensor) -> bool:
        return False

    def _check_rank(self, op: str, rank: Any) -> int:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.num_ranks:
            raise ValueError(f"{op}: argument 'rank': {rank!r} is not a rank of this {self.num_ranks}-rank group")
        if rank not in self._local_ranks():
            raise ValueError(f"{op}: argument 'rank': rank {rank} is not driven by this process (it drives "
                             f"{list(self._local_ranks())})")
        return rank

    def _dispatch_shapes(self, expert_major: bool, reuse: bool, new: Callable[..., Tensor]) -> List[Tensor]:
        """New tensors of the shapes and dtypes of ep_dispatch's outputs (new(shape, dtype=))."""
        c = self._config
        N, P, H, K, L, sc = self.max_recv_rows, self.max_expert_rows, c.hidden, c.top_k, c.experts_per_rank, \
            c.scale_cols
        i32, f32 = torch.int32, torch.float32
        outs = [new((N, H), dtype=self._dtype), new((N, sc), dtype=f32), new((N,), dtype=i32),
                new((N,), dtype=i32), new((N, K), dtype=i32), new((N, K), dtype=f32),
                new((_ext.EP_NUM_STATS,), dtype=torch.int64)]
        if expert_major:
            tiles = max_tiles(N, K, L, c.tile_size)
            outs += [new((L,), dtype=i32), new((L + 1,), dtype=i32), new((P,), dtype=i32), new((P,), dtype=i32),
                     new((N, K), dtype=i32), new((tiles,), dtype=i32), new((tiles,), dtype=i32),
                     new((3,), dtype=i32), new((P, H), dtype=self._dtype), new((P, sc), dtype=f32)]
        else:
            outs += [new((0,), dtype=i32) for _ in range(8)] + [new((0, H), dtype=self._dtype),
                                                                new((0, sc), dtype=f32)]
        outs.append(new((0 if reuse else self._handle_numel(),), dtype=self._handle_dtype()))
        return outs

    def _dispatch_views(self, op: str, outs: List[Tensor], x: Tensor, topk_ids: Tensor, topk_weights: Tensor,
                        scales: Optional[Tensor], expert_major: bool) -> Tuple[Any, Any]:
        """The C++ DispatchInputs / DispatchOutputs viewing the inputs and the outputs `outs`."""
        has_scales = self._config.scale_cols > 0
        i = _ext.EpDispatchInputs()
        i.x = _view(op, "x", x)
        i.scales = _view(op, "scales", scales)
        i.topk_ids = _view(op, "topk_ids", topk_ids)
        i.topk_weights = _view(op, "topk_weights", topk_weights)
        o = _ext.EpDispatchOutputs()
        o.x = _view(op, "out.x", outs[_OUT_X])
        o.scales = _view(op, "out.scales", outs[_OUT_SCALES] if has_scales else None)
        o.src_rank = _view(op, "out.src_rank", outs[_OUT_SRC_RANK])
        o.src_token = _view(op, "out.src_token", outs[_OUT_SRC_TOKEN])
        o.topk_ids = _view(op, "out.topk_ids", outs[_OUT_IDS])
        o.topk_weights = _view(op, "out.topk_weights", outs[_OUT_WEIGHTS])
        o.stats = _view(op, "out.stats", outs[_OUT_STATS])
        if expert_major:
            o.layout = _layout_view(op, "out.layout.", outs[_OUT_LAYOUT:_OUT_LAYOUT + 8])
            o.expert_x = _view(op, "out.expert_x", outs[_OUT_EXPERT_X])
            o.expert_scales = _view(op, "out.expert_scales", outs[_OUT_EXPERT_SCALES] if has_scales else None)
        return i, o

    def _padded_y(self, y: Tensor, expert_major: bool) -> Tensor:
        """y with the full capacity of rows the C++ contract takes (zero rows appended)."""
        need = self.max_expert_rows if expert_major else self.max_recv_rows
        if y.dim() == 2 and y.shape[0] < need:
            full = y.new_zeros(need, y.shape[1])
            full[: y.shape[0]] = y
            return full
        return y

    def _dispatch_call(self, rank: int, x: Tensor, topk_ids: Tensor, topk_weights: Tensor, scales: Optional[Tensor],
                       expert_major: bool, handle: Any, reuse: bool) -> GpuDispatched:
        op = f"ep dispatch (rank {rank})"
        rank = self._check_rank(op, rank)
        for name, t, optional in (("x", x, False), ("topk_ids", topk_ids, False),
                                  ("topk_weights", topk_weights, False), ("scales", scales, True)):
            _need_tensor(op, name, t, optional)
        if reuse and not (isinstance(handle, Handle) and handle.valid):
            raise ValueError(f"{op}: argument 'handle': reuse needs the Handle of an earlier dispatch of this group")
        reuse_memory = handle.memory if reuse else None
        if _records_grad(x, topk_weights):
            self._require_autograd(op)
            outs = _EpDispatchGrad.apply(self, rank, x, topk_ids, topk_weights, scales, bool(expert_major),
                                         reuse_memory)
        else:
            kernel = _eager_kernel(_ep_dispatch, x, topk_ids, topk_weights, scales) or torch.ops.switchyard.ep_dispatch
            outs = kernel(self._state, self.group_id, rank, x, topk_ids, topk_weights, scales, bool(expert_major),
                          reuse_memory)
        h = Handle(handle.memory if reuse else outs[_OUT_HANDLE], x.shape[0], bool(expert_major), topk_ids,
                   topk_weights.detach(), outs[_OUT_WEIGHTS])
        return GpuDispatched(self, rank, outs, bool(expert_major), h)

    def combine(self, rank: int, handle: Any, y: Tensor, *, expert_major: bool = True,
                out: Optional[Tensor] = None, accumulate: bool = False,
                out_dtype: Optional[torch.dtype] = None) -> Tensor:
        """Returns rank `rank`'s tokens [T,H]: the partials of the ranks each token went to,
        summed in rank order in fp32. expert_major: y [>= padded_total, H] holds the expert
        outputs in the dispatch's expert-major layout (weighted here by the routing weights, in
        k order); otherwise y [rows, H] holds one already-reduced row per received row (fewer
        rows than the capacity: copied into a zero-padded buffer first). Writes `out` (read too
        with accumulate: out + the sum, e.g. a shared expert's output) or a new tensor of
        out_dtype (default y's)."""
        op = f"ep combine (rank {rank})"
        rank = self._check_rank(op, rank)
        _need_tensor(op, "y", y)
        _need_tensor(op, "out", out, optional=True)
        if not (isinstance(handle, Handle) and handle.valid):
            raise TypeError(f"{op}: argument 'handle': expected the Handle of a dispatch of this group "
                            "(.handle of dispatch's result)")
        if out is None:
            if accumulate:
                raise ValueError(f"{op}: argument 'accumulate': needs `out` (the tensor to add to)")
            out = y.new_empty((handle.tokens, self.hidden), dtype=out_dtype or y.dtype, device=self.device)
        if _records_grad(y, handle.received_weights, out if accumulate else None):
            self._require_autograd(op)
            return _EpCombineGrad.apply(self, rank, handle, bool(expert_major), y, handle.received_weights, out,
                                        bool(accumulate))
        self._combine_call(rank, handle, y, bool(expert_major), out, bool(accumulate))
        return out

    def _require_autograd(self, op: str) -> None:
        """Raises when this group's calls cannot be on the autograd tape."""

    def _training_dtype(self, op: str) -> None:
        if self._dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"{op}: a group of {self._dtype} rows cannot carry gradients; build the training "
                             "group with bfloat16, float16 or float32 rows")

    def _dispatch_backward(self, rank: int, handle: Handle, g_x: Optional[Tensor], g_w: Optional[Tensor],
                           g_expert_x: Optional[Tensor], x_dtype: torch.dtype, need_dx: bool,
                           need_dw: bool) -> Tuple[Optional[Tensor], Optional[Tensor]]:
        """(dx [T,H] in x's dtype, d topk_weights [T,K] fp32): one unweighted combine over the
        dispatch's handle, which also brings the received weights' gradients back."""
        op = f"ep dispatch backward (rank {rank})"
        self._training_dtype(op)
        T, H, K = handle.tokens, self.hidden, int(self._config.top_k)
        dev = handle.memory.device
        rows = self.max_expert_rows if handle.expert_major else self.max_recv_rows
        g = g_expert_x if handle.expert_major else g_x
        y = g.contiguous() if g is not None else torch.zeros(rows, H, dtype=self._dtype, device=dev)
        values = None
        if g_w is not None:
            values = torch.zeros(self.max_recv_rows, K, dtype=torch.float32, device=dev)
            values[: g_w.shape[0]] = g_w
        extras = _CombineExtras(False, values,
                                torch.empty(T, K, dtype=torch.float32, device=dev) if need_dw else None)
        dx = torch.empty(T, H, dtype=x_dtype, device=dev)
        self._combine_call(rank, handle, y, handle.expert_major, dx, False, extras)
        if handle.expert_major and g_x is not None:
            raise ValueError(f"{op}: a gradient reached the rank-major rows `x` of an expert-major dispatch; "
                             "only expert_x and topk_weights carry gradients there (compute from expert_x)")
        return (dx if need_dx else None), extras.pick_values_out

    def _combine_backward(self, rank: int, handle: Handle, expert_major: bool, g_out: Tensor, y: Tensor,
                          received_weights: Optional[Tensor], need_dy: bool,
                          need_dw: bool) -> Tuple[Optional[Tensor], Optional[Tensor]]:
        """(dy in y's shape and dtype, d received weights [max_recv_rows, K] fp32): a dispatch of
        the output gradient reusing the handle, then the local products."""
        op = f"ep combine backward (rank {rank})"
        self._training_dtype(op)
        if handle.source_ids is None:
            raise ValueError(f"{op}: argument 'handle': it carries no routing (source_ids); pass the Handle "
                             "a dispatch returned")
        dout = g_out.to(self._dtype).contiguous()
        src_w = handle.source_weights if handle.source_weights is not None else torch.zeros(
            handle.source_ids.shape, dtype=torch.float32, device=dout.device)
        outs = self._dispatch_call(rank, dout, handle.source_ids, src_w, None, handle.expert_major, handle, True)
        if not expert_major:
            dy = outs.x[: y.shape[0]].to(y.dtype)
            return (dy if need_dy else None), None
        rows = y.shape[0]
        K = int(self._config.top_k)
        d_rows = outs.expert_x[:rows].float()
        p2x = outs.layout.permuted_to_expanded[:rows].long()
        n_picks = received_weights.shape[0] * K
        valid = ((torch.arange(rows, device=y.device) < outs.layout.totals[0]) & (p2x >= 0) & (p2x < n_picks))
        pick = torch.where(valid, p2x, torch.zeros_like(p2x))
        zero = torch.zeros((), dtype=torch.float32, device=y.device)
        dy = dw = None
        if need_dy:
            w_row = torch.where(valid, received_weights.reshape(-1)[pick].float(), zero)
            dy = torch.where(valid[:, None], d_rows * w_row[:, None], zero).to(y.dtype)
        if need_dw:
            dot = torch.where(valid, (d_rows * y.float()).sum(-1), zero)
            flat = torch.zeros(n_picks + 1, dtype=torch.float32, device=y.device)
            # Each pick has one row; every other row lands on the extra slot n_picks.
            flat[torch.where(valid, p2x, torch.full_like(p2x, n_picks))] = dot
            dw = flat[:n_picks].view(received_weights.shape)
        return dy, dw

    def _combine_call(self, rank: int, handle: Handle, y: Tensor, expert_major: bool, out: Tensor,
                      accumulate: bool, extras: _CombineExtras = _CombineExtras()) -> None:
        """The ep_combine op on checked arguments."""
        pick_values_out = extras.pick_values_out if extras.pick_values_out is not None else self._no_pick_values
        kernel = (_eager_kernel(_ep_combine, y, out, extras.pick_values, pick_values_out)
                  or torch.ops.switchyard.ep_combine)
        kernel(self._state, self.group_id, rank, handle.memory, handle.tokens, handle.expert_major, y,
               expert_major, out, accumulate, bool(extras.weighted), extras.pick_values, pick_values_out)


class CpuGroup(_Group):
    """A group of num_ranks simulated ranks; rank r owns experts [r*L, (r+1)*L), L = E / R."""

    _what = "ep cpu group"
    _MAX_PLANS = 4096  # host-side plans kept for handles (the oldest go first)

    def __init__(self, num_ranks: int, num_experts: int, top_k: int, max_tokens: int, hidden: int,
                 dtype: torch.dtype = torch.bfloat16, scale_cols: int = 0, tile_size: int = 1,
                 timeout_seconds: float = 30.0, partial_dtype: torch.dtype = torch.float32) -> None:
        c = _group_config(num_ranks, num_experts, top_k, max_tokens, hidden, dtype, scale_cols, tile_size,
                          timeout_seconds, partial_dtype)
        self._group = _ext.EpCpuGroup.create(c)
        self._register(c, dtype, torch.device("cpu"))
        self._plans: "collections.OrderedDict[int, Any]" = collections.OrderedDict()
        self._plans_lock = threading.Lock()
        self._plan_ids = itertools.count(1)

    @property
    def broken_reason(self) -> str:
        """Non-empty once a wait timed out (or ranks were found in different calls)."""
        return self._group.broken_reason()

    def _plan(self, op: str, memory: Tensor) -> Any:
        key = int(memory[0]) if memory.numel() == 1 and memory.dtype == torch.int64 else -1
        with self._plans_lock:
            plan = self._plans.get(key)
        if plan is None:
            raise ValueError(f"{op}: argument 'handle': not a handle of this group's recent dispatches (it keeps "
                             f"the last {self._MAX_PLANS})")
        return plan

    def dispatch(self, rank: int, x: Tensor, topk_ids: Tensor, topk_weights: Tensor,
                 scales: Optional[Tensor] = None, *, expert_major: bool = True, handle: Any = None,
                 reuse: bool = False, trim: bool = True) -> Any:
        """Sends rank `rank`'s tokens x [T,H] (T <= max_tokens) once to each rank owning one of
        their experts (topk_ids [T,K] int32/int64 global ids, -1 for none; topk_weights [T,K]
        fp32; scales [T, scale_cols] fp32 for fp8 rows). With expert_major the received rows are
        also laid out (docs/design.md section 3) over this rank's experts and gathered into it. With
        reuse=True and the handle of an earlier dispatch of the same routing, the routing is
        checked to be the same (a GPU transport then skips its count exchange). Returns a
        Dispatched trimmed to the rows received, or with trim=False the GPU groups' full-capacity
        GpuDispatched (no host read: what torch.compile traces)."""
        d = self._dispatch_call(rank, x, topk_ids, topk_weights, scales, expert_major, handle, reuse)
        return d.trimmed() if trim else d

    def _dispatch_impl(self, rank: int, x: Tensor, topk_ids: Tensor, topk_weights: Tensor, scales: Optional[Tensor],
                       expert_major: bool, reuse_memory: Optional[Tensor]) -> List[Tensor]:
        op = f"ep dispatch (rank {rank})"
        outs = self._dispatch_shapes(expert_major, reuse_memory is not None, torch.empty)
        i, o = self._dispatch_views(op, outs, x, topk_ids, topk_weights, scales, expert_major)
        plan = self._plan(op, reuse_memory) if reuse_memory is not None else _ext.EpHandle()
        check_status(self._group.dispatch(int(rank), i, o, plan, reuse_memory is not None))
        if reuse_memory is None:
            key = next(self._plan_ids)
            with self._plans_lock:
                self._plans[key] = plan
                while len(self._plans) > self._MAX_PLANS:
                    self._plans.popitem(last=False)
            outs[_OUT_HANDLE].fill_(key)
        return outs

    def _combine_impl(self, rank: int, memory: Tensor, tokens: int, dispatch_expert_major: bool, y: Tensor,
                      expert_major: bool, out: Tensor, accumulate: bool, extras: "_CombineExtras") -> None:
        op = f"ep combine (rank {rank})"
        plan = self._plan(op, memory)
        ci = _ext.EpCombineInputs()
        ci.expert_major = bool(expert_major)
        y = self._padded_y(y, expert_major)
        ci.y = _view(op, "y", y)
        extras.apply(op, ci)
        check_status(self._group.combine(int(rank), plan, ci, _view(op, "out", out), bool(accumulate)))


# ----------------------------------------------------------------------------- GPU groups

_NO_CUDA_BACKEND = ("this build of Switchyard has no CUDA backend (the extension was built without nvcc or with "
                    "SWITCHYARD_ENABLE_CUDA=OFF); the GPU expert-parallel groups need it. CpuGroup works on every "
                    "build")


def _gpu_options(worst_case: bool, num_sms: int) -> Any:
    o = _ext.EpGpuOptions()
    o.worst_case = bool(worst_case)
    o.num_sms = int(num_sms)
    # The loopback group needs one hardware queue per rank's stream; CUDA reads this variable
    # when it starts, so it must be set before the process touches CUDA.
    queues = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "")
    o.hardware_queues = int(queues) if queues.isdigit() and int(queues) > 0 else 8
    return o


def _cuda_device(what: str, device: Any) -> torch.device:
    if not torch.cuda.is_available():
        raise RuntimeError(f"{what}: no CUDA device is visible to PyTorch (torch.cuda.is_available() is False)")
    if device is None:
        return torch.device("cuda", torch.cuda.current_device())
    dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"{what}: argument 'device': {dev} is not a CUDA device")
    return torch.device("cuda", dev.index if dev.index is not None else torch.cuda.current_device())


class _GpuGroupBase(_Group):
    """What LoopbackGroup and GpuGroup share: outputs allocated per call with torch's caching
    allocator on the group's device, the C++ GpuGroup's Status mapped to Python exceptions, and
    the group refusing every call once a device-side error (timeout, a peer's bad arguments)
    has been seen."""

    _what = "ep gpu group"

    def _setup(self, cpp: Any, config: Any, dtype: torch.dtype, device: torch.device, worst_case: bool) -> None:
        self._group = cpp
        self._register(config, dtype, device)
        self.worst_case = bool(worst_case)
        self.handle_bytes = int(_ext.ep_handle_bytes(config))
        self.region_bytes = int(_ext.ep_region_bytes(config))
        self._broken: Any = None  # the first error Status, once the group is broken
        self._latest_memory: Dict[int, int] = {}  # rank -> data_ptr of its latest dispatch's handle memory

    def _handle_numel(self) -> int:
        return (self.handle_bytes + 3) // 4  # int32 words; the caching allocator aligns to 512 bytes

    def _handle_dtype(self) -> torch.dtype:
        return torch.int32

    def _is_latest(self, rank: int, memory: Tensor) -> bool:
        # The handle memory is alive while a result holds it, so no later dispatch got its address.
        return self._latest_memory.get(rank) == memory.data_ptr()

    # Overridden: the stream a rank's call goes on, and what happens around the call.
    def _begin(self, op: str, kind: str, rank: int, memory: Tensor) -> None:
        """Before a call is enqueued (LoopbackGroup: its turn in the collective)."""

    def _admit(self, kind: str, rank: int) -> bool:
        """Raises when the group is broken; True: enqueue anyway, then raise (LoopbackGroup)."""
        self.check()
        return False

    def _enqueue(self, rank: int, call: Callable[[int], Any], tensors: Sequence[Optional[Tensor]]) -> Any:
        raise NotImplementedError

    @property
    def broken_reason(self) -> str:
        """Non-empty once a call failed or the device reported an error (check())."""
        return "" if self._broken is None else self._broken.message

    def _fail(self, status: Any) -> None:
        if self._broken is None:
            self._broken = status
        check_status(status)

    def check(self, rank: Optional[int] = None) -> None:
        """Raises the error the device reported so far for `rank` (every rank this process
        drives when None): TimeoutError naming the step and the peer, ValueError naming a rank
        with bad arguments. Reads host-mapped memory, no synchronization: it sees what kernels
        have already written. After an error the group refuses every call (rebuild it)."""
        if self._broken is not None:
            check_status(self._broken)
        for r in self._local_ranks() if rank is None else [self._check_rank("ep check", rank)]:
            status = self._group.check(int(r))
            if not status.ok:
                self._fail(status)

    def synchronize(self) -> None:
        """Waits for every call enqueued so far, then check()."""
        torch.cuda.synchronize(self.device)
        self.check()

    def received_rows(self, rank: int) -> int:
        """Exact mode (worst_case=False): the rows rank `rank` received in its latest dispatch.
        Waits on the host (at most timeout_seconds) until every peer's rows have arrived."""
        r = self._check_rank("ep received_rows", rank)
        memory_ptr = self._latest_memory.get(r)
        if memory_ptr is not None:
            self._require_complete(memory_ptr, "received_rows")
        status, rows = self._group.received_rows(r)
        if not status.ok:
            if status.code == _ext.StatusCode.Timeout:
                self._fail(status)
            check_status(status)
        return int(rows)

    def dispatch(self, rank: int, x: Tensor, topk_ids: Tensor, topk_weights: Tensor,
                 scales: Optional[Tensor] = None, *, expert_major: bool = True, handle: Any = None,
                 reuse: bool = False) -> GpuDispatched:
        """CpuGroup.dispatch on CUDA tensors of the group's device; returns a GpuDispatched
        (full-capacity outputs, counts on the device). With reuse=True and the Handle of an
        earlier dispatch of the same routing, the routing is not derived again (not checked on
        the GPU: the caller vouches for it) and the handle's memory is reused."""
        return self._dispatch_call(rank, x, topk_ids, topk_weights, scales, expert_major, handle, reuse)

    def _dispatch_impl(self, rank: int, x: Tensor, topk_ids: Tensor, topk_weights: Tensor, scales: Optional[Tensor],
                       expert_major: bool, reuse_memory: Optional[Tensor]) -> List[Tensor]:
        op = f"ep dispatch (rank {rank})"
        deferred = self._admit("dispatch", rank)
        dev = self.device
        with torch.cuda.device(dev):
            outs = self._dispatch_shapes(expert_major, reuse_memory is not None,
                                         lambda shape, dtype: torch.empty(shape, dtype=dtype, device=dev))
            i, o = self._dispatch_views(op, outs, x, topk_ids, topk_weights, scales, expert_major)
            memory = reuse_memory if reuse_memory is not None else outs[_OUT_HANDLE]
            o.handle_memory = _view(op, "handle memory", memory)
            # A handle that cannot be adopted stays invalid: the call still enqueues (its kernels
            # tell the peers) and then raises the adoption's error.
            h, adopted = self._adopt(op, rank, memory if reuse_memory is not None else None, x.shape[0], expert_major)
            self._begin(op, "dispatch", rank, memory)
            reuse = reuse_memory is not None
            status = self._enqueue(rank, lambda s: self._group.dispatch(rank, i, o, h, reuse, s),
                                   [x, scales, topk_ids, topk_weights, memory] + outs)
        self._finish(status, adopted, deferred)
        self._latest_memory[rank] = memory.data_ptr()
        return outs

    def _combine_impl(self, rank: int, memory: Tensor, tokens: int, dispatch_expert_major: bool, y: Tensor,
                      expert_major: bool, out: Tensor, accumulate: bool, extras: "_CombineExtras") -> None:
        op = f"ep combine (rank {rank})"
        deferred = self._admit("combine", rank)
        with torch.cuda.device(self.device):
            h, adopted = self._adopt(op, rank, memory, tokens, dispatch_expert_major)
            y = self._padded_y(y, expert_major)
            ci = _ext.EpCombineInputs()
            ci.expert_major = bool(expert_major)
            ci.y = _view(op, "y", y)
            extras.apply(op, ci)
            out_view = _view(op, "out", out)
            self._begin(op, "combine", rank, memory)
            status = self._enqueue(rank, lambda s: self._group.combine(rank, h, ci, out_view, bool(accumulate), s),
                                   [y, out, memory, extras.pick_values, extras.pick_values_out])
        self._finish(status, adopted, deferred)

    def _adopt(self, op: str, rank: int, memory: Optional[Tensor], tokens: int, expert_major: bool) -> Tuple[Any, Any]:
        """The C++ handle of the dispatch whose handle memory is `memory` (a new one for None),
        and the Status of adopting it."""
        h = _ext.EpHandle()
        if memory is None:
            return h, None
        return h, self._group.adopt_handle(rank, _view(op, "handle memory", memory), int(tokens), bool(expert_major), h)

    def _finish(self, status: Any, adopted: Any, deferred: bool) -> None:
        """After a call was enqueued: raise its error (the handle's first), or the earlier rank's
        error a deferred call repeats."""
        if adopted is not None and not adopted.ok:
            self._fail(adopted)
        if not status.ok:
            self._fail(status)
        if deferred:
            check_status(self._broken)


class LoopbackGroup(_GpuGroupBase):
    """R simulated ranks on one GPU: the region, kernels and protocol of the real GPU transport
    (ep.h GpuGroup::create_loopback), for tests and for engine development without several GPUs.
    Same dispatch / combine / Handle surface as CpuGroup, on CUDA tensors of `device`.

    One thread drives every rank: call dispatch(0, ...), dispatch(1, ...), ...,
    dispatch(R-1, ...) in turn, then combine likewise. That works because the GPU calls are
    enqueue-only: each returns as soon as its kernels are queued, and a rank's kernels wait on
    the GPU (not the host) for their peers' rows. Each rank's kernels run on a CUDA stream the
    group owns (ranks must not share a stream: a rank's kernel waiting for a peer would block
    the peer's kernels queued behind it). A call makes its rank's stream wait for the caller's
    current stream (so it sees inputs made there), and the last rank's call of a collective makes
    the current stream wait for all R rank streams: the results of a collective are ready on the
    current stream once every rank has made it, and not before (reading a dispatch's counts
    earlier raises). Ranks must make the same collective in the same order; a rank calling out of
    turn is refused with ValueError before anything is enqueued. Output tensors and the handle
    memory are allocated per call with torch's caching allocator on the current stream (and
    recorded on the rank's stream). A whole round (every rank's dispatch, or combine) can be
    captured in a CUDA graph. torch.compile traces it (fullgraph) too, but compile with a backend
    that keeps the program's order, such as backend="aot_eager": Inductor may place a kernel
    between two ranks' calls, and one that waits for the device there (an autotuning benchmark)
    waits for a rank not yet enqueued until the timeout. (GpuGroup, one rank per process, has no
    such constraint.)

    Errors: a call whose own arguments are bad raises ValueError / TypeError naming them (its
    kernels are still enqueued, to tell the peers); the same collective's later calls are still
    enqueued and raise the same error, and check() / synchronize() raise ValueError naming that
    rank (the ranks that called earlier learn it there). A rank that never makes its call makes
    the waiting ranks' kernels stop after timeout_seconds; check() or synchronize() then raise
    TimeoutError naming the step and the missing rank. After either the group refuses every call
    (build a new one).

    R may not exceed the device's hardware queues (CUDA_DEVICE_MAX_CONNECTIONS, 8 unless set
    before CUDA starts). Gradients: a call whose inputs require grad raises ValueError (the results
    of a round are ready only once every rank has called, and autograd's backward uses each rank's
    results at once); GpuGroup and CpuGroup train."""

    _what = "ep loopback group"

    def __init__(self, num_ranks: int, num_experts: int, top_k: int, max_tokens: int, hidden: int,
                 dtype: torch.dtype = torch.bfloat16, scale_cols: int = 0, tile_size: int = 1,
                 partial_dtype: torch.dtype = torch.float32, worst_case: bool = True, num_sms: int = 0,
                 timeout_seconds: float = 30.0, device: Any = None) -> None:
        c = _group_config(num_ranks, num_experts, top_k, max_tokens, hidden, dtype, scale_cols, tile_size,
                          timeout_seconds, partial_dtype)
        o = _gpu_options(worst_case, num_sms)
        if not _ext.built_with_cuda():
            status, _ = _ext.EpGpuGroup.create_loopback(c, o, 0)  # the C++ stub: Unsupported
            check_status(status)
            raise UnsupportedError(f"{self._what}: {_NO_CUDA_BACKEND}")
        dev = _cuda_device(self._what, device)
        status, cpp = _ext.EpGpuGroup.create_loopback(c, o, dev.index)
        check_status(status)
        self._setup(cpp, c, dtype, dev, worst_case)
        self._streams = [torch.cuda.Stream(device=dev) for _ in range(c.num_ranks)]
        self._round_kind = ""
        self._round_ranks: set = set()
        self._rounds_done = 0  # collectives every rank has made
        self._dispatch_round: Dict[int, int] = {}  # handle memory data_ptr -> round of its dispatch

    def _require_autograd(self, op: str) -> None:
        raise ValueError(f"{op}: a LoopbackGroup call cannot be on the autograd tape: its results are ready only "
                         "once every rank has made the call, while autograd's backward uses each rank's results "
                         "at once. Train through GpuGroup (one rank per process) or CpuGroup, or call under "
                         "torch.no_grad()")

    def stream(self, rank: int) -> torch.cuda.Stream:
        """The stream rank `rank`'s calls run on."""
        return self._streams[self._check_rank("ep stream", rank)]

    def _begin(self, op: str, kind: str, rank: int, memory: Tensor) -> None:
        if self._round_ranks and kind != self._round_kind:
            missing = sorted(set(range(self.num_ranks)) - self._round_ranks)
            raise ValueError(f"{op}: ranks {missing} have not made their {self._round_kind} yet; every rank makes "
                             "each collective call in the same order")
        if rank in self._round_ranks:
            missing = sorted(set(range(self.num_ranks)) - self._round_ranks)
            raise ValueError(f"{op}: rank {rank} already made this {kind}; ranks {missing} have not yet")
        self._round_kind = kind
        if kind == "dispatch":
            self._dispatch_round[memory.data_ptr()] = self._rounds_done

    def _admit(self, kind: str, rank: int) -> bool:
        try:
            self.check()
        except (ValueError, TypeError):
            # A rank's bad arguments: the rest of this collective's ranks still enqueue (their
            # kernels see the bad rank's header and stop at once, so no rank waits for the
            # timeout), and their calls raise the same error afterwards.
            if self._round_ranks and kind == self._round_kind and rank not in self._round_ranks:
                return True
            raise
        return False

    def _require_complete(self, memory_ptr: int, what: str) -> None:
        if self._dispatch_round.get(memory_ptr, -1) >= self._rounds_done:
            missing = sorted(set(range(self.num_ranks)) - self._round_ranks)
            raise RuntimeError(f"{self._what}: {what} before ranks {missing} made their dispatch: its results are "
                               "ready once every rank has made it")

    def _enqueue(self, rank: int, call: Callable[[int], Any], tensors: Sequence[Optional[Tensor]]) -> Any:
        current = torch.cuda.current_stream(self.device)
        if any(current == s for s in self._streams):
            raise ValueError(f"{self._what}: called with a rank's own stream current; call from another stream "
                             "(the rank streams would wait on each other)")
        side = self._streams[rank]
        side.wait_stream(current)
        status = call(side.cuda_stream)
        # The caching allocator must not hand these tensors' memory to other work before the rank's
        # stream is done with it, in graph capture too (a caller's temporary freed after the call
        # would otherwise be reused by the next rank's work on the current stream).
        for t in tensors:
            if isinstance(t, Tensor) and t.is_cuda:
                t.record_stream(side)
        # The call's kernels are queued (a bad argument enqueues too: its kernels tell the peers).
        self._round_ranks.add(rank)
        if len(self._round_ranks) == self.num_ranks:
            for s in self._streams:
                current.wait_stream(s)
            self._round_ranks = set()
            self._round_kind = ""
            self._rounds_done += 1
        return status


class GpuGroup(_GpuGroupBase):
    """This process's rank of a GPU group over a torch.distributed process group: one process
    per GPU (torchrun), the ranks' regions mapped through CUDA IPC (ep.h
    GpuGroup::create_ipc), their handles exchanged with all_gather_object over `group` (None:
    the default group; gloo or nccl). Every rank must construct it with the same arguments
    (checked: a mismatch fails on every rank, naming the field). Same dispatch / combine /
    Handle surface as CpuGroup with rank = this process's rank (`self.rank`), CUDA tensors of
    `device` (default: the current device), the calls enqueued on the current stream. Needs
    peer access between the GPUs (NVLink, or one GPU shared by the processes). Errors as
    LoopbackGroup's."""

    _what = "ep gpu group"

    def __init__(self, group: Any = None, num_experts: int = 0, top_k: int = 0, max_tokens: int = 0,
                 hidden: int = 0, dtype: torch.dtype = torch.bfloat16, scale_cols: int = 0, tile_size: int = 1,
                 partial_dtype: torch.dtype = torch.float32, worst_case: bool = True, num_sms: int = 0,
                 timeout_seconds: float = 30.0, device: Any = None) -> None:
        if not _ext.built_with_cuda():
            raise UnsupportedError(f"{self._what}: {_NO_CUDA_BACKEND}")
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(f"{self._what}: torch.distributed is not initialized; call "
                               "torch.distributed.init_process_group first (gloo or nccl)")
        pg = group if group is not None else dist.group.WORLD
        rank, world = dist.get_rank(pg), dist.get_world_size(pg)
        # Arguments that fail here on one rank fail on every rank: each rank's config check runs
        # before any exchange, and the exchange below carries each rank's verdict, so no rank
        # waits in an all-gather its peers never reach.
        error: Optional[BaseException] = None
        try:
            c = _group_config(world, num_experts, top_k, max_tokens, hidden, dtype, scale_cols, tile_size,
                              timeout_seconds, partial_dtype)
            o = _gpu_options(worst_case, num_sms)
            dev = _cuda_device(self._what, device)
        except (ValueError, TypeError, RuntimeError) as e:
            error = e
        verdicts: List[Any] = [None] * world
        dist.all_gather_object(verdicts, None if error is None else f"{type(error).__name__}: {error}", group=pg)
        if error is not None:
            try:
                raise error
            finally:
                # Break the frame <-> traceback cycle: it would keep this frame, and with it the
                # process group, alive past destroy_process_group, to be torn down at exit.
                error = None
        bad = [(r, v) for r, v in enumerate(verdicts) if v is not None]
        if bad:
            r, v = bad[0]
            raise ValueError(f"{self._what} (rank {rank}): rank {r} could not create its group: {v}")

        def all_gather(mine: bytes) -> bytes:
            got: List[Any] = [None] * world
            dist.all_gather_object(got, mine, group=pg)
            return b"".join(got)

        with torch.cuda.device(dev):
            status, cpp = _ext.EpGpuGroup.create_ipc(c, o, rank, all_gather)
        check_status(status)
        self.rank = rank
        self._setup(cpp, c, dtype, dev, worst_case)

    def _local_ranks(self) -> Sequence[int]:
        return (self.rank,)

    def _enqueue(self, rank: int, call: Callable[[int], Any], tensors: Sequence[Optional[Tensor]]) -> Any:
        return call(torch.cuda.current_stream(self.device).cuda_stream)


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
