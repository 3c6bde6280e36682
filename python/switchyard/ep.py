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
CUDA tensors; see their docstrings for how calls are ordered on streams. The GPU path of these
Python bindings has not yet run on a GPU (the C++ GpuGroup underneath has passed its GPU tests).
"""

from __future__ import annotations

import dataclasses
import os
import threading
import weakref
from typing import Any, Callable, List, Optional, Sequence

import torch
from torch import Tensor

from . import _ext
from ._core import UnsupportedError, check_status, max_tiles
from .ops import _DTYPES, Layout, _layout_view, _view

__all__ = ["CpuGroup", "Dispatched", "GpuDispatched", "GpuGroup", "Handle", "LoopbackGroup", "run_ranks"]

_STATS = (_ext.EP_RECV_ROWS, _ext.EP_SENT_ROWS, _ext.EP_DROPPED)


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


@dataclasses.dataclass
class _DispatchBuffers:
    """One dispatch call's argument views and the output tensors they point at."""

    inputs: Any
    outputs: Any
    out_x: Tensor
    out_scales: Optional[Tensor]
    src_rank: Tensor
    src_token: Tensor
    out_ids: Tensor
    out_w: Tensor
    stats: Tensor
    layout: Optional["Layout"]
    expert_x: Optional[Tensor]
    expert_scales: Optional[Tensor]

    def tensors(self) -> List[Optional[Tensor]]:
        return [self.out_x, self.out_scales, self.src_rank, self.src_token, self.out_ids, self.out_w, self.stats,
                self.expert_x, self.expert_scales] + (list(self.layout) if self.layout is not None else [])


def _dispatch_buffers(op: str, c: Any, dtype: torch.dtype, sizes: tuple, new: Callable[..., Tensor],
                      x: Tensor, topk_ids: Tensor, topk_weights: Tensor, scales: Optional[Tensor],
                      expert_major: bool) -> _DispatchBuffers:
    """New outputs of one dispatch (sizes = (N, P) capacities; new(*shape, dtype=) allocates) and
    the C++ argument structs viewing them and the inputs."""
    N, P = sizes
    H, K, L = c.hidden, c.top_k, c.experts_per_rank
    out_x = new(N, H, dtype=dtype)
    out_scales = new(N, c.scale_cols, dtype=torch.float32) if c.scale_cols > 0 else None
    src_rank, src_token = new(N), new(N)
    out_ids, out_w = new(N, K), new(N, K, dtype=torch.float32)
    stats = new(_ext.EP_NUM_STATS, dtype=torch.int64).zero_()
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
        expert_x = new(P, H, dtype=dtype)
        expert_scales = new(P, c.scale_cols, dtype=torch.float32) if c.scale_cols > 0 else None
        o.layout = _layout_view(op, "out.layout.", lay)
        o.expert_x = _view(op, "out.expert_x", expert_x)
        o.expert_scales = _view(op, "out.expert_scales", expert_scales)
    return _DispatchBuffers(i, o, out_x, out_scales, src_rank, src_token, out_ids, out_w, stats, lay, expert_x,
                            expert_scales)


class Handle:
    """What combine needs from a dispatch (who sent which token where), for one rank."""

    def __init__(self, cpp: Any, tokens: int, memory: Optional[Tensor] = None) -> None:
        self._cpp = cpp
        self.tokens = tokens  # the rank's token count at that dispatch
        # GPU groups: the device memory the handle lives in (handle_bytes, allocated per
        # dispatch with torch's allocator); kept alive with the handle.
        self.memory = memory

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
                 timeout_seconds: float = 30.0, partial_dtype: torch.dtype = torch.float32) -> None:
        c = _group_config(num_ranks, num_experts, top_k, max_tokens, hidden, dtype, scale_cols, tile_size,
                          timeout_seconds, partial_dtype)
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

        def new(*shape: int, dtype: torch.dtype = torch.int32) -> Tensor:
            return torch.empty(shape, dtype=dtype)

        b = _dispatch_buffers(op, c, self._dtype, (self.max_recv_rows, self.max_expert_rows), new, x, topk_ids,
                              topk_weights, scales, expert_major)
        i, o, out_x, out_scales = b.inputs, b.outputs, b.out_x, b.out_scales
        src_rank, src_token, out_ids, out_w, stats = b.src_rank, b.src_token, b.out_ids, b.out_w, b.stats
        lay, expert_x, expert_scales = b.layout, b.expert_x, b.expert_scales
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


