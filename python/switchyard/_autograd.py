"""Gradients of the Switchyard torch ops (docs/design.md section 7), registered with
torch.library.register_autograd on the functional ops, so that switchyard.route,
route_and_layout, gather and combine sit on the autograd tape, eagerly and under torch.compile.

Every backward is a Switchyard kernel (CPU and CUDA, the library's contract: caller-owned
memory, CUDA-graph capture, no atomics); route's torch formulas below (route_weights_backward)
remain for fp64 logits, which the library does not take, and as the reference gradcheck checks:

  gather    x_perm[p] = x[token(p)]
            dx[t] = sum over placed k of dx_perm[expanded_to_permuted[t,k]], in k order
            (switchyard combine without weights). dtype of x. An fp8 x has no gradient.
  combine   out[t] = sum_k w[t,k] y_perm[row(t,k)]
            Switchyard's combine_backward (permute.h; CPU and CUDA):
            dy_perm[p] = w[t,k] * dout[t] for the pick (t,k) at row p, 0 on padding and unused
            rows (a weighted gather, product in fp32, stored in y_perm's dtype);
            dw[t,k] = <dout[t], y_perm[row(t,k)]> in fp32, 0 for unplaced picks, stored in
            the weights' dtype.
  route     d logits from d weights through post, scale and pre, recomputing p from the saved
            logits in fp32 (fp64 for fp64 logits); the selection (top-K, groups, bias) is
            piecewise constant and passes no gradient; the bias gets none. Logits that are not
            finite, and picks whose selection score is not finite (weight 0), get gradient 0.
"""

from typing import Any, Optional, Tuple

import torch
from torch import Tensor

# The integer values of PreFn / PostFn carried by the ops' schemas (include/switchyard/routing.h).
PRE_NONE, PRE_SOFTMAX, PRE_SIGMOID, PRE_SQRTSOFTPLUS = 0, 1, 2, 3
POST_NONE, POST_SOFTMAX, POST_SIGMOID, POST_NORMALIZE = 0, 1, 2, 3

_NORMALIZE_EPS = 1e-20  # the post "normalize" denominator: sum + 1e-20, as the library

_FP8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))

# ----------------------------------------------------------------------------- route


