"""The torch-free half of the package: configurations, presets, size queries and the mapping
of the library's Status to Python exceptions. Everything here works without PyTorch."""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Tuple

from . import _ext

__all__ = [
    "UnsupportedError",
    "RoutingConfig",
    "ModelPreset",
    "LocalExperts",
    "presets",
    "max_permuted_rows",
    "max_tiles",
    "layout_workspace_size",
    "version",
    "built_with_cuda",
    "PADDED_TOTAL",
    "NUM_TILES",
    "DROPPED",
]

PADDED_TOTAL: int = _ext.PADDED_TOTAL  # index of padded_total in Layout.totals
NUM_TILES: int = _ext.NUM_TILES  # index of num_tiles in Layout.totals
DROPPED: int = _ext.DROPPED  # index of the dropped-id counter in Layout.totals
NUM_TOTALS: int = _ext.NUM_TOTALS
MAX_GPU_TOP_K: int = _ext.MAX_GPU_TOP_K
MAX_GPU_EXPERTS: int = _ext.MAX_GPU_EXPERTS
SCALE_GROUP_SIZE: int = _ext.SCALE_GROUP_SIZE


class UnsupportedError(NotImplementedError):
    """A valid request that this build or backend does not implement (the library's
    Unsupported status), e.g. CUDA tensors with a CPU-only build."""


def check_status(status: Any) -> None:
    """Raises the Python exception for a non-ok Status of the C++ API.

    InvalidArgument becomes TypeError when it is about a dtype, ValueError otherwise; Timeout
    (expert parallelism) TimeoutError; the library's message names the operation and argument."""
    if status.ok:
        return
    code = status.code
    message = status.message
    if code == _ext.StatusCode.InvalidArgument:
        raise (TypeError if "dtype" in message else ValueError)(message)
    if code == _ext.StatusCode.Unsupported:
        raise UnsupportedError(message)
    if code == _ext.StatusCode.Timeout:
        raise TimeoutError(message)
    raise RuntimeError(f"switchyard: {code.name}: {message}")


def version() -> str:
    return _ext.version()


def built_with_cuda() -> bool:
    """Whether the extension carries the CUDA backend."""
    return _ext.built_with_cuda()


# ----------------------------------------------------------------------------- routing config

_PRE = {"none": _ext.PreFn.none, "softmax": _ext.PreFn.softmax, "sigmoid": _ext.PreFn.sigmoid,
        "sqrtsoftplus": _ext.PreFn.sqrtsoftplus}
_POST = {"none": _ext.PostFn.none, "softmax": _ext.PostFn.softmax, "sigmoid": _ext.PostFn.sigmoid,
         "normalize": _ext.PostFn.normalize}
_GROUP = {"none": _ext.GroupRule.none, "top2_sum": _ext.GroupRule.top2_sum, "max": _ext.GroupRule.max,
          "topk_sum": _ext.GroupRule.topk_sum}


def _pick(table: Dict[str, Any], value: Any, name: str) -> Any:
    if isinstance(value, str) and value in table:
        return table[value]
    raise ValueError(f"RoutingConfig: argument '{name}': unknown value {value!r}; expected one of "
                     + ", ".join(table))


@dataclasses.dataclass(frozen=True)
class RoutingConfig:
    """A routing rule (docs/design.md section 2; include/switchyard/routing.h).

    pre: "none" | "softmax" | "sigmoid" | "sqrtsoftplus"; post: "none" | "softmax" |
    "sigmoid" | "normalize"; group_rule: "none" | "top2_sum" | "max" | "topk_sum".
    Validated on construction: a bad field raises ValueError naming it."""

    num_experts: int
    top_k: int
    pre: str = "none"
    post: str = "softmax"
    group_rule: str = "none"
    n_group: int = 1
    topk_group: int = 1
    scale: float = 1.0

    def __post_init__(self) -> None:
        cpp = _ext.RoutingConfig()
        cpp.num_experts = int(self.num_experts)
        cpp.top_k = int(self.top_k)
        cpp.pre = _pick(_PRE, self.pre, "pre")
        cpp.post = _pick(_POST, self.post, "post")
        cpp.group_rule = _pick(_GROUP, self.group_rule, "group_rule")
        cpp.n_group = int(self.n_group)
        cpp.topk_group = int(self.topk_group)
        cpp.scale = float(self.scale)
        check_status(_ext.validate_routing(cpp))
        # The flat form the torch ops take (their schemas carry plain ints and a float).
        object.__setattr__(self, "_op_args", (cpp.num_experts, cpp.top_k, cpp.pre.value, cpp.post.value,
                                              cpp.group_rule.value, cpp.n_group, cpp.topk_group, float(self.scale)))

    @property
    def routing(self) -> "RoutingConfig":
        """The routing rule alone (a plain RoutingConfig, also for a ModelPreset)."""
        f = dataclasses.fields(RoutingConfig)
        return RoutingConfig(**{x.name: getattr(self, x.name) for x in f})


@dataclasses.dataclass(frozen=True)
class ModelPreset(RoutingConfig):
    """A model's routing rule (usable wherever a RoutingConfig is) plus its name, whether the
    model carries a per-expert selection bias, and its hidden size."""

    name: str = ""
    has_bias: bool = False
    hidden_size: int = 0


def _enum_name(table: Dict[str, Any], value: Any) -> str:
    for k, v in table.items():
        if v == value:
            return k
    raise RuntimeError(f"switchyard: unknown enum value {value!r}")