def _is_latest(ref: Any, d: Any) -> bool:
    return ref is not None and ref() is d


class GpuDispatched:
    """One rank's dispatch on a GPU group. The calls only enqueue, so nothing here is trimmed to
    the received rows: the rank-major tensors have the full capacity (max_recv_rows rows; rows
    past the received count are left as torch.empty allocated them) and the counts stay on the
    device in `stats` ([3] int64: received rows, sent pairs, dropped ids). `rows`, `sent`,
    `dropped` and `trimmed()` read them back to the host (a synchronization). On a
    LoopbackGroup they may only be read once every rank has made this dispatch."""

    def __init__(self, group: "_GpuGroupBase", rank: int, round_id: int, x: Tensor, scales: Optional[Tensor],
                 src_rank: Tensor, src_token: Tensor, topk_ids: Tensor, topk_weights: Tensor, stats: Tensor,
                 layout: Optional[Layout], expert_x: Optional[Tensor], expert_scales: Optional[Tensor],
                 handle: Handle) -> None:
        self._group = group
        self._rank = rank
        self._round = round_id
        self.x = x  # [max_recv_rows, H]
        self.scales = scales  # [max_recv_rows, scale_cols] fp32
        self.src_rank = src_rank  # [max_recv_rows] int32
        self.src_token = src_token  # [max_recv_rows] int32
        self.topk_ids = topk_ids  # [max_recv_rows, K] int32 local expert ids, -1 elsewhere
        self.topk_weights = topk_weights  # [max_recv_rows, K] fp32
        self.stats = stats  # [3] int64 on the device
        self.layout = layout  # expert-major layout of the received rows (None if not asked)
        self.expert_x = expert_x  # [max_expert_rows, H]
        self.expert_scales = expert_scales
        self.handle = handle

    def _read_stat(self, j: int) -> int:
        self._group._require_round_complete(self._round, "reading a dispatch's counts")
        return int(self.stats[j])

    @property
    def rows(self) -> int:
        """Rows this rank received: received_rows() in exact mode (worst_case=False) for the
        rank's latest dispatch, else stats[0] read back (synchronizes the current stream)."""
        if not self._group.worst_case and _is_latest(self._group._latest.get(self._rank), self):
            return self._group.received_rows(self._rank)  # the rank's latest dispatch: no stream sync
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