def _math_dtype(t: Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _pre_scores(s: Tensor, finite: Tensor, pre: int) -> Tensor:
    """p = pre(s) per row; s has its non-finite entries replaced by 0 and `finite` marks them.
    Softmax runs over the finite logits alone, as the library's. p is 0 where s is not finite
    (those experts' picks get weight 0)."""
    if pre == PRE_SOFTMAX:
        p = torch.softmax(s.masked_fill(~finite, float("-inf")), dim=-1)
    elif pre == PRE_SIGMOID:
        p = torch.sigmoid(s)
    elif pre == PRE_SQRTSOFTPLUS:
        p = torch.sqrt(torch.logaddexp(s, torch.zeros_like(s)))  # softplus without a threshold
    else:
        p = s
    return torch.where(finite, p, torch.zeros_like(p))


def _route_terms(logits: Tensor, bias: Optional[Tensor], picks: Tensor, pre: int):
    """(s, finite, p, g, valid): logits in the math dtype (0 where not finite), their finite
    mask, p = pre(s), g = p at the picks [T,K] and which picks have a finite selection score."""
    s = logits.to(_math_dtype(logits))
    finite = torch.isfinite(s)
    s = torch.where(finite, s, torch.zeros_like(s))
    p = _pre_scores(s, finite, pre)
    g = p.gather(1, picks)
    valid = finite.gather(1, picks)
    if bias is not None:
        valid = valid & torch.isfinite(bias)[picks]
    return s, finite, p, g, valid


def _post_weights(g: Tensor, valid: Tensor, post: int, scale: float) -> Tensor:
    zero = torch.zeros_like(g)
    if post == POST_SOFTMAX:
        w = torch.softmax(g.masked_fill(~valid, float("-inf")), dim=-1)
    elif post == POST_NORMALIZE:
        gz = torch.where(valid, g, zero)
        w = gz / (gz.sum(-1, keepdim=True) + _NORMALIZE_EPS)
    elif post == POST_SIGMOID:
        w = torch.sigmoid(g)
    else:
        w = g
    return torch.where(valid, w, zero) * scale


def route_weights_value(logits: Tensor, bias: Optional[Tensor], picks: Tensor, pre: int, post: int,
                        scale: float) -> Tensor:
    """The routing weights of given picks [T,K] (int64) in torch: post(pre(logits)[picks]) *
    scale, in fp32 (fp64 for fp64 logits). The same function the library computes."""
    _, _, _, g, valid = _route_terms(logits, bias, picks, pre)
    return _post_weights(g, valid, post, scale)


def route_weights_backward(logits: Tensor, bias: Optional[Tensor], picks: Tensor, grad_weights: Tensor, pre: int,
                           post: int, scale: float) -> Tensor:
    """d logits [T,E] (logits' dtype) from d weights [T,K], for the picks [T,K] (int64)."""
    s, finite, p, g, valid = _route_terms(logits, bias, picks, pre)
    zero = torch.zeros_like(g)
    u = torch.where(valid, grad_weights.to(g.dtype) * scale, zero)
    if post == POST_SOFTMAX:
        w = torch.where(valid, torch.softmax(g.masked_fill(~valid, float("-inf")), dim=-1), zero)
        dg = w * (u - (w * u).sum(-1, keepdim=True))
    elif post == POST_NORMALIZE:
        gz = torch.where(valid, g, zero)
        denom = gz.sum(-1, keepdim=True) + _NORMALIZE_EPS
        dg = u / denom - (u * gz).sum(-1, keepdim=True) / (denom * denom)
    elif post == POST_SIGMOID:
        sg = torch.sigmoid(g)
        dg = u * sg * (1 - sg)
    else:
        dg = u
    dg = torch.where(valid, dg, zero)
    # A row's K ids are distinct, so this scatter writes each element at most once.
    dp = torch.zeros_like(s).scatter(1, picks, dg)
    if pre == PRE_SOFTMAX:
        ds = p * (dp - (p * dp).sum(-1, keepdim=True))
    elif pre == PRE_SIGMOID:
        ds = dp * p * (1 - p)
    elif pre == PRE_SQRTSOFTPLUS:
        # p = sqrt(softplus(s)): dp/ds = sigmoid(s) / (2 p); p > 0 for every finite s.
        positive = p > 0
        ds = torch.where(positive, dp * torch.sigmoid(s) / (2 * torch.where(positive, p, torch.ones_like(p))),
                         torch.zeros_like(p))
    else:
        ds = dp
    return torch.where(finite, ds, torch.zeros_like(ds)).to(logits.dtype)


class RouteWeights(torch.autograd.Function):
    """route_weights_value with route_weights_backward as its gradient (what gradcheck checks
    in fp64, and what the route ops' backward runs)."""

    @staticmethod
    def forward(ctx: Any, logits: Tensor, picks: Tensor, bias: Optional[Tensor], pre: int, post: int,
                scale: float) -> Tensor:
        ctx.save_for_backward(logits, picks, bias)
        ctx.rule = (pre, post, scale)
        return route_weights_value(logits, bias, picks, pre, post, scale)

    @staticmethod
    def backward(ctx: Any, grad_weights: Tensor):
        logits, picks, bias = ctx.saved_tensors
        return route_weights_backward(logits, bias, picks, grad_weights, *ctx.rule), None, None, None, None, None


def _route_setup(ctx: Any, inputs: Tuple[Any, ...], output: Tuple[Tensor, ...]) -> None:
    # switchyard::route(logits, bias, num_experts, top_k, pre, post, group_rule, n_group,
    #                   topk_group, scale, ids_dtype, weights_dtype) -> (ids, weights)
    logits, bias = inputs[0], inputs[1]
    ctx.rule = (inputs[4], inputs[5], inputs[9])
    ctx.num_inputs = len(inputs)
    ctx.save_for_backward(logits, bias, output[0])


_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _route_backward(ctx: Any, *grads: Optional[Tensor]):
    grad_weights = grads[1]
    logits, bias, ids = ctx.saved_tensors
    grad_logits = None
    if grad_weights is not None:
        if logits.dtype in _KERNEL_DTYPES:
            # Switchyard's route_backward (routing.h; CPU and CUDA, the same bits).
            weights = grad_weights if grad_weights.dtype in (torch.float32, torch.bfloat16) else grad_weights.float()
            grad_logits = torch.ops.switchyard.route_backward(logits, bias, ids, weights.contiguous(), *ctx.rule)
        else:  # fp64 logits (gradcheck): the torch formulas
            grad_logits = route_weights_backward(logits, bias, ids.long(), grad_weights, *ctx.rule)
    return (grad_logits,) + (None,) * (ctx.num_inputs - 1)  # no gradient for the bias


def _route_and_layout_setup(ctx: Any, inputs: Tuple[Any, ...], output: Tuple[Tensor, ...]) -> None:
    # switchyard::route_and_layout(logits, bias, expert_map, num_experts, top_k, pre, post,
    #     group_rule, n_group, topk_group, scale, ...) -> (ids, weights, *layout arrays)
    logits, bias = inputs[0], inputs[1]
    ctx.rule = (inputs[5], inputs[6], inputs[10])
    ctx.num_inputs = len(inputs)
    ctx.save_for_backward(logits, bias, output[0])


# ----------------------------------------------------------------------------- gather


def _gather_grad_x(grad_x_perm: Tensor, x_dtype: torch.dtype, expanded_to_permuted: Optional[Tensor],
                   permuted_to_token: Tensor, num_tokens: Any) -> Tensor:
    if x_dtype in _FP8:
        raise TypeError("gather: argument 'x': an fp8 x has no gradient (Switchyard's backward gives gradients in "
                        "the dtype of x, and fp8 gradients are not meaningful); gather the bf16/fp32 activations "
                        "and quantize after, or detach the fp8 tensor")
    if expanded_to_permuted is None or expanded_to_permuted.dim() != 2 or \
            expanded_to_permuted.shape[0] != num_tokens:
        raise ValueError("gather: argument 'expanded_to_permuted': the backward of gather needs the layout's "
                         "expanded_to_permuted [T,K] (switchyard.gather passes it)")
    # Each token sums its rows' gradients in k order: a combine without weights.
    return torch.ops.switchyard.combine(grad_x_perm.contiguous(), expanded_to_permuted, permuted_to_token, None)


def _gather_setup(ctx: Any, inputs: Tuple[Any, ...], output: Tensor) -> None:
    # switchyard::gather(x, permuted_to_token, totals, zero_fill_padding, expanded_to_permuted)
    x, permuted_to_token, _, _, expanded_to_permuted = inputs
    ctx.x_dtype, ctx.num_tokens = x.dtype, x.shape[0]
    ctx.save_for_backward(permuted_to_token, expanded_to_permuted)


def _gather_backward(ctx: Any, grad: Tensor):
    permuted_to_token, expanded_to_permuted = ctx.saved_tensors
    grad_x = None
    if grad is not None:
        grad_x = _gather_grad_x(grad, ctx.x_dtype, expanded_to_permuted, permuted_to_token, ctx.num_tokens)
    return grad_x, None, None, None, None


def _gather_scaled_setup(ctx: Any, inputs: Tuple[Any, ...], output: Tuple[Tensor, Tensor]) -> None:
    # switchyard::gather_scaled(x, scales, permuted_to_token, totals, zero_fill_padding,
    #                           expanded_to_permuted) -> (x_perm, x_perm_scales)
    x, scales, permuted_to_token, _, _, expanded_to_permuted = inputs
    ctx.x_dtype, ctx.num_tokens = x.dtype, x.shape[0]
    ctx.scales_shape = scales.shape
    ctx.save_for_backward(permuted_to_token, expanded_to_permuted)


def _gather_scaled_backward(ctx: Any, grad: Optional[Tensor], grad_scales: Optional[Tensor]):
    permuted_to_token, expanded_to_permuted = ctx.saved_tensors
    grad_x = grad_s = None
    if grad is not None and ctx.needs_input_grad[0]:
        grad_x = _gather_grad_x(grad, ctx.x_dtype, expanded_to_permuted, permuted_to_token, ctx.num_tokens)
    if grad_scales is not None and ctx.needs_input_grad[1]:
        # The scales move with the rows: the same per-token sum over [R, G] columns.
        rows = grad_scales.reshape(grad_scales.shape[0], -1).contiguous()
        grad_s = _gather_grad_x(rows, torch.float32, expanded_to_permuted, permuted_to_token, ctx.num_tokens)
        grad_s = grad_s.reshape(ctx.scales_shape)
    return grad_x, grad_s, None, None, None, None


# ----------------------------------------------------------------------------- combine


def _combine_setup(ctx: Any, inputs: Tuple[Any, ...], output: Tensor) -> None:
    # switchyard::combine(y_perm, expanded_to_permuted, permuted_to_token, weights) -> out
    y_perm, expanded_to_permuted, permuted_to_token, weights = inputs
    ctx.y_rows, ctx.y_dtype = y_perm.shape[0], y_perm.dtype
    ctx.save_for_backward(y_perm, expanded_to_permuted, permuted_to_token, weights)


def _combine_backward(ctx: Any, grad: Tensor):
    y_perm, expanded_to_permuted, permuted_to_token, weights = ctx.saved_tensors
    grad_y = grad_w = None
    need_dy = bool(ctx.needs_input_grad[0])
    need_dw = weights is not None and bool(ctx.needs_input_grad[3])
    if grad is not None and (need_dy or need_dw):
        dy, dw = torch.ops.switchyard.combine_backward(grad.contiguous(), y_perm, expanded_to_permuted,
                                                       permuted_to_token, weights, need_dy, need_dw)
        grad_y = dy if need_dy else None
        grad_w = dw.to(weights.dtype) if need_dw else None
    return grad_y, None, None, grad_w


# ----------------------------------------------------------------------------- registration


def register() -> None:
    lib = torch.library
    lib.register_autograd("switchyard::route", _route_backward, setup_context=_route_setup)
    lib.register_autograd("switchyard::route_and_layout", _route_backward, setup_context=_route_and_layout_setup)
    lib.register_autograd("switchyard::gather", _gather_backward, setup_context=_gather_setup)
    lib.register_autograd("switchyard::gather_scaled", _gather_scaled_backward, setup_context=_gather_scaled_setup)
    lib.register_autograd("switchyard::combine", _combine_backward, setup_context=_combine_setup)
