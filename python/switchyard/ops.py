"""Switchyard on torch tensors: the torch custom ops (torch.ops.switchyard.*) and the Python API
built on them (switchyard.route, layout, route_and_layout, gather, combine).

This layer only translates (STYLE.md): a torch tensor becomes a TensorView (data pointer,
dtype, sizes, strides, device), the current CUDA stream becomes its integer handle, and a
non-ok Status becomes ValueError / TypeError naming the argument. The C++ library validates
everything before it writes anything, so a bad call leaves every tensor untouched.

Ops (all run on CPU or CUDA tensors, on the current CUDA stream of the tensors' device):
  out-variants, every written tensor declared mutated (Tensor(a!)); capturable in CUDA graphs
  when the caller preallocates (empty_layout, empty_workspace):
    switchyard::route_out, layout_out, route_and_layout_out, gather_out, combine_out
  functional forms, with fake (meta) implementations for torch.compile:
    switchyard::route, layout, route_and_layout, gather, gather_scaled, combine
  gradients (docs/design.md section 7; _autograd.py): the functional route, route_and_layout,
  gather, gather_scaled and combine; the out-variants are not on the autograd tape.
"""

import contextlib
import operator
import sys
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode as _current_dispatch_mode

from . import _autograd, _ext
from ._core import (DROPPED, NUM_TILES, NUM_TOTALS, PADDED_TOTAL, LocalExperts, RoutingConfig,
                    check_status, layout_workspace_size, resolve_local, resolve_routing)

__all__ = [
    "Layout",
    "route",
    "layout",
    "route_and_layout",
    "gather",
    "combine",
    "empty_layout",
    "empty_workspace",
    "route_weights",
]

# ----------------------------------------------------------------------------- translation

_DTYPES: Dict[torch.dtype, Any] = {
    torch.float32: _ext.DType.float32,
    torch.bfloat16: _ext.DType.bfloat16,
    torch.float16: _ext.DType.float16,
    torch.int32: _ext.DType.int32,
    torch.int64: _ext.DType.int64,
}
if hasattr(torch, "float8_e4m3fn"):
    _DTYPES[torch.float8_e4m3fn] = _ext.DType.float8_e4m3

_ABSENT = _ext.TensorView()


_CPU, _CUDA = _ext.DeviceType.cpu, _ext.DeviceType.cuda


def _view(op: str, name: str, t: Optional[Tensor]) -> Any:
    """The TensorView of `t` (absent for None); TypeError / ValueError naming `name` for what
    a TensorView cannot describe."""
    if t is None:
        return _ABSENT
    if not isinstance(t, Tensor):
        raise TypeError(f"{op}: argument '{name}': expected a torch.Tensor, got {type(t).__name__}")
    dtype = _DTYPES.get(t.dtype)
    if dtype is None:
        raise TypeError(f"{op}: argument '{name}': dtype {t.dtype} is not supported by Switchyard")
    if t.dim() > 4:
        raise ValueError(f"{op}: argument '{name}': has {t.dim()} dimensions, at most 4 are supported")
    # Every op makes a view of each tensor argument on each call (eager host time): the cheapest
    # queries (is_cuda / is_cpu, get_device, shape and strides as tuples).
    if t.is_cuda:
        dev_type, dev_index = _CUDA, t.get_device()
    elif t.is_cpu:
        dev_type, dev_index = _CPU, 0
    else:
        raise ValueError(f"{op}: argument '{name}': is on {t.device}, expected a cpu or cuda tensor")
    return _ext.TensorView(t.data_ptr(), dtype, t.shape, t.stride(), dev_type, dev_index)


def _call(fn: Any, device: torch.device, *args: Any, rename: Optional[Dict[str, str]] = None) -> None:
    """Runs a C++ call on the current stream of `device` (with `device` current, as the CUDA
    backend launches on the current device) and raises for its Status. `rename` maps the C++
    argument names of the messages to this API's names."""
    stream = 0
    guard: Any = contextlib.nullcontext()
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index != torch.cuda.current_device():
            guard = torch.cuda.device(index)
        stream = torch.cuda.current_stream(index).cuda_stream
    with guard:
        status = fn(*args, stream)
    if not status.ok and rename:
        try:
            check_status(status)
        except (TypeError, ValueError) as e:
            message = str(e)
            for cpp_name, py_name in rename.items():
                message = message.replace(f"argument '{cpp_name}'", f"argument '{py_name}'")
            raise type(e)(message) from None
    check_status(status)


def _workspace_arg(op: str, workspace: Tensor, like: Tensor) -> Tuple[int, int]:
    """(address, bytes) of a workspace: raw bytes of any dtype, contiguous, on `like`'s device
    (the C++ call sees only a pointer, so the device is checked here)."""
    if not isinstance(workspace, Tensor):
        raise TypeError(f"{op}: argument 'workspace': expected a torch.Tensor, got {type(workspace).__name__}")
    if isinstance(like, Tensor) and workspace.device != like.device and workspace.numel() > 0:
        raise ValueError(f"{op}: argument 'workspace': is on {workspace.device}, expected {like.device} like the "
                         "other arguments")
    if not workspace.is_contiguous():
        raise ValueError(f"{op}: argument 'workspace': must be contiguous")
    return workspace.data_ptr(), workspace.numel() * workspace.element_size()


def _routing(num_experts: int, top_k: int, pre: int, post: int, group_rule: int, n_group: int, topk_group: int,
             scale: float) -> Any:
    c = _ext.RoutingConfig()
    c.num_experts = num_experts
    c.top_k = top_k
    c.pre = _ext.PreFn(pre)
    c.post = _ext.PostFn(post)
    c.group_rule = _ext.GroupRule(group_rule)
    c.n_group = n_group
    c.topk_group = topk_group
    c.scale = scale
    return c


_LAYOUT_FIELDS = ("counts", "offsets", "permuted_to_expanded", "permuted_to_token", "expanded_to_permuted",
                  "tile_expert", "tile_row_end", "totals")