class _GpuGroupBase:
    """What LoopbackGroup and GpuGroup share: outputs allocated per call with torch's caching
    allocator on the group's device, the C++ GpuGroup's Status mapped to Python exceptions, and
    the group refusing every call once a device-side error (timeout, a peer's bad arguments)
    has been seen."""

    _what = "ep gpu group"

    def _setup(self, cpp: Any, config: Any, dtype: torch.dtype, device: torch.device, worst_case: bool) -> None:
        self._group = cpp
        self._config = config
        self._dtype = dtype
        self.device = device
        self.worst_case = bool(worst_case)
        self.num_ranks = config.num_ranks
        self.experts_per_rank = config.experts_per_rank
        self.max_recv_rows = int(_ext.ep_max_recv_rows(config))
        self.max_expert_rows = int(_ext.ep_max_expert_rows(config))
        self.handle_bytes = int(_ext.ep_handle_bytes(config))
        self.region_bytes = int(_ext.ep_region_bytes(config))
        self._broken: Any = None  # the first error Status, once the group is broken
        self._latest: dict = {}  # rank -> weakref to its latest GpuDispatched (exact mode's received_rows)

    # Overridden: the ranks this process drives, the stream a rank's call goes on, and what
    # happens around the call.
    def _local_ranks(self) -> Sequence[int]:
        raise NotImplementedError

    def _begin(self, op: str, kind: str, rank: int) -> int:
        return 0

    def _admit(self, kind: str, rank: int) -> bool:
        """Raises when the group is broken; True: enqueue anyway, then raise (LoopbackGroup)."""
        self.check()
        return False

    def _enqueue(self, rank: int, call: Callable[[int], Any], tensors: Sequence[Optional[Tensor]]) -> Any:
        raise NotImplementedError

    def _require_round_complete(self, round_id: int, what: str) -> None:
        pass

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
        self._require_round_complete(-1, "received_rows")
        status, rows = self._group.received_rows(r)
        if not status.ok:
            if status.code == _ext.StatusCode.Timeout:
                self._fail(status)
            check_status(status)
        return int(rows)

    def _check_rank(self, op: str, rank: Any) -> int:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.num_ranks:
            raise ValueError(f"{op}: argument 'rank': {rank!r} is not a rank of this {self.num_ranks}-rank group")
        if rank not in self._local_ranks():
            raise ValueError(f"{op}: argument 'rank': rank {rank} is not driven by this process (it drives "
                             f"{list(self._local_ranks())})")
        return rank

    def dispatch(self, rank: int, x: Tensor, topk_ids: Tensor, topk_weights: Tensor,
                 scales: Optional[Tensor] = None, *, expert_major: bool = True, handle: Any = None,
                 reuse: bool = False) -> GpuDispatched:
        """CpuGroup.dispatch on CUDA tensors of the group's device; returns a GpuDispatched
        (full-capacity outputs, counts on the device). With reuse=True and the Handle of an
        earlier dispatch of the same routing, the routing is not derived again (not checked on
        the GPU: the caller vouches for it) and the handle's memory is reused."""
        op = f"ep dispatch (rank {rank})"
        rank = self._check_rank(op, rank)
        deferred = self._admit("dispatch", rank)
        c = self._config
        N, P = self.max_recv_rows, self.max_expert_rows
        dev = self.device
        if reuse and not (isinstance(handle, Handle) and handle.memory is not None):
            raise ValueError(f"{op}: argument 'handle': reuse needs the Handle of an earlier dispatch of this group")

        def new(*shape: int, dtype: torch.dtype = torch.int32) -> Tensor:
            return torch.empty(shape, dtype=dtype, device=dev)

        with torch.cuda.device(dev):
            b = _dispatch_buffers(op, c, self._dtype, (N, P), new, x, topk_ids, topk_weights, scales, expert_major)
            i, o, out_x, out_scales = b.inputs, b.outputs, b.out_x, b.out_scales
            src_rank, src_token, out_ids, out_w, stats = b.src_rank, b.src_token, b.out_ids, b.out_w, b.stats
            lay, expert_x, expert_scales = b.layout, b.expert_x, b.expert_scales
            # Handle memory: handle_bytes, 16-byte aligned (the caching allocator aligns to 512).
            memory = handle.memory if reuse else new((self.handle_bytes + 3) // 4)
            o.handle_memory = _view(op, "handle memory", memory)
            h = Handle(handle._cpp if reuse else _ext.EpHandle(), int(x.shape[0]), memory)
            round_id = self._begin(op, "dispatch", rank)
            tensors = [x, scales, topk_ids, topk_weights, memory] + b.tensors()
            status = self._enqueue(rank, lambda s: self._group.dispatch(rank, i, o, h._cpp, bool(reuse), s), tensors)
        if not status.ok:
            self._fail(status)
        if deferred:
            check_status(self._broken)
        d = GpuDispatched(self, rank, round_id, out_x, out_scales, src_rank, src_token, out_ids, out_w, stats, lay,
                          expert_x, expert_scales, h)
        self._latest[rank] = weakref.ref(d)  # weak: the outputs are the caller's to free
        return d

    def combine(self, rank: int, handle: Any, y: Tensor, *, expert_major: bool = True,
                out: Optional[Tensor] = None, accumulate: bool = False,
                out_dtype: Optional[torch.dtype] = None) -> Tensor:
        """CpuGroup.combine on CUDA tensors of the group's device (y may have fewer rows than
        the capacity; it is then copied into a zero-padded buffer of the full capacity)."""
        op = f"ep combine (rank {rank})"
        rank = self._check_rank(op, rank)
        deferred = self._admit("combine", rank)
        if not isinstance(y, Tensor):
            raise TypeError(f"{op}: argument 'y': expected a torch.Tensor, got {type(y).__name__}")
        if not isinstance(handle, Handle) or handle.memory is None:
            raise TypeError(f"{op}: argument 'handle': expected the Handle of a dispatch of this group "
                            "(GpuDispatched.handle)")
        need = self.max_expert_rows if expert_major else self.max_recv_rows
        with torch.cuda.device(self.device):
            if y.dim() == 2 and y.shape[0] < need:  # the C++ contract takes the full capacity
                full = torch.zeros(need, y.shape[1], dtype=y.dtype, device=y.device)
                full[: y.shape[0]] = y
                y = full
            if out is None:
                out = torch.empty(handle.tokens, self._config.hidden, dtype=out_dtype or y.dtype, device=self.device)
            ci = _ext.EpCombineInputs()
            ci.expert_major = bool(expert_major)
            ci.y = _view(op, "y", y)
            out_view = _view(op, "out", out)
            self._begin(op, "combine", rank)
            status = self._enqueue(rank, lambda s: self._group.combine(rank, handle._cpp, ci, out_view,
                                                                       bool(accumulate), s),
                                   [y, out, handle.memory])
        if not status.ok:
            self._fail(status)
        if deferred:
            check_status(self._broken)
        return out


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
    recorded on the rank's stream).

    Errors: a call whose own arguments are bad raises ValueError / TypeError naming them (its
    kernels are still enqueued, to tell the peers); the same collective's later calls are still
    enqueued and raise the same error, and check() / synchronize() raise ValueError naming that
    rank (the ranks that called earlier learn it there). A rank that never makes its call makes
    the waiting ranks' kernels stop after timeout_seconds; check() or synchronize() then raise
    TimeoutError naming the step and the missing rank. After either the group refuses every call (build a new one).

    R may not exceed the device's hardware queues (CUDA_DEVICE_MAX_CONNECTIONS, 8 unless set
    before CUDA starts). Not yet run on a GPU from Python (the C++ loopback group has passed its
    GPU tests)."""

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
        self._dispatch_round = -1  # the round of the latest dispatch

    def _local_ranks(self) -> Sequence[int]:
        return range(self.num_ranks)

    def stream(self, rank: int) -> torch.cuda.Stream:
        """The stream rank `rank`'s calls run on."""
        return self._streams[self._check_rank("ep stream", rank)]

    def _begin(self, op: str, kind: str, rank: int) -> int:
        if self._round_ranks and kind != self._round_kind:
            missing = sorted(set(range(self.num_ranks)) - self._round_ranks)
            raise ValueError(f"{op}: ranks {missing} have not made their {self._round_kind} yet; every rank makes "
                             "each collective call in the same order")
        if rank in self._round_ranks:
            missing = sorted(set(range(self.num_ranks)) - self._round_ranks)
            raise ValueError(f"{op}: rank {rank} already made this {kind}; ranks {missing} have not yet")
        self._round_kind = kind
        if kind == "dispatch":
            self._dispatch_round = self._rounds_done
        return self._rounds_done

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

    def _require_round_complete(self, round_id: int, what: str) -> None:
        if round_id < 0:  # received_rows: the latest dispatch
            round_id = self._dispatch_round
        if round_id >= self._rounds_done:
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
    the default group; gloo or nccl). Every rank must construct it with the same arguments.
    Same dispatch / combine / Handle surface as CpuGroup with rank = this process's rank
    (`self.rank`), CUDA tensors of `device` (default: the current device), the calls enqueued on
    the current stream. Needs peer access between the GPUs (NVLink, or one GPU shared by the
    processes). Errors as LoopbackGroup's. Not yet run on a GPU from Python (the C++ IPC group has
    passed its two-process GPU test)."""

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
        c = _group_config(world, num_experts, top_k, max_tokens, hidden, dtype, scale_cols, tile_size,
                          timeout_seconds, partial_dtype)
        o = _gpu_options(worst_case, num_sms)
        dev = _cuda_device(self._what, device)

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
