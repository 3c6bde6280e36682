"""Switchyard inside Hugging Face transformers (>= 5.14, < 6): an experts implementation for the
registry of `transformers.integrations.moe` and, optionally, Switchyard routing in place of the
models' routers.

    import switchyard.integrations.transformers as sy_hf
    sy_hf.register()                                   # adds "switchyard" to the experts registry
    model = AutoModelForCausalLM.from_pretrained(name, experts_implementation="switchyard")
    # or, on a loaded model: model.set_experts_implementation("switchyard")
    sy_hf.patch_routers(model)                         # optional: switchyard.route in the routers

The "switchyard" experts forward runs what "grouped_mm" runs, with Switchyard's token traffic
in place of its sort, indexing and per-pair sum: the model's routing (top_k_index,
top_k_weights) is laid out expert by expert (switchyard.layout, rows of an expert in token
order), the tokens are gathered (switchyard.gather), the same grouped GEMMs as "grouped_mm"
run over the expert-contiguous rows (gate/up or up, the module's `_apply_gate` or activation,
down, biases, transposed weights, post-expert norm, as the module's flags from
`use_experts_implementation` describe them), and switchyard.combine sums each token's rows
weighted by its routing weights in fp32, in k order: deterministic, run to run.

Pairs whose expert id is outside [0, num_experts) (the sentinels of transformers' expert
parallelism, or -1) are not placed by the layout and add nothing, as in "grouped_mm".

Gradients: the experts forward and the patched routers are made of Switchyard's ops with
gradients (switchyard._autograd, docs/design.md section 7) and differentiable torch calls, so
loss.backward() reaches the hidden states, the expert weights and biases, the routing weights
and, through a patched router, the router's weight (and bias); the selection (top-K, groups,
e_score_correction_bias) passes no gradient, as in the models' own routers. Tested in fp32
against "eager" (tests/python/test_transformers_integration.py). Where a Switchyard op has no
gradient, its backward raises its own error (switchyard._autograd: an fp8 x of
switchyard.gather, TypeError).
"""

from __future__ import annotations

import types
import warnings
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

import switchyard as sy
from switchyard._core import RoutingConfig

__all__ = [
    "NAME",
    "SUPPORTED_TRANSFORMERS",
    "register",
    "experts_forward",
    "patch_routers",
    "unpatch_routers",
    "router_routing",
    "PATCHABLE_ROUTERS",
]

#: The name under which register() adds the experts implementation.
NAME = "switchyard"

#: The transformers versions this integration is written and tested for (the `transformers`
#: extra of the package pins the same range). Tested with 5.14.1 and 5.25.0; before 5.14 the
#: DeepSeek-V3 and GLM-4.5 routers returned only logits (routing happened in the MoE block).
SUPPORTED_TRANSFORMERS = ">=5.14,<6"
_SUPPORTED_RANGE = ((5, 14), (6, 0))

# ----------------------------------------------------------------------------- Switchyard's ops


