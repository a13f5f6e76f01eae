"""One rank's part of a loaded model: a network of its heads and MLP slice whose
weights are cut from the whole one (engines/tp/plan.py says which rows and columns)."""
from __future__ import annotations

from dataclasses import replace

import torch

from engines.loader import LoadedModel, new_net, whole_net
from engines.models.config import ModelConfig
from engines.models.llama import LlamaForCausalLM
from engines.tp.plan import Shard, TpPlan


def _rows(w: torch.Tensor, *spans: tuple[int, int]) -> torch.Tensor:
    return torch.cat([w[a:b] for a, b in spans])


def weight_slice(name: str, whole: torch.Tensor, cfg: ModelConfig, plan: TpPlan) -> torch.Tensor:
    """The part of the whole model's parameter `name` that `plan`'s rank holds."""
    d, hq, hkv, inter = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
    q, kv, mid = plan.q_heads(cfg), plan.kv_heads(cfg), plan.intermediate(cfg)
    if name.endswith("self_attn.qkv_proj.weight") or name.endswith("self_attn.qkv_proj.bias"):
        k0, v0 = hq * d, (hq + hkv) * d
        return _rows(whole, (q.start * d, q.stop * d), (k0 + kv.start * d, k0 + kv.stop * d),
                     (v0 + kv.start * d, v0 + kv.stop * d))
    if name.endswith("self_attn.o_proj.weight"):
        return whole[:, q.start * d:q.stop * d]
    if name.endswith("mlp.gate_up_proj.weight"):
        return _rows(whole, (mid.start, mid.stop), (inter + mid.start, inter + mid.stop))
    if name.endswith("mlp.down_proj.weight"):
        return whole[:, mid.start:mid.stop]
    return whole           # norms, embedding, LM head: whole on every rank


def copy_shards(whole: LlamaForCausalLM, part: LlamaForCausalLM, plan: TpPlan) -> None:
    """Overwrite `part`'s weights with their slices of `whole`'s (layouts kept)."""
    source = dict(whole.named_parameters())
    with torch.no_grad():
        for name, param in part.named_parameters():
            param.copy_(weight_slice(name, source[name], whole.cfg, plan))


def shard_model(model: LoadedModel, plan: TpPlan) -> LoadedModel:
    """`model` as `plan`'s rank computes it (a new network; `model`'s is left as it is)."""
    cfg = plan.config(model.cfg)
    net = new_net(cfg, model.device, model.dtype)
    copy_shards(model.net, net, plan)
    net.setup_rotary(model.dtype, model.device)
    net.eval()
    return replace(model, cfg=cfg, net=net, shard=Shard(model.cfg, plan))


def update_part(part: LoadedModel, path: str, version: str | None = None) -> str:
    """Replace a rank's part with its slice of checkpoint `path` (the whole model is read,
    cut and let go; on any error the old weights stay). Returns the version."""
    whole = whole_net(path, part.shard.whole, part.device, part.dtype)
    copy_shards(whole, part.net, part.shard.plan)
    if version:
        part.version = version
    return part.version
