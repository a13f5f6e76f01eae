"""One rank's part of a loaded model: a network of its heads and MLP slice whose
weights are cut from the whole one (engines/tp/plan.py says which rows and columns).
A mixture's stacked experts (gate_up [E*2I, hidden], down [E*hidden, I],
engines/models/moe.py) keep their held experts' rows and, under --tp, each one's
intermediate slice: gate/up rows, down columns."""
from __future__ import annotations

from dataclasses import replace

import torch

from engines.loader import LoadedModel, new_net, whole_net
from engines.config import ModelConfig
from engines.models.llama import LlamaForCausalLM
from engines.models.moe import Experts, SparseMoe
from engines.tp.experts import ExpertParallel
from engines.tp.plan import Shard, TpPlan


def _rows(w: torch.Tensor, *spans: tuple[int, int]) -> torch.Tensor:
    return torch.cat([w[a:b] for a, b in spans])


def _row_spans(name: str, cfg: ModelConfig, plan: TpPlan) -> list[tuple[int, int]] | None:
    """The whole parameter's rows a column-parallel one keeps here (None: all rows)."""
    d, hq, hkv, inter = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
    q, kv, mid = plan.q_heads(cfg), plan.kv_heads(cfg), plan.intermediate(cfg)
    if name.endswith("self_attn.qkv_proj.weight") or name.endswith("self_attn.qkv_proj.bias"):
        k0, v0 = hq * d, (hq + hkv) * d
        return [(q.start * d, q.stop * d), (k0 + kv.start * d, k0 + kv.stop * d),
                (v0 + kv.start * d, v0 + kv.stop * d)]
    if name.endswith("mlp.gate_up_proj.weight"):
        return [(mid.start, mid.stop), (inter + mid.start, inter + mid.stop)]
    if name.endswith("mlp.shared_experts.gate_up_proj.weight"):
        return _gate_up(plan.expert_intermediate(cfg), cfg.moe.intermediate_size, cfg.moe.shared_experts)
    if name.endswith("mlp.experts.gate_up_proj"):
        i, mid = cfg.moe.intermediate_size, plan.expert_intermediate(cfg)
        return [(e * 2 * i + a, e * 2 * i + b) for e in plan.held_experts(cfg)
                for a, b in _gate_up(mid, i, 1)]
    if name.endswith("mlp.experts.down_proj"):
        held, h = plan.held_experts(cfg), cfg.hidden_size
        return [(held.start * h, held.stop * h)]
    return None


def _gate_up(mid: range, inter: int, experts: int) -> list[tuple[int, int]]:
    """Rows of a [gate; up] projection of `experts` experts' intermediate `inter` each,
    split as `mid` splits one expert's: its run of gate rows, then of up rows."""
    n = len(mid)
    whole, start = inter * experts, mid.start // n * n * experts
    return [(start, start + n * experts), (whole + start, whole + start + n * experts)]


def _columns(name: str, cfg: ModelConfig, plan: TpPlan) -> slice:
    """The whole parameter's columns a row-parallel one keeps here (all for others)."""
    d, q, mid = cfg.head_dim, plan.q_heads(cfg), plan.intermediate(cfg)
    if name.endswith("self_attn.o_proj.weight"):
        return slice(q.start * d, q.stop * d)
    if name.endswith("mlp.down_proj.weight"):
        return slice(mid.start, mid.stop)
    if name.endswith("mlp.experts.down_proj") or name.endswith("mlp.shared_experts.down_proj.weight"):
        part = plan.expert_intermediate(cfg)
        n = len(part) * (cfg.moe.shared_experts if "shared" in name else 1)
        return slice(part.start // len(part) * n, part.start // len(part) * n + n)
    return slice(None)


def weight_slice(name: str, whole: torch.Tensor, cfg: ModelConfig, plan: TpPlan) -> torch.Tensor:
    """The part of the whole model's parameter `name` that `plan`'s rank holds: rows of
    q/k/v and gate/up, columns of o and down, the rest whole (norms, embedding, head)."""
    spans = _row_spans(name, cfg, plan)
    if spans is not None:
        whole = _rows(whole, *spans)
    cols = _columns(name, cfg, plan)
    return whole if cols == slice(None) else whole[:, cols]


@torch.no_grad()
def apply_rows(part: torch.Tensor, name: str, whole: torch.Tensor, rows: list[tuple[int, int]],
               cfg: ModelConfig, plan: TpPlan) -> None:
    """Copy into `part` (this rank's slice of parameter `name`) what lies in the whole
    parameter's `rows` ([start, stop) ranges) of `whole`: a push that wrote only those."""
    spans = _row_spans(name, cfg, plan)
    index = torch.cat([torch.arange(a, b) for a, b in spans]) if spans is not None \
        else torch.arange(whole.shape[0])                 # part row i is whole row index[i]
    keep = torch.zeros(len(index), dtype=torch.bool)
    for start, stop in rows:
        keep |= (index >= start) & (index < stop)
    mine = keep.nonzero()[:, 0]
    source = whole[index[mine].to(whole.device)]
    cols = _columns(name, cfg, plan)
    part[mine.to(part.device)] = (source if cols == slice(None) else source[:, cols]).to(part.dtype)


def copy_shards(whole: LlamaForCausalLM, part: LlamaForCausalLM, plan: TpPlan) -> None:
    """Overwrite `part`'s weights with their slices of `whole`'s (layouts kept)."""
    source = dict(whole.named_parameters())
    with torch.no_grad():
        for name, param in part.named_parameters():
            param.copy_(weight_slice(name, source[name], whole.cfg, plan))


def shard_model(model: LoadedModel, plan: TpPlan, group=None) -> LoadedModel:
    """`model` as `plan`'s rank computes it (a new network; `model`'s is left as it is).
    `group`: the rank's TpGroup, which expert parallelism's dispatch runs on (needed
    only under --ep)."""
    cfg = plan.config(model.cfg)
    net = new_net(cfg, model.device, model.dtype)
    if plan.experts:
        _hold_experts(net, model.cfg, plan, group)
    copy_shards(model.net, net, plan)
    net.setup_rotary(model.dtype, model.device)
    net.eval()
    return replace(model, cfg=cfg, net=net, shard=Shard(model.cfg, plan))


def _hold_experts(net: LlamaForCausalLM, whole: ModelConfig, plan: TpPlan, group) -> None:
    """Under --ep: each mixture layer keeps only this rank's experts, and dispatches."""
    if group is None:
        raise ValueError("expert parallelism needs the rank's group")
    held = plan.held_experts(whole)
    dispatch = ExpertParallel(group, plan.rank, plan.size, whole.moe.num_experts)
    for layer in net.modules():
        if isinstance(layer, SparseMoe):
            old = layer.experts
            layer.experts = Experts(len(held), old.hidden, old.inter).to(
                device=old.gate_up_proj.device, dtype=old.gate_up_proj.dtype)
            layer.parallel = dispatch


def read_whole(part: LoadedModel, path: str) -> torch.nn.Module:
    """Checkpoint `path` as a whole network beside `part` (ModelError, OSError: nothing
    changed): the first half of a rank's update (engines/tp/runner.py)."""
    return whole_net(path, part.shard.whole, part.device, part.dtype)


def swap_part(part: LoadedModel, whole: torch.nn.Module, version: str | None) -> str:
    """Copy this rank's slice of `whole` into `part` (which then takes `version`, if
    given), once every rank has read it. Returns the version."""
    copy_shards(whole, part.net, part.shard.plan)
    if version:
        part.version = version
    return part.version