def _route(logits: Tensor, routing: RoutingConfig, bias: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    # int64 ids, as torch.topk gives them: the models' eager experts one_hot them. The weights
    # carry the gradient of the logits (switchyard._autograd); the ids and the bias get none.
    return sy.route(logits, routing, bias, ids_dtype=torch.int64, weights_dtype=torch.float32)


# ----------------------------------------------------------------------------- grouped GEMMs


def _grouped_linear_loop(input: Tensor, weight: Tensor, offs: Tensor, bias: Optional[Tensor] = None,
                         is_transposed: bool = False) -> Tensor:
    """The grouped linear of transformers' "grouped_mm" as one torch.mm per expert, for a
    transformers without `_grouped_linear`: rows offs[e-1]:offs[e] times expert e's weight
    ([E, in, out] when is_transposed, else [E, out, in]); bias [S, out] per row."""
    out_dim = weight.shape[2] if is_transposed else weight.shape[1]
    out = torch.zeros(input.shape[0], out_dim, dtype=weight.dtype, device=input.device)
    input = input.to(weight.dtype)
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            w = weight[e] if is_transposed else weight[e].transpose(0, 1)
            out[start:end] = input[start:end] @ w
        start = end
    if bias is not None:
        out.add_(bias)
    return out


def _transformers_grouped_linear() -> Callable:
    """transformers' own grouped linear (the very torch calls "grouped_mm" makes, with its
    choice among torch.nn.functional.grouped_mm, torch._grouped_mm and its fallback op), or
    the per-expert loop where this transformers has none."""
    try:
        from transformers.integrations.moe import _grouped_linear
    except ImportError:
        return _grouped_linear_loop
    return _grouped_linear


_grouped_linear: Optional[Callable] = None  # resolved at the first use or by register()


def _resolve_grouped_linear() -> Callable:
    global _grouped_linear
    _grouped_linear = _transformers_grouped_linear()
    return _grouped_linear


# ----------------------------------------------------------------------------- experts forward


def experts_forward(self: torch.nn.Module, hidden_states: Tensor, top_k_index: Tensor,
                    top_k_weights: Tensor) -> Tensor:
    """The "switchyard" experts implementation: the signature of the registry's functions
    (`self` is the model's experts module). hidden_states [T, H]; top_k_index [T, K] (int64 or
    int32; ids outside [0, num_experts) are skipped); top_k_weights [T, K]. Returns [T, H] in
    hidden_states' dtype."""
    num_experts = self.num_experts
    has_gate = getattr(self, "has_gate", True)
    has_bias = getattr(self, "has_bias", False)
    is_transposed = getattr(self, "is_transposed", False)

    ids = top_k_index if top_k_index.is_contiguous() else top_k_index.contiguous()
    # Tile size 1: no padding, so the rows of expert e are offsets[e]:offsets[e+1] and the
    # layout's tile arrays give each row's expert (tile_expert, -1 past the placed rows).
    lay = sy.layout(ids, num_experts)
    x_perm = sy.gather(hidden_states, lay)  # [T*K, H]; rows past the placed ones are zeros
    group_ends = lay.offsets[1:]  # the cumulative row counts grouped_mm takes as `offs`
    row_expert = lay.tile_expert.clamp(min=0) if has_bias else None
    # Rows past the placed ones (pairs with ids outside [0, num_experts)) are outside every
    # group: grouped_mm leaves them uninitialized in its output and in its backward's d input
    # (transformers' "grouped_mm" masks them the same way). When a gradient is being recorded
    # they are zeroed after each grouped linear, so that none reaches the biases (clamped to
    # expert 0 there) or the post-expert norm from them; combine and gather's backward do not
    # read them, and without a gradient nothing does (three launches fewer in inference).
    unplaced = (lay.tile_expert < 0).unsqueeze(-1) if torch.is_grad_enabled() else None

    if has_gate:
        up_weight = self.gate_up_proj
        up_bias = self.gate_up_proj_bias[row_expert] if has_bias else None
    else:
        up_weight = self.up_proj
        up_bias = self.up_proj_bias[row_expert] if has_bias else None
    grouped_linear = _grouped_linear or _resolve_grouped_linear()
    proj = grouped_linear(x_perm, up_weight, group_ends, bias=up_bias, is_transposed=is_transposed)
    if unplaced is not None:
        proj = proj.masked_fill(unplaced, 0.0)
    proj = self._apply_gate(proj) if has_gate else self.act_fn(proj)
    down_bias = self.down_proj_bias[row_expert] if has_bias else None
    proj = grouped_linear(proj, self.down_proj, group_ends, bias=down_bias, is_transposed=is_transposed)
    if unplaced is not None:
        proj = proj.masked_fill(unplaced, 0.0)
    if getattr(self, "has_post_expert_norm", False):
        proj = self.post_expert_norm(proj)

    # fp32 weights: combine accumulates in fp32 anyway, and fp16 weights (a fp16 Qwen3 router)
    # are not among combine's weight dtypes.
    weights = top_k_weights.to(torch.float32)
    if not weights.is_contiguous():
        weights = weights.contiguous()
    out = sy.combine(proj, lay, weights)
    return out.to(hidden_states.dtype)


def register(name: str = NAME) -> str:
    """Adds the Switchyard experts forward to transformers' experts registry under `name`
    (class-wide, so every model sees it); then `from_pretrained(..., experts_implementation=name)`
    or `model.set_experts_implementation(name)`. Returns `name`. Raises ImportError when the
    installed transformers has no experts registry (it appeared in 5.0)."""
    try:
        from transformers.integrations.moe import ExpertsInterface
    except ImportError as e:
        raise ImportError(f"switchyard.integrations.transformers needs transformers{SUPPORTED_TRANSFORMERS} with "
                          f"transformers.integrations.moe.ExpertsInterface ({e}); "
                          "install switchyard[transformers]") from e
    import transformers

    version = _major_minor(transformers.__version__)
    if version is not None and not _SUPPORTED_RANGE[0] <= version < _SUPPORTED_RANGE[1]:
        warnings.warn(f"switchyard.integrations.transformers is tested with transformers{SUPPORTED_TRANSFORMERS}, "
                      f"found {transformers.__version__}", stacklevel=2)
    _resolve_grouped_linear()
    ExpertsInterface.register(name, experts_forward)
    return name


def _major_minor(version: str) -> Optional[Tuple[int, int]]:
    parts = version.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


# ----------------------------------------------------------------------------- routers


def _softmax_topk_routing(m: torch.nn.Module, normalize: bool) -> RoutingConfig:
    # softmax over all E, top-K, renormalized == softmax over the K selected logits (the
    # mixtral / qwen3 / gpt-oss presets); without renormalization: softmax weights as they are.
    if normalize:
        return RoutingConfig(m.num_experts, m.top_k, pre="none", post="softmax")
    return RoutingConfig(m.num_experts, m.top_k, pre="softmax", post="none")


def _sigmoid_bias_routing(m: torch.nn.Module) -> RoutingConfig:
    # DeepSeek-V3 / GLM-4.5 (and Kimi-K2 loaded as DeepSeek-V3): sigmoid scores, selection on
    # score + e_score_correction_bias within the best topk_group groups by top-2 sum; weights
    # from the scores, normalized, scaled.
    grouped = m.num_group > 1
    return RoutingConfig(m.num_experts, m.top_k, pre="sigmoid", post="normalize" if m.norm_topk_prob else "none",
                         group_rule="top2_sum" if grouped else "none", n_group=m.num_group if grouped else 1,
                         topk_group=m.topk_group if grouped else 1, scale=float(m.routed_scaling_factor))


def _deepseek_v2_routing(m: torch.nn.Module) -> RoutingConfig:
    # DeepSeek-V2: softmax scores, top-K ("greedy") or top-K within the best topk_group groups
    # by their maximum ("group_limited_greedy"), weights = scores * routed_scaling_factor.
    scale = float(m.routed_scaling_factor)
    if m.topk_method == "greedy":
        return RoutingConfig(m.num_experts, m.top_k, pre="softmax", post="none", scale=scale)
    if m.topk_method == "group_limited_greedy":
        return RoutingConfig(m.num_experts, m.top_k, pre="softmax", post="none", group_rule="max",
                             n_group=m.num_group, topk_group=m.topk_group, scale=scale)
    raise sy.UnsupportedError(f"DeepseekV2TopkRouter: topk_method {m.topk_method!r} has no Switchyard rule; "
                              "known: 'greedy', 'group_limited_greedy'")


def _softmax_topk_forward(cast_weights: bool) -> Callable:
    def forward(self: torch.nn.Module, hidden_states: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        router_logits = F.linear(hidden_states, self.weight, getattr(self, "bias", None))
        ids, weights = _route(router_logits, self._switchyard_routing, None)
        if cast_weights:
            weights = weights.to(router_logits.dtype)
        return router_logits, weights, ids

    return forward


def _fp32_logits_forward(self: torch.nn.Module, hidden_states: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    # The DeepSeek routers: an fp32 router GEMM, fp32 weights; a selection bias where there is one.
    hidden_states = hidden_states.view(-1, self.hidden_dim)
    router_logits = F.linear(hidden_states.type(torch.float32), self.weight.type(torch.float32))
    ids, weights = _route(router_logits, self._switchyard_routing, getattr(self, "e_score_correction_bias", None))
    return router_logits, weights, ids


_SOFTMAX_ATTRS = ("num_experts", "top_k", "hidden_dim", "weight")
_SIGMOID_ATTRS = _SOFTMAX_ATTRS + ("num_group", "topk_group", "norm_topk_prob", "routed_scaling_factor",
                                   "e_score_correction_bias")


def _llama4_forward(self: torch.nn.Module, hidden_states: Tensor) -> Tuple[Tensor, Tensor]:
    # Llama 4 returns dense scores [T, E]: sigmoid of the top-K logits, 0 elsewhere.
    router_logits = F.linear(hidden_states, self.weight, self.bias)
    ids, weights = _route(router_logits, self._switchyard_routing, None)
    router_scores = torch.zeros_like(router_logits).scatter_(1, ids, weights.to(router_logits.dtype))
    return router_scores, router_logits


class _RouterKind:
    def __init__(self, preset: str, routing: Callable[[torch.nn.Module], RoutingConfig], forward: Callable,
                 attributes: Tuple[str, ...]):
        self.preset = preset  # the switchyard preset whose rule this router computes
        self.routing = routing
        self.forward = forward
        self.attributes = attributes  # what routing and forward read from the module

    def check(self, module: torch.nn.Module, op: str) -> None:
        """UnsupportedError when the module is an older form of the class (transformers
        before 5.14 routed DeepSeek-V3 and GLM-4.5 in the MoE block, not in the router)."""
        missing = [a for a in self.attributes if not hasattr(module, a)]
        if missing:
            raise sy.UnsupportedError(
                f"{op}: {type(module).__name__} of this transformers has no {', '.join(missing)}; "
                f"switchyard patches the routers of transformers{SUPPORTED_TRANSFORMERS}")


# Router classes of transformers' models (matched by module and class name, so that no model
# module is imported here), the preset with their rule, the rule for a module's configuration,
# and a forward returning what the original returns: (router_logits, weights, ids); Llama 4's
# (dense scores, router_logits).
_ROUTERS: Dict[Tuple[str, str], _RouterKind] = {
    ("qwen3_moe", "Qwen3MoeTopKRouter"): _RouterKind(
        "qwen3-235b-a22b", lambda m: _softmax_topk_routing(m, m.norm_topk_prob), _softmax_topk_forward(True),
        _SOFTMAX_ATTRS + ("norm_topk_prob",)),
    ("qwen3_next", "Qwen3NextTopKRouter"): _RouterKind(
        "qwen3-next-80b", lambda m: _softmax_topk_routing(m, m.norm_topk_prob), _softmax_topk_forward(True),
        _SOFTMAX_ATTRS + ("norm_topk_prob",)),
    ("mixtral", "MixtralTopKRouter"): _RouterKind(
        "mixtral-8x7b", lambda m: _softmax_topk_routing(m, True), _softmax_topk_forward(False), _SOFTMAX_ATTRS),
    ("gpt_oss", "GptOssTopKRouter"): _RouterKind(
        "gpt-oss-120b", lambda m: _softmax_topk_routing(m, True), _softmax_topk_forward(True),
        _SOFTMAX_ATTRS + ("bias",)),
    ("deepseek_v3", "DeepseekV3TopkRouter"): _RouterKind("deepseek-v3", _sigmoid_bias_routing, _fp32_logits_forward,
                                                         _SIGMOID_ATTRS),
    ("deepseek_v2", "DeepseekV2TopkRouter"): _RouterKind(
        "deepseek-v2", _deepseek_v2_routing, _fp32_logits_forward,
        _SOFTMAX_ATTRS + ("topk_method", "num_group", "topk_group", "routed_scaling_factor")),
    ("llama4", "Llama4Router"): _RouterKind(
        "llama4-maverick", lambda m: RoutingConfig(m.num_experts, m.top_k, pre="none", post="sigmoid"),
        _llama4_forward, ("num_experts", "top_k", "weight", "bias")),
    ("glm4_moe", "Glm4MoeTopkRouter"): _RouterKind("glm-4.5", _sigmoid_bias_routing, _fp32_logits_forward,
                                                   _SIGMOID_ATTRS),
}

#: (transformers model type, router class name) -> the Switchyard preset with that rule.
PATCHABLE_ROUTERS: Dict[Tuple[str, str], str] = {k: v.preset for k, v in _ROUTERS.items()}


def _router_kind(module: torch.nn.Module) -> Optional[_RouterKind]:
    cls = type(module)
    parts = cls.__module__.split(".")
    if len(parts) != 4 or parts[:2] != ["transformers", "models"]:
        return None
    return _ROUTERS.get((parts[2], cls.__name__))


def router_routing(module: torch.nn.Module) -> RoutingConfig:
    """The Switchyard RoutingConfig that computes this router module's rule with its own
    configuration (num_experts, top_k, norm_topk_prob, groups, scaling factor). ValueError for
    a module that patch_routers does not know."""
    kind = _router_kind(module)
    if kind is None:
        raise ValueError(f"router_routing: argument 'module': {type(module).__module__}.{type(module).__name__} is "
                         "not a router switchyard knows; known: " + ", ".join(n for _, n in _ROUTERS))
    kind.check(module, "router_routing")
    return kind.routing(module)


def patch_routers(model: torch.nn.Module) -> int:
    """Replaces the forward of every router in `model` whose rule Switchyard has as a preset
    (PATCHABLE_ROUTERS) by switchyard.route over the router GEMM the original computes, with
    the module's own weight, bias and e_score_correction_bias. A patched router returns what
    the original does, (router_logits, weights, ids) (Llama 4: dense scores and logits): ids
    int64 in descending score order (ties: lower expert first), weights in the original's dtype.
    Parameters, buffers and state_dict keys are unchanged.
    Returns the number of routers patched (0 for a model without known routers). Calling it
    again leaves patched routers as they are; unpatch_routers(model) restores them.
    sy.UnsupportedError, before anything is patched, for a known router class in an older form
    (transformers before 5.14) or with a rule Switchyard lacks (DeepSeek-V2's topk_method other
    than "greedy" / "group_limited_greedy"); ValueError for a configuration the rule rejects."""
    to_patch = []
    patched = 0
    for module in model.modules():
        kind = _router_kind(module)
        if kind is None:
            continue
        patched += 1
        if "forward" not in module.__dict__:
            kind.check(module, "patch_routers")
            to_patch.append((module, kind, kind.routing(module)))
    for module, kind, routing in to_patch:
        module._switchyard_routing = routing
        module.forward = types.MethodType(kind.forward, module)
    return patched


def unpatch_routers(model: torch.nn.Module) -> int:
    """Restores the original forward of the routers patch_routers patched; returns their count."""
    restored = 0
    for module in model.modules():
        if _router_kind(module) is not None and "forward" in module.__dict__:
            del module.forward
            del module._switchyard_routing
            restored += 1
    return restored
