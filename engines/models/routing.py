"""How a mixture of experts picks each token's experts: one pure function per router
kind, router logits in, (expert ids, their weights) out.

Both compute in float32, as the reference implementations do (transformers, SGLang),
whatever the model's dtype: the choice of experts is then the same in every dtype
but for near-ties. The ids come in descending order of the score they were chosen by.
"""
from __future__ import annotations

import torch

from engines.config import MoeConfig


def route_softmax(logits: torch.Tensor, top_k: int, norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-MoE and Mixtral: softmax over all experts, the top k, renormalised to sum
    to 1 where `norm` (Mixtral always; Qwen3-MoE by norm_topk_prob). logits [T, E]
    -> ids [T, k] int64, weights [T, k] float32."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if norm:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights


def route_grouped_sigmoid(logits: torch.Tensor, bias: torch.Tensor, m: MoeConfig
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """GLM-4.5 and DeepSeek-V3: sigmoid scores; the experts are chosen by score + bias
    (e_score_correction_bias, the load balancer's) among the topk_group groups whose
    two best biased scores sum highest; their weights are the unbiased scores,
    renormalised where norm_topk_prob, times routed_scaling_factor."""
    scores = logits.float().sigmoid()                                     # [T, E]
    choice = scores + bias.float()
    t, groups = scores.shape[0], m.n_group
    if groups > 1:
        per_group = choice.view(t, groups, -1).topk(2, dim=-1)[0].sum(dim=-1)   # [T, G]
        kept = per_group.topk(m.topk_group, dim=-1)[1]
        mask = torch.zeros_like(per_group, dtype=torch.bool).scatter_(1, kept, True)
        choice = choice.masked_fill(~mask.repeat_interleave(m.num_experts // groups, dim=1),
                                    float("-inf"))
    ids = choice.topk(m.top_k, dim=-1)[1]
    weights = scores.gather(1, ids)
    if m.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, weights * m.routed_scaling_factor


def route(logits: torch.Tensor, bias: torch.Tensor | None, m: MoeConfig
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts of each row of router `logits` [T, E] by `m`'s router kind."""
    if m.router == "grouped_sigmoid":
        return route_grouped_sigmoid(logits, bias, m)
    return route_softmax(logits, m.top_k, m.norm_topk_prob)