def _layout_view(op: str, prefix: str, arrays: Sequence[Optional[Tensor]]) -> Any:
    out = _ext.Layout()
    for field, t in zip(_LAYOUT_FIELDS, arrays):
        setattr(out, field, _view(op, prefix + field, t))
    return out


def _layout_config(op: str, num_experts: int, tile_size: int, local_start: int, local_count: int,
                   local_stride: int, expert_map: Optional[Tensor], independent_blocks: bool) -> Any:
    return _ext.LayoutConfig(num_experts, tile_size, local_start, local_count, local_stride,
                             _view(op, "local.expert_map", expert_map), bool(independent_blocks))


def _rows_2d(t: Tensor) -> int:
    return t.shape[0] if t.dim() == 2 else 0


def _cols_2d(t: Tensor) -> int:
    return t.shape[1] if t.dim() == 2 else 0


def _rows_1d(t: Tensor) -> int:
    return t.shape[0] if t.dim() == 1 else 0


def _num_local(num_experts: int, local_count: int) -> int:
    return num_experts if local_count < 0 else local_count


def _capacity(num_tokens: Any, top_k: Any, num_local: int, tile_size: int) -> Tuple[Any, Any]:
    """(max_permuted_rows, max_tiles), also for symbolic sizes under torch.compile; the same
    formula as include/switchyard/layout.h."""
    if num_local <= 0 or tile_size <= 0:
        return 0, 0
    picks = num_tokens * top_k
    rows = picks + torch.sym_min(num_local, picks) * (tile_size - 1)
    return rows, (rows + tile_size - 1) // tile_size


def _empty_layout_arrays(num_tokens: Any, top_k: Any, num_local: int, tile_size: int,
                         device: torch.device) -> List[Tensor]:
    num_local = max(num_local, 0)  # a bad count is reported by the library, naming it
    rows, tiles = _capacity(num_tokens, top_k, num_local, tile_size)

    def new(*shape: Any) -> Tensor:
        return torch.empty(shape, dtype=torch.int32, device=device)

    return [new(num_local), new(num_local + 1), new(rows), new(rows), new(num_tokens, top_k), new(tiles),
            new(tiles), new(NUM_TOTALS)]


def _workspace_for(topk_ids_shape: Tuple[int, int], num_experts: int, tile_size: int, local: LocalExperts,
                   device: torch.device) -> Tensor:
    try:
        size = layout_workspace_size(topk_ids_shape[0], max(topk_ids_shape[1], 1), num_experts, tile_size, local,
                                     device)
    except (ValueError, TypeError, NotImplementedError):
        size = 0  # the layout call itself reports the bad configuration or device, naming it
    return torch.empty(size, dtype=torch.uint8, device=device)


def _local_from_args(local_start: int, local_count: int, local_stride: int,
                     expert_map: Optional[Tensor]) -> LocalExperts:
    return LocalExperts(local_start, local_count, local_stride, expert_map)


# ----------------------------------------------------------------------------- route


@torch.library.custom_op("switchyard::route_out", mutates_args=("topk_ids", "topk_weights"))
def route_out(logits: Tensor, bias: Optional[Tensor], topk_ids: Tensor, topk_weights: Tensor, num_experts: int,
              top_k: int, pre: int, post: int, group_rule: int, n_group: int, topk_group: int,
              scale: float) -> None:
    """Routing into caller-owned topk_ids [T,K] (int32/int64) and topk_weights [T,K]
    (fp32/bf16); the routing rule as RoutingConfig._op_args."""
    _route_impl(logits, bias, topk_ids, topk_weights, num_experts, top_k, pre, post, group_rule, n_group, topk_group,
                scale)


def _route_impl(logits, bias, topk_ids, topk_weights, num_experts, top_k, pre, post, group_rule, n_group,
                topk_group, scale) -> None:
    op = "route"
    config = _routing(num_experts, top_k, pre, post, group_rule, n_group, topk_group, scale)
    _call(_ext.route, logits.device, config, _view(op, "logits", logits), _view(op, "bias", bias),
          _view(op, "topk_ids", topk_ids), _view(op, "topk_weights", topk_weights))


@route_out.register_fake
def _(logits, bias, topk_ids, topk_weights, num_experts, top_k, pre, post, group_rule, n_group, topk_group,
      scale) -> None:
    return None


@torch.library.custom_op("switchyard::route", mutates_args=())
def _route_functional(logits: Tensor, bias: Optional[Tensor], num_experts: int, top_k: int, pre: int, post: int,
                      group_rule: int, n_group: int, topk_group: int, scale: float, ids_dtype: torch.dtype,
                      weights_dtype: torch.dtype) -> Tuple[Tensor, Tensor]:
    num_tokens = _rows_2d(logits)
    ids = torch.empty((num_tokens, top_k), dtype=ids_dtype, device=logits.device)
    weights = torch.empty((num_tokens, top_k), dtype=weights_dtype, device=logits.device)
    _route_impl(logits, bias, ids, weights, num_experts, top_k, pre, post, group_rule, n_group, topk_group, scale)
    return ids, weights


@_route_functional.register_fake
def _(logits, bias, num_experts, top_k, pre, post, group_rule, n_group, topk_group, scale, ids_dtype,
      weights_dtype):
    num_tokens = _rows_2d(logits)
    return (logits.new_empty((num_tokens, top_k), dtype=ids_dtype),
            logits.new_empty((num_tokens, top_k), dtype=weights_dtype))


@torch.library.custom_op("switchyard::route_backward", mutates_args=())
def _route_backward_op(logits: Tensor, bias: Optional[Tensor], topk_ids: Tensor, grad_weights: Tensor, pre: int,
                       post: int, scale: float) -> Tensor:
    """d logits [T,E] in the logits' dtype from d weights [T,K] (routing.h route_backward)."""
    op = "route_backward"
    grad_logits = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    config = _routing(_cols_2d(logits), _cols_2d(topk_ids), pre, post, 0, 1, 1, scale)
    _call(_ext.route_backward, logits.device, config, _view(op, "logits", logits), _view(op, "bias", bias),
          _view(op, "topk_ids", topk_ids), _view(op, "grad_weights", grad_weights),
          _view(op, "grad_logits", grad_logits))
    return grad_logits


