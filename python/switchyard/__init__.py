"""Switchyard: routing, layout, gather and combine for Mixture-of-Experts token traffic.

    import torch, switchyard
    ids, weights = switchyard.route(logits, "deepseek-v3", bias=bias)
    lay = switchyard.layout(ids, num_experts=256, tile_size=128)
    x_perm = switchyard.gather(x, lay)
    ...  # per-expert GEMMs over lay.offsets / lay.counts (or lay.tile_expert per tile)
    out = switchyard.combine(y_perm, lay, weights)

The configuration part (presets, RoutingConfig, size queries) works without PyTorch; the
operations on tensors and the torch custom ops (torch.ops.switchyard.*) need PyTorch and are
registered when it is importable. Semantics: docs/design.md; C++ contracts: include/switchyard/.
"""

# PyTorch first, when present: the extension's CUDA runtime dependency (libcudart.so.<major>)
# is then satisfied by the copy torch has already loaded rather than a second one.
try:
    import torch as _torch  # noqa: F401
except ImportError as _e:
    _TORCH_IMPORT_ERROR: "ImportError | None" = _e
else:
    _TORCH_IMPORT_ERROR = None

from ._core import (DROPPED, MAX_GPU_EXPERTS, MAX_GPU_TOP_K, NUM_TILES, PADDED_TOTAL, SCALE_GROUP_SIZE,
                    LocalExperts, ModelPreset, RoutingConfig, UnsupportedError, built_with_cuda,
                    layout_workspace_size, max_permuted_rows, max_tiles, presets, version)

__version__ = version()

if _TORCH_IMPORT_ERROR is None:
    from . import losses
    from .losses import (load_balancing_loss, router_probs, sequence_load_balancing_loss, tokens_per_expert,
                         update_expert_bias, z_loss)
    from .ops import (Layout, combine, empty_layout, empty_workspace, gather, layout, route,
                      route_and_layout, route_weights)
else:

    def _needs_torch(name: str):
        def missing(*args, **kwargs):
            raise ImportError(f"switchyard.{name} works on torch tensors; PyTorch is not importable "
                              f"({_TORCH_IMPORT_ERROR})")

        missing.__name__ = name
        return missing

    route = _needs_torch("route")
    layout = _needs_torch("layout")
    route_and_layout = _needs_torch("route_and_layout")
    gather = _needs_torch("gather")
    combine = _needs_torch("combine")
    empty_layout = _needs_torch("empty_layout")
    empty_workspace = _needs_torch("empty_workspace")
    route_weights = _needs_torch("route_weights")
    tokens_per_expert = _needs_torch("tokens_per_expert")
    router_probs = _needs_torch("router_probs")
    load_balancing_loss = _needs_torch("load_balancing_loss")
    sequence_load_balancing_loss = _needs_torch("sequence_load_balancing_loss")
    z_loss = _needs_torch("z_loss")
    update_expert_bias = _needs_torch("update_expert_bias")


def has_torch() -> bool:
    """Whether PyTorch was importable, i.e. whether the tensor operations are available."""
    return _TORCH_IMPORT_ERROR is None


__all__ = [
    "route",
    "layout",
    "route_and_layout",
    "gather",
    "combine",
    "empty_layout",
    "empty_workspace",
    "route_weights",
    "tokens_per_expert",
    "router_probs",
    "load_balancing_loss",
    "sequence_load_balancing_loss",
    "z_loss",
    "update_expert_bias",
    "presets",
    "RoutingConfig",
    "ModelPreset",
    "LocalExperts",
    "UnsupportedError",
    "max_permuted_rows",
    "max_tiles",
    "layout_workspace_size",
    "version",
    "built_with_cuda",
    "has_torch",
    "PADDED_TOTAL",
    "NUM_TILES",
    "DROPPED",
    "MAX_GPU_TOP_K",
    "MAX_GPU_EXPERTS",
    "SCALE_GROUP_SIZE",
]
if _TORCH_IMPORT_ERROR is None:
    __all__.append("Layout")
