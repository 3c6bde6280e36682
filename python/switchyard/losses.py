"""Router statistics and losses for training (docs/design.md section 7), in plain torch ops:
differentiable where a gradient is meant to flow (through the router probabilities), with no
host synchronization, on CPU and CUDA tensors alike.

    ids, weights, lay = switchyard.route_and_layout(logits, "deepseek-v3", bias, tile_size=128)
    counts = switchyard.tokens_per_expert(lay)                   # [E] int32, no extra pass
    probs = switchyard.router_probs(logits, "deepseek-v3")       # [T,E], differentiable
    aux = 1e-4 * switchyard.sequence_load_balancing_loss(probs, ids, seq_len=4096)
    loss = task_loss + aux + 1e-3 * switchyard.z_loss(logits)
    switchyard.update_expert_bias(bias, counts, rate=1e-3)       # aux-loss-free balancing

With expert parallelism, load statistics must count the tokens of every rank (all-reduce the
counts first); these functions see only the tensors they are given.
"""

from typing import Any, Optional, Union

import torch
from torch import Tensor

from ._core import RoutingConfig, resolve_routing

__all__ = [
    "tokens_per_expert",
    "router_probs",
    "load_balancing_loss",
    "sequence_load_balancing_loss",
    "z_loss",
    "update_expert_bias",
]


def _fp32_or_fp64(t: Tensor) -> Tensor:
    """The tensor in the math dtype of these functions: fp32, or fp64 when given fp64."""
    return t if t.dtype == torch.float64 else t.float()


def tokens_per_expert(source: Any, num_experts: Optional[int] = None) -> Tensor:
    """Rows routed to each expert, int32 on the source's device.

    source: a Layout (returns its counts [L], the local experts' counts the layout already
    holds: no extra pass), or topk_ids [T,K] with num_experts (counts [E] of the ids in
    [0, E); -1 and other ids outside are not counted; one scatter of integer adds)."""
    counts = getattr(source, "counts", None)
    if isinstance(counts, Tensor):
        return counts
    if not isinstance(source, Tensor):
        raise TypeError(f"tokens_per_expert: argument 'source': expected a Layout or topk_ids tensor, got "
                        f"{type(source).__name__}")
    if num_experts is None:
        raise ValueError("tokens_per_expert: argument 'num_experts': needed when counting topk_ids")
    ids = source.reshape(-1).long()
    inside = (ids >= 0) & (ids < num_experts)
    ids = torch.where(inside, ids, torch.full_like(ids, num_experts))  # outside ids go to a dropped bin
    # Integer adds commute, so the result does not depend on the order of the scatter's updates.
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=source.device)
    counts.scatter_add_(0, ids, torch.ones_like(ids))
    return counts[:num_experts].to(torch.int32)


def router_probs(logits: Tensor, config: Union[RoutingConfig, str]) -> Tensor:
    """The per-expert router probabilities [T,E] (fp32, or fp64 for fp64 logits; differentiable) the balance losses
    take: softmax over all E logits for routers whose pre-score is none or softmax (Switch,
    GShard, Mixtral, Qwen), and the pre-scores normalized to sum 1 per token for sigmoid and
    sqrtsoftplus routers (DeepSeek-V3's s'_{i,t} = s_{i,t} / sum_j s_{j,t})."""
    cfg = resolve_routing(config, "router_probs")
    s = _fp32_or_fp64(logits)
    if cfg.pre in ("none", "softmax"):
        return torch.softmax(s, dim=-1)
    p = torch.sigmoid(s) if cfg.pre == "sigmoid" else torch.sqrt(torch.nn.functional.softplus(s))
    return p / p.sum(-1, keepdim=True)