@_route_backward_op.register_fake
def _(logits, bias, topk_ids, grad_weights, pre, post, scale):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


# ----------------------------------------------------------------------------- layout

_LAYOUT_MUTATED = ("counts", "offsets", "permuted_to_expanded", "permuted_to_token", "expanded_to_permuted",
                   "tile_expert", "tile_row_end", "totals", "workspace")


@torch.library.custom_op("switchyard::layout_out", mutates_args=_LAYOUT_MUTATED)
def layout_out(topk_ids: Tensor, expert_map: Optional[Tensor], counts: Tensor, offsets: Tensor,
               permuted_to_expanded: Tensor, permuted_to_token: Tensor, expanded_to_permuted: Tensor,
               tile_expert: Tensor, tile_row_end: Tensor, totals: Tensor, workspace: Tensor, num_experts: int,
               tile_size: int, local_start: int, local_count: int, local_stride: int,
               independent_blocks: bool = False) -> None:
    """Layout of topk_ids into caller-owned int32 arrays (sized by max_permuted_rows /
    max_tiles) using a caller-owned uint8 workspace (layout_workspace_size bytes)."""
    _layout_impl(topk_ids, expert_map, counts, offsets, permuted_to_expanded, permuted_to_token, expanded_to_permuted,
                 tile_expert, tile_row_end, totals, workspace, num_experts, tile_size, local_start, local_count,
                 local_stride, independent_blocks)


def _layout_impl(topk_ids, expert_map, counts, offsets, permuted_to_expanded, permuted_to_token,
                 expanded_to_permuted, tile_expert, tile_row_end, totals, workspace, num_experts, tile_size,
                 local_start, local_count, local_stride, independent_blocks) -> None:
    op = "layout"
    config = _layout_config(op, num_experts, tile_size, local_start, local_count, local_stride, expert_map,
                            independent_blocks)
    out = _layout_view(op, "out.", (counts, offsets, permuted_to_expanded, permuted_to_token, expanded_to_permuted,
                                    tile_expert, tile_row_end, totals))
    ws, ws_bytes = _workspace_arg(op, workspace, topk_ids)
    _call(_ext.layout, topk_ids.device, config, _view(op, "topk_ids", topk_ids), out, ws, ws_bytes)


@layout_out.register_fake
def _(topk_ids, expert_map, counts, offsets, permuted_to_expanded, permuted_to_token, expanded_to_permuted,
      tile_expert, tile_row_end, totals, workspace, num_experts, tile_size, local_start, local_count,
      local_stride, independent_blocks=False) -> None:
    return None


_LayoutTuple = Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]


@torch.library.custom_op("switchyard::layout", mutates_args=())
def _layout_functional(topk_ids: Tensor, expert_map: Optional[Tensor], num_experts: int, tile_size: int,
                       local_start: int, local_count: int, local_stride: int,
                       independent_blocks: bool = False) -> _LayoutTuple:
    num_tokens, top_k = _rows_2d(topk_ids), _cols_2d(topk_ids)
    arrays = _empty_layout_arrays(num_tokens, top_k, _num_local(num_experts, local_count), tile_size,
                                  topk_ids.device)
    local = _local_from_args(local_start, local_count, local_stride, expert_map)
    workspace = _workspace_for((num_tokens, top_k), num_experts, tile_size, local, topk_ids.device)
    _layout_impl(topk_ids, expert_map, *arrays, workspace, num_experts, tile_size, local_start, local_count,
                 local_stride, independent_blocks)
    return tuple(arrays)  # type: ignore[return-value]


@_layout_functional.register_fake
def _(topk_ids, expert_map, num_experts, tile_size, local_start, local_count, local_stride,
      independent_blocks=False):
    return tuple(_empty_layout_arrays(_rows_2d(topk_ids), _cols_2d(topk_ids), _num_local(num_experts, local_count),
                                      tile_size, topk_ids.device))


# ----------------------------------------------------------------------------- route + layout

_ROUTE_AND_LAYOUT_MUTATED = ("topk_ids", "topk_weights") + _LAYOUT_MUTATED


@torch.library.custom_op("switchyard::route_and_layout_out", mutates_args=_ROUTE_AND_LAYOUT_MUTATED)
def route_and_layout_out(logits: Tensor, bias: Optional[Tensor], topk_ids: Tensor, topk_weights: Tensor,
                         expert_map: Optional[Tensor], counts: Tensor, offsets: Tensor,
                         permuted_to_expanded: Tensor, permuted_to_token: Tensor, expanded_to_permuted: Tensor,
                         tile_expert: Tensor, tile_row_end: Tensor, totals: Tensor, workspace: Tensor,
                         num_experts: int, top_k: int, pre: int, post: int, group_rule: int, n_group: int,
                         topk_group: int, scale: float, tile_size: int, local_start: int, local_count: int,
                         local_stride: int, independent_blocks: bool = False) -> None:
    """route_out then layout_out of the routed ids, in as few launches as the backend can."""
    _route_and_layout_impl(logits, bias, topk_ids, topk_weights, expert_map, counts, offsets, permuted_to_expanded,
                           permuted_to_token, expanded_to_permuted, tile_expert, tile_row_end, totals, workspace,
                           num_experts, top_k, pre, post, group_rule, n_group, topk_group, scale, tile_size,
                           local_start, local_count, local_stride, independent_blocks)


def _route_and_layout_impl(logits, bias, topk_ids, topk_weights, expert_map, counts, offsets, permuted_to_expanded,
                           permuted_to_token, expanded_to_permuted, tile_expert, tile_row_end, totals, workspace,
                           num_experts, top_k, pre, post, group_rule, n_group, topk_group, scale, tile_size,
                           local_start, local_count, local_stride, independent_blocks) -> None:
    op = "route_and_layout"
    routing = _routing(num_experts, top_k, pre, post, group_rule, n_group, topk_group, scale)
    config = _layout_config(op, num_experts, tile_size, local_start, local_count, local_stride, expert_map,
                            independent_blocks)
    out = _layout_view(op, "out.", (counts, offsets, permuted_to_expanded, permuted_to_token, expanded_to_permuted,
                                    tile_expert, tile_row_end, totals))
    ws, ws_bytes = _workspace_arg(op, workspace, logits)
    _call(_ext.route_and_layout, logits.device, routing, _view(op, "logits", logits), _view(op, "bias", bias),
          _view(op, "topk_ids", topk_ids), _view(op, "topk_weights", topk_weights), config, out, ws, ws_bytes)