def _load_presets() -> Dict[str, ModelPreset]:
    out: Dict[str, ModelPreset] = {}
    for p in _ext.model_presets():
        r = p.routing
        out[p.name] = ModelPreset(num_experts=r.num_experts, top_k=r.top_k, pre=_enum_name(_PRE, r.pre),
                                  post=_enum_name(_POST, r.post), group_rule=_enum_name(_GROUP, r.group_rule),
                                  n_group=r.n_group, topk_group=r.topk_group, scale=r.scale, name=p.name,
                                  has_bias=p.has_bias, hidden_size=p.hidden_size)
    return out


#: Every model preset of docs/design.md, by name, in table order: presets["deepseek-v3"].
presets: Dict[str, ModelPreset] = _load_presets()


def resolve_routing(config: Any, op: str = "route", arg: str = "config") -> RoutingConfig:
    """A RoutingConfig from a RoutingConfig / ModelPreset or a preset name."""
    if isinstance(config, RoutingConfig):
        return config
    if isinstance(config, str):
        if config in presets:
            return presets[config]
        raise ValueError(f"{op}: argument '{arg}': unknown preset {config!r}; known presets: " + ", ".join(presets))
    raise TypeError(f"{op}: argument '{arg}': expected a RoutingConfig or a preset name, got {type(config).__name__}")


# ----------------------------------------------------------------------------- local experts


@dataclasses.dataclass(frozen=True)
class LocalExperts:
    """Which global experts this rank owns (include/switchyard/layout.h).

    LocalExperts.all(); LocalExperts.range(start, count, stride=1): local l <-> global
    start + l*stride; LocalExperts.map(expert_map, num_local): expert_map[E] int32 tensor on
    the ids' device giving each global expert its local index or -1."""

    start: int = 0
    count: int = -1
    stride: int = 1
    expert_map: Any = None

    @staticmethod
    def all() -> "LocalExperts":
        return LocalExperts()

    @staticmethod
    def range(start: int, count: int, stride: int = 1) -> "LocalExperts":
        return LocalExperts(int(start), int(count), int(stride), None)

    @staticmethod
    def map(expert_map: Any, num_local: int) -> "LocalExperts":
        return LocalExperts(0, int(num_local), 1, expert_map)

    def num_local(self, num_experts: int) -> int:
        return num_experts if self.count < 0 else self.count


def resolve_local(local: Any, arg: str = "local") -> LocalExperts:
    """None (all experts), a LocalExperts, a Python range of global expert ids, or a tuple
    (start, count) / (start, count, stride)."""
    if local is None:
        return LocalExperts.all()
    if isinstance(local, LocalExperts):
        return local
    if isinstance(local, range):
        if local.step < 1:
            raise ValueError(f"argument '{arg}': a range of experts needs a positive step, got {local.step}")
        return LocalExperts.range(local.start, len(local), local.step)
    if isinstance(local, tuple) and len(local) in (2, 3) and all(isinstance(v, int) for v in local):
        return LocalExperts.range(*local)
    raise TypeError(f"argument '{arg}': expected None, LocalExperts, a range or a (start, count[, stride]) tuple, "
                    f"got {local!r}")


# ----------------------------------------------------------------------------- devices and sizes


def parse_device(device: Any, arg: str = "device") -> Tuple[Any, int]:
    """(DeviceType, index) from "cpu", "cuda", "cuda:1" or a torch.device."""
    if isinstance(device, str):
        kind, _, index = device.partition(":")
        idx = int(index) if index else None
    else:
        kind, idx = getattr(device, "type", None), getattr(device, "index", None)
    if kind == "cpu":
        return _ext.DeviceType.cpu, 0
    if kind == "cuda":
        if idx is None:
            idx = 0
            try:  # "cuda" means the current device, as in torch
                import torch

                if torch.cuda.is_available():
                    idx = torch.cuda.current_device()
            except ImportError:
                pass
        return _ext.DeviceType.cuda, int(idx)
    raise ValueError(f"argument '{arg}': device {device!r} is not supported; expected cpu or cuda")


def layout_config(num_experts: int, tile_size: int, local: LocalExperts, expert_map_view: Any) -> Any:
    return _ext.LayoutConfig(int(num_experts), int(tile_size), local.start, local.count, local.stride,
                             expert_map_view)


def max_permuted_rows(num_tokens: int, top_k: int, num_local: int, tile_size: int) -> int:
    """Rows of every permuted array (and of gather's output) for T tokens, K picks, L local
    experts and tile size M: T*K + min(L, T*K)*(M-1)."""
    return _ext.max_permuted_rows(num_tokens, top_k, num_local, tile_size)


def max_tiles(num_tokens: int, top_k: int, num_local: int, tile_size: int) -> int:
    """Entries of tile_expert / tile_row_end: ceil(max_permuted_rows / M)."""
    return _ext.max_tiles(num_tokens, top_k, num_local, tile_size)


def layout_workspace_size(num_tokens: int, top_k: int, num_experts: int, tile_size: int = 1,
                          local: Any = None, device: Any = "cpu") -> int:
    """Bytes of scratch memory layout / route_and_layout need on `device` (0 on the CPU)."""
    loc = resolve_local(local)
    dev_type, dev_index = parse_device(device)
    cfg = layout_config(num_experts, tile_size, loc, _ext.TensorView())
    if loc.expert_map is not None:
        # Only the map's presence matters for the size; a data-less placeholder view keeps
        # torch out of here.
        cfg = _ext.LayoutConfig(int(num_experts), int(tile_size), 0, loc.count, 1,
                                _ext.TensorView(0, _ext.DType.int32, [int(num_experts)], [1], dev_type, dev_index))
    status, size = _ext.layout_workspace_size(cfg, int(num_tokens), int(top_k), dev_type, dev_index)
    check_status(status)
    return int(size)