def load_balancing_loss(probs: Tensor, counts: Tensor, top_k: int) -> Tensor:
    """The Switch Transformer / GShard load-balancing loss (unscaled; multiply by alpha):

        E * sum_e f_e * P_e,  f_e = counts[e] / (T * K),  P_e = mean_t probs[t, e]

    probs [T,E] (e.g. router_probs), counts [E] tokens per expert (tokens_per_expert of all E
    experts; integer or float, no gradient). It is 1 for a perfectly uniform router; its
    gradient flows through probs only. For K = 1 it is Switch's alpha-free loss; for K > 1 the
    form Megatron-LM uses."""
    num_tokens, num_experts = probs.shape
    if counts.shape != (num_experts,):
        raise ValueError(f"load_balancing_loss: argument 'counts': shape {tuple(counts.shape)}, expected "
                         f"({num_experts},) like probs' last dimension")
    probs = _fp32_or_fp64(probs)
    fraction = counts.detach().to(probs.dtype) / max(num_tokens * top_k, 1)
    mean_prob = probs.mean(0) if num_tokens else probs.sum(0)
    return num_experts * (fraction * mean_prob).sum()


def sequence_load_balancing_loss(probs: Tensor, topk_ids: Tensor, seq_len: Optional[int] = None) -> Tensor:
    """DeepSeek-V3's sequence-wise balance loss (unscaled; multiply by alpha), averaged over
    the sequences of the batch:

        per sequence b of S tokens:  sum_i f_i * P_i,
        f_i = E / (K * S) * (number of the sequence's tokens that picked i),
        P_i = mean over the sequence's tokens of probs[t, i]

    probs [B,S,E] with topk_ids [B,S,K], or probs [T,E] with topk_ids [T,K] and seq_len
    (T a multiple of it). DeepSeek-V3 takes probs = router_probs(logits, "deepseek-v3")."""
    if probs.dim() == 2:
        if seq_len is None:
            seq_len = probs.shape[0]
        if seq_len <= 0 or probs.shape[0] % seq_len:
            raise ValueError(f"sequence_load_balancing_loss: argument 'seq_len': {seq_len} does not divide the "
                             f"{probs.shape[0]} tokens")
        probs = probs.reshape(-1, seq_len, probs.shape[-1])
        topk_ids = topk_ids.reshape(-1, seq_len, topk_ids.shape[-1])
    batch, seq, num_experts = probs.shape
    top_k = topk_ids.shape[-1]
    if topk_ids.shape[:2] != (batch, seq):
        raise ValueError(f"sequence_load_balancing_loss: argument 'topk_ids': shape {tuple(topk_ids.shape)} does "
                         f"not match probs {tuple(probs.shape)}")
    # Counts per (sequence, expert) through one integer scatter over flattened (b, e) bins.
    ids = topk_ids.long()
    inside = (ids >= 0) & (ids < num_experts)
    bins = torch.arange(batch, device=ids.device)[:, None, None] * (num_experts + 1) + \
        torch.where(inside, ids, torch.full_like(ids, num_experts))
    counts = torch.zeros(batch * (num_experts + 1), dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, bins.reshape(-1), torch.ones_like(bins.reshape(-1)))
    probs = _fp32_or_fp64(probs)
    counts = counts.view(batch, num_experts + 1)[:, :num_experts].to(probs.dtype)
    fraction = counts * (num_experts / max(top_k * seq, 1))
    mean_prob = probs.mean(1)
    return (fraction * mean_prob).sum(-1).mean()


def z_loss(logits: Tensor) -> Tensor:
    """The router z-loss of ST-MoE (unscaled; multiply by its coefficient, e.g. 1e-3):
    mean over tokens of logsumexp(logits[t])^2, in fp32 (fp64 for fp64 logits)."""
    lse = torch.logsumexp(_fp32_or_fp64(logits), dim=-1)
    return (lse * lse).mean()


@torch.no_grad()
def update_expert_bias(bias: Tensor, counts: Tensor, rate: float) -> Tensor:
    """DeepSeek-V3's auxiliary-loss-free balancing, in place and without a host sync:

        bias += rate * sign(mean(load) - load),  load = counts (tokens per expert)

    so an overloaded expert's selection bias goes down by rate and an underloaded one's goes
    up (an expert exactly at the mean keeps its bias). bias [E] fp32/bf16 (the route bias,
    which has no gradient); counts [E]. Returns bias."""
    if counts.shape != bias.shape:
        raise ValueError(f"update_expert_bias: argument 'counts': shape {tuple(counts.shape)}, expected "
                         f"{tuple(bias.shape)} like bias")
    load = counts.float()
    step = torch.sign(load.mean() - load) * rate
    return bias.add_(step.to(bias.dtype))