@route_and_layout_out.register_fake
def _(logits, bias, topk_ids, topk_weights, expert_map, counts, offsets, permuted_to_expanded, permuted_to_token,
      expanded_to_permuted, tile_expert, tile_row_end, totals, workspace, num_experts, top_k, pre, post,
      group_rule, n_group, topk_group, scale, tile_size, local_start, local_count, local_stride,
      independent_blocks=False) -> None:
    return None


_RouteLayoutTuple = Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]


@torch.library.custom_op("switchyard::route_and_layout", mutates_args=())
def _route_and_layout_functional(logits: Tensor, bias: Optional[Tensor], expert_map: Optional[Tensor],
                                 num_experts: int, top_k: int, pre: int, post: int, group_rule: int, n_group: int,
                                 topk_group: int, scale: float, tile_size: int, local_start: int,
                                 local_count: int, local_stride: int, ids_dtype: torch.dtype,
                                 weights_dtype: torch.dtype, independent_blocks: bool = False) -> _RouteLayoutTuple:
    num_tokens, device = _rows_2d(logits), logits.device
    ids = torch.empty((num_tokens, top_k), dtype=ids_dtype, device=device)
    weights = torch.empty((num_tokens, top_k), dtype=weights_dtype, device=device)
    arrays = _empty_layout_arrays(num_tokens, top_k, _num_local(num_experts, local_count), tile_size, device)
    local = _local_from_args(local_start, local_count, local_stride, expert_map)
    workspace = _workspace_for((num_tokens, top_k), num_experts, tile_size, local, device)
    _route_and_layout_impl(logits, bias, ids, weights, expert_map, *arrays, workspace, num_experts, top_k, pre, post,
                           group_rule, n_group, topk_group, scale, tile_size, local_start, local_count,
                           local_stride, independent_blocks)
    return (ids, weights, *arrays)  # type: ignore[return-value]


@_route_and_layout_functional.register_fake
def _(logits, bias, expert_map, num_experts, top_k, pre, post, group_rule, n_group, topk_group, scale, tile_size,
      local_start, local_count, local_stride, ids_dtype, weights_dtype, independent_blocks=False):
    num_tokens = _rows_2d(logits)
    ids = logits.new_empty((num_tokens, top_k), dtype=ids_dtype)
    weights = logits.new_empty((num_tokens, top_k), dtype=weights_dtype)
    arrays = _empty_layout_arrays(num_tokens, top_k, _num_local(num_experts, local_count), tile_size,
                                  logits.device)
    return (ids, weights, *arrays)


# ----------------------------------------------------------------------------- gather

_GATHER_NAMES = {"x_scales": "scales", "x_perm": "out", "x_perm_scales": "out_scales"}


@torch.library.custom_op("switchyard::gather_out", mutates_args=("out", "out_scales"))
def gather_out(x: Tensor, scales: Optional[Tensor], permuted_to_token: Tensor, totals: Tensor, out: Tensor,
               out_scales: Optional[Tensor], zero_fill_padding: bool,
               expanded_to_permuted: Optional[Tensor] = None) -> None:
    """out[p] = x[permuted_to_token[p]] for the rows p < padded_total holding a token (scales
    move along); padding rows zero-filled when asked; rows >= padded_total untouched.
    expanded_to_permuted (the layout's [T,K], optional) changes only the speed: the CUDA
    backend then reads each token row once and writes it to all its rows."""
    _gather_impl(x, scales, permuted_to_token, totals, out, out_scales, zero_fill_padding, expanded_to_permuted)


def _gather_impl(x, scales, permuted_to_token, totals, out, out_scales, zero_fill_padding,
                 expanded_to_permuted=None) -> None:
    op = "gather"
    layout = _ext.Layout()
    layout.permuted_to_token = _view(op, "layout.permuted_to_token", permuted_to_token)
    layout.totals = _view(op, "layout.totals", totals)
    # Only a speed hint: passed when it is the [T,K] int32 array the C++ API accepts for this
    # x, so that a layout whose expanded_to_permuted does not match x keeps working as before.
    if (isinstance(expanded_to_permuted, Tensor) and expanded_to_permuted.dtype == torch.int32
            and expanded_to_permuted.dim() == 2 and isinstance(x, Tensor) and x.dim() == 2
            and expanded_to_permuted.shape[0] == x.shape[0] and expanded_to_permuted.device == x.device
            and expanded_to_permuted.is_contiguous()):
        layout.expanded_to_permuted = _view(op, "layout.expanded_to_permuted", expanded_to_permuted)
    _call(_ext.gather, x.device, _view(op, "x", x), _view(op, "scales", scales), layout, _view(op, "out", out),
          _view(op, "out_scales", out_scales), zero_fill_padding, rename=_GATHER_NAMES)


@gather_out.register_fake
def _(x, scales, permuted_to_token, totals, out, out_scales, zero_fill_padding, expanded_to_permuted=None) -> None:
    return None


def _gather_shapes(x: Tensor, scales: Optional[Tensor], permuted_to_token: Tensor) -> Tuple[Any, Any, Any]:
    rows = _rows_1d(permuted_to_token)
    x_shape = (rows, _cols_2d(x))
    scale_shape = None
    if scales is not None:
        scale_shape = (rows,) if scales.dim() == 1 else (rows, _cols_2d(scales))
    return rows, x_shape, scale_shape


@torch.library.custom_op("switchyard::gather", mutates_args=())
def _gather_functional(x: Tensor, permuted_to_token: Tensor, totals: Tensor, zero_fill_padding: bool,
                       expanded_to_permuted: Optional[Tensor] = None) -> Tensor:
    # Zero-initialized: rows past padded_total are never written by gather, and a functional
    # result must not carry uninitialized memory. gather_out skips this fill.
    _, shape, _ = _gather_shapes(x, None, permuted_to_token)
    out = torch.zeros(shape, dtype=x.dtype, device=x.device)
    _gather_impl(x, None, permuted_to_token, totals, out, None, zero_fill_padding, expanded_to_permuted)
    return out


@_gather_functional.register_fake
def _(x, permuted_to_token, totals, zero_fill_padding, expanded_to_permuted=None):
    _, shape, _ = _gather_shapes(x, None, permuted_to_token)
    return x.new_empty(shape)


@torch.library.custom_op("switchyard::gather_scaled", mutates_args=())
def _gather_scaled_functional(x: Tensor, scales: Tensor, permuted_to_token: Tensor, totals: Tensor,
                              zero_fill_padding: bool,
                              expanded_to_permuted: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    _, shape, scale_shape = _gather_shapes(x, scales, permuted_to_token)
    out = torch.zeros(shape, dtype=x.dtype, device=x.device)
    out_scales = torch.zeros(scale_shape, dtype=scales.dtype, device=scales.device)
    _gather_impl(x, scales, permuted_to_token, totals, out, out_scales, zero_fill_padding, expanded_to_permuted)
    return out, out_scales


@_gather_scaled_functional.register_fake
def _(x, scales, permuted_to_token, totals, zero_fill_padding, expanded_to_permuted=None):
    _, shape, scale_shape = _gather_shapes(x, scales, permuted_to_token)
    return x.new_empty(shape), scales.new_empty(scale_shape)


# ----------------------------------------------------------------------------- combine

_COMBINE_NAMES = {"topk_weights": "weights"}


@torch.library.custom_op("switchyard::combine_out", mutates_args=("out",))
def combine_out(y_perm: Tensor, expanded_to_permuted: Tensor, permuted_to_token: Tensor, weights: Optional[Tensor],
                out: Tensor, accumulate: bool) -> None:
    """out[t] = sum_k weights[t,k] * y_perm[expanded_to_permuted[t,k]] (+ out[t] when
    accumulate), in fp32, in k order."""
    _combine_impl(y_perm, expanded_to_permuted, permuted_to_token, weights, out, accumulate)


def _combine_impl(y_perm, expanded_to_permuted, permuted_to_token, weights, out, accumulate) -> None:
    op = "combine"
    layout = _ext.Layout()
    layout.expanded_to_permuted = _view(op, "layout.expanded_to_permuted", expanded_to_permuted)
    layout.permuted_to_token = _view(op, "layout.permuted_to_token", permuted_to_token)
    _call(_ext.combine, y_perm.device, _view(op, "y_perm", y_perm), layout, _view(op, "weights", weights),
          _view(op, "out", out), accumulate, rename=_COMBINE_NAMES)


@combine_out.register_fake
def _(y_perm, expanded_to_permuted, permuted_to_token, weights, out, accumulate) -> None:
    return None


@torch.library.custom_op("switchyard::combine", mutates_args=())
def _combine_functional(y_perm: Tensor, expanded_to_permuted: Tensor, permuted_to_token: Tensor,
                        weights: Optional[Tensor]) -> Tensor:
    out = torch.empty((_rows_2d(expanded_to_permuted), _cols_2d(y_perm)), dtype=y_perm.dtype, device=y_perm.device)
    _combine_impl(y_perm, expanded_to_permuted, permuted_to_token, weights, out, False)
    return out


@_combine_functional.register_fake
def _(y_perm, expanded_to_permuted, permuted_to_token, weights):
    return y_perm.new_empty((_rows_2d(expanded_to_permuted), _cols_2d(y_perm)))


@torch.library.custom_op("switchyard::combine_backward", mutates_args=())
def _combine_backward_op(grad_out: Tensor, y_perm: Tensor, expanded_to_permuted: Tensor, permuted_to_token: Tensor,
                         weights: Optional[Tensor], need_dy: bool, need_dw: bool) -> Tuple[Tensor, Tensor]:
    """combine's gradients (permute.h combine_backward): dy_perm in y_perm's shape and dtype (rows
    past the layout's capacity 0) and dw [T,K] fp32; each is empty [0, ...] when not asked."""
    op = "combine_backward"
    dy, dw = _combine_backward_shapes(grad_out, y_perm, expanded_to_permuted, need_dy, need_dw, torch.empty)
    rows = permuted_to_token.shape[0]
    layout = _ext.Layout()
    layout.expanded_to_permuted = _view(op, "layout.expanded_to_permuted", expanded_to_permuted)
    layout.permuted_to_token = _view(op, "layout.permuted_to_token", permuted_to_token)
    _call(_ext.combine_backward, grad_out.device, _view(op, "grad_out", grad_out),
          _view(op, "y_perm", y_perm if need_dw else None), layout, _view(op, "weights", weights),
          _view(op, "grad_y_perm", dy[:rows] if need_dy else None), _view(op, "grad_weights", dw if need_dw else None),
          rename=_COMBINE_NAMES)
    if need_dy and dy.shape[0] > rows:
        dy[rows:].zero_()
    return dy, dw


def _combine_backward_shapes(grad_out, y_perm, expanded_to_permuted, need_dy, need_dw, new):
    rows, cols = y_perm.shape[0], y_perm.shape[1]
    T, K = expanded_to_permuted.shape[0], expanded_to_permuted.shape[1]
    return (new((rows if need_dy else 0, cols), dtype=y_perm.dtype, device=grad_out.device),
            new((T if need_dw else 0, K), dtype=torch.float32, device=grad_out.device))


@_combine_backward_op.register_fake
def _(grad_out, y_perm, expanded_to_permuted, permuted_to_token, weights, need_dy, need_dw):
    return _combine_backward_shapes(grad_out, y_perm, expanded_to_permuted, need_dy, need_dw,
                                    lambda shape, dtype, device: grad_out.new_empty(shape, dtype=dtype))


# ----------------------------------------------------------------------------- Python API


class Layout(NamedTuple):
    """The arrays of a layout (include/switchyard/layout.h), all int32 on the ids' device.
    R = max_permuted_rows(T, K, L, M), N = max_tiles(T, K, L, M)."""

    counts: Tensor  # [L]   rows routed to each local expert
    offsets: Tensor  # [L+1] start row of each expert's tile-padded segment; [L] = padded_total
    permuted_to_expanded: Tensor  # [R]   t*K+k at each row; T*K on padding and unused rows
    permuted_to_token: Tensor  # [R]   token at each row; T on padding and unused rows
    expanded_to_permuted: Tensor  # [T,K] row of each (t, k); -1 when not placed
    tile_expert: Tensor  # [N]   local expert of each tile; -1 past num_tiles
    tile_row_end: Tensor  # [N]   end row of each tile's valid rows
    totals: Tensor  # [3]   padded_total, num_tiles, dropped (see PADDED_TOTAL, ...)

    # Host reads of the totals (each synchronizes with the device).
    @property
    def padded_total(self) -> int:
        return int(self.totals[PADDED_TOTAL])

    @property
    def num_tiles(self) -> int:
        return int(self.totals[NUM_TILES])

    @property
    def dropped(self) -> int:
        return int(self.totals[DROPPED])

    def as_moe_align_block_size(self) -> Tuple[Tensor, Tensor, Tensor]:
        """The layout in the form of vLLM's moe_align_block_size outputs, as views (no copy, no
        host sync), for a layout made with tile_size = block_size: (sorted_token_ids, expert_ids,
        num_tokens_post_padded). sorted_token_ids [R] holds t*K+k, T*K on padding rows;
        expert_ids [N] the local expert of each block, -1 past the last; num_tokens_post_padded
        [1] the padded total. Unlike moe_align_block_size, the rows of an expert are in token
        order (deterministic), and experts that are not local get no blocks at all (vLLM gives
        them blocks marked -1 in expert_ids)."""
        return self.permuted_to_expanded, self.tile_expert, self.totals[PADDED_TOTAL:PADDED_TOTAL + 1]


def _local_args(local: Any) -> Tuple[int, int, int, Optional[Tensor]]:
    if local is None:  # the common case, kept free of object construction for torch.compile
        return 0, -1, 1, None
    loc = resolve_local(local)
    return loc.start, loc.count, loc.stride, loc.expert_map


def _check_dtype(op: str, name: str, dtype: Any, allowed: Tuple[torch.dtype, ...]) -> None:
    if dtype not in allowed:
        raise TypeError(f"{op}: argument '{name}': dtype {dtype} is not supported, expected "
                        + " or ".join(str(d) for d in allowed))


def _check_tensor(op: str, name: str, t: Any) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{op}: argument '{name}': expected a torch.Tensor, got {type(t).__name__}")


def _check_layout(op: str, layout: Any) -> None:
    if not isinstance(layout, Layout):
        raise TypeError(f"{op}: argument 'layout': expected a switchyard.Layout (from layout, route_and_layout or "
                        f"empty_layout), got {type(layout).__name__}")


def _int_arg(op: str, name: str, value: Any, minimum: Optional[int] = None) -> int:
    """`value` as an int: TypeError naming `name` for a float, bool or other non-integer,
    ValueError below `minimum`."""
    if isinstance(value, bool):
        raise TypeError(f"{op}: argument '{name}': expected an int, got bool")
    try:
        v = value if isinstance(value, int) else operator.index(value)
    except TypeError:
        raise TypeError(f"{op}: argument '{name}': expected an int, got {type(value).__name__}") from None
    if minimum is not None and v < minimum:
        raise ValueError(f"{op}: argument '{name}': must be >= {minimum}, got {v}")
    return v


def _needs_grad(*tensors: Optional[Tensor]) -> bool:
    return torch.is_grad_enabled() and any(isinstance(t, Tensor) and t.requires_grad for t in tensors)


def _no_grad_out(op: str, *tensors: Optional[Tensor]) -> None:
    if _needs_grad(*tensors):
        raise ValueError(f"{op}: argument 'out': the out= form is not recorded by autograd and an input requires "
                         "grad; call it without out= (or under torch.no_grad())")


def route(logits: Tensor, config: Union[RoutingConfig, str], bias: Optional[Tensor] = None,
          ids_dtype: torch.dtype = torch.int32, weights_dtype: torch.dtype = torch.float32, *,
          out: Optional[Tuple[Tensor, Tensor]] = None) -> Tuple[Tensor, Tensor]:
    """Routes logits [T,E] (fp32/bf16/fp16, any row stride) with `config` (a RoutingConfig,
    a ModelPreset or a preset name such as "deepseek-v3"); bias: optional [E] fp32/bf16.

    Returns (topk_ids [T,K] ids_dtype, topk_weights [T,K] weights_dtype); with
    out=(topk_ids, topk_weights) writes those and returns them."""
    cfg = resolve_routing(config)
    _check_tensor("route", "logits", logits)
    if out is not None:
        _no_grad_out("route", logits)
        topk_ids, topk_weights = out
        torch.ops.switchyard.route_out(logits, bias, topk_ids, topk_weights, *cfg._op_args)
        return topk_ids, topk_weights
    _check_dtype("route", "ids_dtype", ids_dtype, (torch.int32, torch.int64))
    _check_dtype("route", "weights_dtype", weights_dtype, (torch.float32, torch.bfloat16))
    kernel = _eager_kernel(_route_functional, logits, bias) or torch.ops.switchyard.route
    return kernel(logits, bias, *cfg._op_args, ids_dtype, weights_dtype)


def _eager_kernel(opdef: Any, *tensors: Optional[Tensor]) -> Optional[Callable[..., Any]]:
    """The op's own Python kernel, to call instead of going through torch.ops, when nothing needs
    the dispatcher: plain eager execution (not traced by torch.compile, no dispatch or function
    mode such as FakeTensorMode), plain tensors, and no gradient to record. Saves the
    dispatcher's host time (about a fifth of a small call's); None: call the op."""
    fn = getattr(opdef, "_init_fn", None)
    if (fn is None or torch.compiler.is_compiling() or _current_dispatch_mode() is not None
            or torch._C._is_torch_function_mode_enabled()):
        return None
    grad = torch.is_grad_enabled()
    for t in tensors:
        if t is None:
            continue
        if type(t) is not Tensor and type(t) is not torch.nn.Parameter:
            return None
        if grad and t.requires_grad:
            return None
    return fn


def _raise_if_dropped(op: str, result: Layout) -> None:
    dropped = result.dropped
    if dropped > 0:
        raise ValueError(f"{op}: argument 'topk_ids': {dropped} ids are outside [0, num_experts) "
                         "(and not -1); they were not placed")


def layout(topk_ids: Tensor, num_experts: int, tile_size: int = 1, local: Any = None, *,
           out: Optional[Layout] = None, workspace: Optional[Tensor] = None, checked: bool = False,
           independent_blocks: bool = False) -> Layout:
    """Lays topk_ids [T,K] (int32/int64) out expert by expert, each expert's rows padded to a
    multiple of tile_size. local: None (all experts), LocalExperts, a range of global experts
    or (start, count[, stride]). out: a Layout from empty_layout to fill (CUDA graphs);
    workspace: uint8 tensor of layout_workspace_size bytes (allocated when None).
    checked=True synchronizes and raises ValueError when ids outside [0, E) were dropped.
    independent_blocks=True (CUDA): no block of the call waits for another, so it completes
    beside kernels that hold SMs (expert-parallel communication); slower from 4097 picks on."""
    _check_tensor("layout", "topk_ids", topk_ids)
    num_experts = _int_arg("layout", "num_experts", num_experts)
    tile_size = _int_arg("layout", "tile_size", tile_size)
    start, count, stride, expert_map = _local_args(local)
    if out is None:
        kernel = _eager_kernel(_layout_functional, topk_ids, expert_map) or torch.ops.switchyard.layout
        result = Layout(*kernel(topk_ids, expert_map, num_experts, tile_size, start, count, stride,
                                independent_blocks))
    else:
        if workspace is None:
            workspace = _workspace_for((_rows_2d(topk_ids), _cols_2d(topk_ids)), num_experts, tile_size,
                                       resolve_local(local), topk_ids.device)
        torch.ops.switchyard.layout_out(topk_ids, expert_map, *out, workspace, num_experts, tile_size, start, count,
                                        stride, independent_blocks)
        result = Layout(*out)
    if checked:
        _raise_if_dropped("layout", result)
    return result


def route_and_layout(logits: Tensor, config: Union[RoutingConfig, str], bias: Optional[Tensor] = None,
                     tile_size: int = 1, local: Any = None, ids_dtype: torch.dtype = torch.int32,
                     weights_dtype: torch.dtype = torch.float32, *,
                     out: Optional[Tuple[Tensor, Tensor, Layout]] = None,
                     workspace: Optional[Tensor] = None,
                     independent_blocks: bool = False) -> Tuple[Tensor, Tensor, Layout]:
    """route then layout in one call (fewer launches): returns (topk_ids, topk_weights, Layout).
    out=(topk_ids, topk_weights, Layout) fills caller-owned buffers. independent_blocks: as in
    layout()."""
    cfg = resolve_routing(config, "route_and_layout")
    _check_tensor("route_and_layout", "logits", logits)
    tile_size = _int_arg("route_and_layout", "tile_size", tile_size)
    start, count, stride, expert_map = _local_args(local)
    if out is None:
        _check_dtype("route_and_layout", "ids_dtype", ids_dtype, (torch.int32, torch.int64))
        _check_dtype("route_and_layout", "weights_dtype", weights_dtype, (torch.float32, torch.bfloat16))
        r = torch.ops.switchyard.route_and_layout(logits, bias, expert_map, *cfg._op_args, tile_size, start, count,
                                                  stride, ids_dtype, weights_dtype, independent_blocks)
        return r[0], r[1], Layout(*r[2:])
    _no_grad_out("route_and_layout", logits)
    topk_ids, topk_weights, lay = out
    if workspace is None:
        workspace = _workspace_for((_rows_2d(logits), cfg.top_k), cfg.num_experts, tile_size, resolve_local(local),
                                   logits.device)
    torch.ops.switchyard.route_and_layout_out(logits, bias, topk_ids, topk_weights, expert_map, *lay, workspace,
                                              *cfg._op_args, tile_size, start, count, stride, independent_blocks)
    return topk_ids, topk_weights, Layout(*lay)


def gather(x: Tensor, layout: Layout, scales: Optional[Tensor] = None, zero_fill_padding: bool = False, *,
           out: Optional[Tensor] = None, out_scales: Optional[Tensor] = None) -> Any:
    """x_perm[p] = x[layout.permuted_to_token[p]]: x [T,H] (bf16/fp16/fp32/fp8 e4m3, any row
    stride) into expert-contiguous rows [R,H]. scales: optional fp32 [T] / [T,1] / [T,H/128]
    moved with the rows (then returns (x_perm, x_perm_scales)). Padding rows are zeroed when
    zero_fill_padding. Without `out` the result is freshly zero-initialized; with out (and
    out_scales when scaled) those are written and rows >= padded_total are left untouched."""
    _check_tensor("gather", "x", x)
    _check_layout("gather", layout)
    # expanded_to_permuted lets the CUDA backend read each token row once (token-major); the
    # result is the same either way.
    e2p = layout.expanded_to_permuted
    if out is not None:
        _no_grad_out("gather", x, scales)
        torch.ops.switchyard.gather_out(x, scales, layout.permuted_to_token, layout.totals, out, out_scales,
                                        zero_fill_padding, e2p)
        return out if scales is None else (out, out_scales)
    if scales is None:
        kernel = _eager_kernel(_gather_functional, x) or torch.ops.switchyard.gather
        return kernel(x, layout.permuted_to_token, layout.totals, zero_fill_padding, e2p)
    kernel = _eager_kernel(_gather_scaled_functional, x, scales) or torch.ops.switchyard.gather_scaled
    return kernel(x, scales, layout.permuted_to_token, layout.totals, zero_fill_padding, e2p)


def combine(y_perm: Tensor, layout: Layout, weights: Optional[Tensor] = None, out: Optional[Tensor] = None,
            accumulate: bool = False) -> Tensor:
    """out[t] = sum_k weights[t,k] * y_perm[layout.expanded_to_permuted[t,k]] over placed k,
    in fp32, in k order (plain sum without weights). y_perm [R,H] bf16/fp16/fp32, any row
    stride; weights [T,K] fp32/bf16. out: [T,H] to write (and add to when accumulate);
    without out a new tensor of y_perm's dtype."""
    _check_tensor("combine", "y_perm", y_perm)
    _check_layout("combine", layout)
    if out is not None and _needs_grad(y_perm, weights, out):
        # On the autograd tape: the functional combine, then one torch add (or copy) into out.
        # With accumulate and a bf16/fp16 out this rounds twice (the sum, then out + sum) where
        # combine_out rounds once.
        result = torch.ops.switchyard.combine(y_perm, layout.expanded_to_permuted, layout.permuted_to_token, weights)
        return out.add_(result) if accumulate else out.copy_(result)
    if out is not None:
        torch.ops.switchyard.combine_out(y_perm, layout.expanded_to_permuted, layout.permuted_to_token, weights, out,
                                         accumulate)
        return out
    if accumulate:
        raise ValueError("combine: argument 'accumulate': needs `out` to accumulate into")
    kernel = _eager_kernel(_combine_functional, y_perm, weights) or torch.ops.switchyard.combine
    return kernel(y_perm, layout.expanded_to_permuted, layout.permuted_to_token, weights)


def empty_layout(num_tokens: int, top_k: int, num_experts: int, tile_size: int = 1, local: Any = None,
                 device: Any = "cpu") -> Layout:
    """Uninitialized Layout arrays for T tokens and K picks, to fill with layout(out=...) or
    route_and_layout(out=...): allocate once, reuse (and capture in CUDA graphs)."""
    op = "empty_layout"
    num_tokens = _int_arg(op, "num_tokens", num_tokens, 0)
    top_k = _int_arg(op, "top_k", top_k, 0)
    num_experts = _int_arg(op, "num_experts", num_experts, 1)
    tile_size = _int_arg(op, "tile_size", tile_size, 1)
    loc = resolve_local(local)
    arrays = _empty_layout_arrays(num_tokens, top_k, loc.num_local(num_experts), tile_size, torch.device(device))
    return Layout(*arrays)


def empty_workspace(num_tokens: int, top_k: int, num_experts: int, tile_size: int = 1, local: Any = None,
                    device: Any = "cpu") -> Tensor:
    """The uint8 workspace layout / route_and_layout need on `device` (empty on the CPU)."""
    op = "empty_workspace"
    num_tokens = _int_arg(op, "num_tokens", num_tokens, 0)
    top_k = _int_arg(op, "top_k", top_k, 0)
    num_experts = _int_arg(op, "num_experts", num_experts, 1)
    tile_size = _int_arg(op, "tile_size", tile_size, 1)
    size = layout_workspace_size(num_tokens, top_k, num_experts, tile_size, local, device)
    return torch.empty(size, dtype=torch.uint8, device=torch.device(device))


def route_weights(logits: Tensor, topk_ids: Tensor, config: Union[RoutingConfig, str],
                  bias: Optional[Tensor] = None) -> Tensor:
    """The routing weights of given picks, in torch ops and differentiable: post(pre(logits)
    [topk_ids]) * scale with the rules of route (non-finite logits and picks whose selection
    score logits' pre-score + bias is not finite get weight 0; bias only decides that).
    logits [T,E] of any float dtype (fp64 included), topk_ids [T,K] with distinct ids per row;
    returns fp32 weights (fp64 for fp64 logits). Its gradient is the one route's backward
    uses, so this is what gradcheck checks in fp64; with the ids route picked, it gives route's
    weights within fp32 rounding."""
    cfg = resolve_routing(config, "route_weights")
    _check_tensor("route_weights", "logits", logits)
    _check_tensor("route_weights", "topk_ids", topk_ids)
    _, _, pre, post, _, _, _, scale = cfg._op_args
    return _autograd.RouteWeights.apply(logits, topk_ids.long(), bias, pre, post, scale)


def _eager_without_dynamo(opdef: Any) -> None:
    """torch.library.custom_op wraps each kernel in torch._disable_dynamo, which imports
    torch._dynamo (and with it the compiler stack: 1.7-2.8 s) on the first call of the op in a
    process, also in plain eager code. While torch._dynamo is not imported nothing can trace
    into the kernel, so until then the kernel is called directly; the first call after
    torch._dynamo appears (torch.compile in use) hands over to torch's own wrapper for good.
    Relies on torch internals (CustomOpDef._backend_fns, the `__dynamo_disable` cache of
    torch._disable_dynamo); where they differ, nothing is changed."""
    for inner in list(getattr(opdef, "_backend_fns", {}).values()):
        target = getattr(inner, "__wrapped__", None)
        if target is None or getattr(target, "__dynamo_disable", None) is not None:
            continue

        def direct(*args: Any, _target: Any = target, _inner: Any = inner, **kwargs: Any) -> Any:
            if "torch._dynamo" not in sys.modules:
                return _target(*args, **kwargs)
            _target.__dict__.pop("__dynamo_disable", None)  # torch's wrapper caches its own on this call
            return _inner(*args, **kwargs)

        setattr(target, "__dynamo_disable", direct)


for _opdef in (route_out, _route_functional, layout_out, _layout_functional, route_and_layout_out,
               _route_and_layout_functional, gather_out, _gather_functional, _gather_scaled_functional, combine_out,
               _combine_functional):
    _eager_without_dynamo(_opdef)

_autograd.register()
