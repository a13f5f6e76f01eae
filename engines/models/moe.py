"""The mixture-of-experts layer: a router picks each token's experts, the experts'
MLPs run on their tokens, their outputs are summed by the router's weights.

Qwen3-MoE, Mixtral and GLM-4.5 differ only in the router (engines/models/routing.py)
and in GLM's shared experts beside the routed ones. The experts' products are the
backend's (`Backend.experts`: tokens grouped by expert, only the chosen experts
read); under tensor parallelism each expert's intermediate dimension is split like
the dense MLP's and one all-reduce sums the layer; under expert parallelism
(`parallel`, engines/tp/experts.py) each rank holds some experts and the tokens travel.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from engines.backend import Backend
from engines.config import ModelConfig, MoeConfig
from engines.models.mlp import MLP, param as _param
from engines.models.routing import route


class Experts(nn.Module):
    """Every expert's MLP weights, stacked: gate_up_proj [E * 2I, hidden] (expert e's
    gate rows, then its up rows, at e * 2I) and down_proj [E * hidden, I]. Stacked in
    two dimensions so a checkpoint's per-expert tensors are row ranges of them, as the
    dense model's fused projections are (engines/formats/weights.py)."""

    def __init__(self, num_experts: int, hidden: int, inter: int) -> None:
        super().__init__()
        self.num, self.hidden, self.inter = num_experts, hidden, inter
        self.gate_up_proj = _param(num_experts * 2 * inter, hidden)
        self.down_proj = _param(num_experts * hidden, inter)
        self._views: tuple[tuple[int, int], list[tuple[torch.Tensor, torch.Tensor]]] | None = None

    def rows(self, expert: int, part: str) -> tuple[str, int, int]:
        """Where checkpoint tensor `part` ("gate", "up" or "down") of `expert` lies:
        (our parameter's name, first row, rows)."""
        i, h = self.inter, self.hidden
        if part == "down":
            return "down_proj", expert * h, h
        return "gate_up_proj", expert * 2 * i + (i if part == "up" else 0), i

    def stacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """[E, 2I, hidden] and [E, hidden, I] views: what a fused-MoE kernel takes."""
        return (self.gate_up_proj.view(self.num, 2 * self.inter, self.hidden),
                self.down_proj.view(self.num, self.hidden, self.inter))

    def expert(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert e's (gate_up [2I, hidden], down [hidden, I]): views kept while the
        parameters' storage stays, so a backend's packed copy held on them lasts."""
        key = (self.gate_up_proj.data_ptr(), self.down_proj.data_ptr())
        if self._views is None or self._views[0] != key:
            gate_up, down = self.stacked()
            self._views = key, [(gate_up[k], down[k]) for k in range(self.num)]
        return self._views[1][e]

    def forget(self) -> None:
        """Drop the per-expert views and what a backend holds on them (packed copies):
        the weights' memory is being released."""
        self._views = None


class Router(nn.Module):
    """The gate: router logits of each token, [E, hidden], and GLM's load-balancing
    bias (e_score_correction_bias), which shifts the choice but not the weights."""

    def __init__(self, cfg: ModelConfig, m: MoeConfig) -> None:
        super().__init__()
        self.weight = _param(m.num_experts, cfg.hidden_size)
        self.e_score_correction_bias = _param(m.num_experts) if m.router == "grouped_sigmoid" else None


class RoutingCapture:
    """Each token's chosen experts, layer by layer, through one forward: ids [T, layers,
    k] int32 (zeros in dense layers) and, where asked, their weights in float32."""

    def __init__(self, tokens: int, layers: int, top_k: int, weights: bool,
                 device: torch.device | str = "cpu") -> None:
        """On `device`, the model's: a layer's record is then no copy to the host (on a GPU
        no synchronisation per layer); the reader copies the whole once."""
        self.ids = torch.zeros(tokens, layers, top_k, dtype=torch.int32, device=device)
        self.weights = torch.zeros(tokens, layers, top_k, dtype=torch.float32,
                                   device=device) if weights else None

    def record(self, layer: int, ids: torch.Tensor, weights: torch.Tensor) -> None:
        self.ids[:, layer] = ids.to(self.ids.device, torch.int32)
        if self.weights is not None:
            self.weights[:, layer] = weights.to(self.weights.device, torch.float32)

    def host(self) -> RoutingCapture:
        """This record in host memory: itself on the CPU, else one copy of each tensor."""
        if self.ids.device.type == "cpu":
            return self
        out = copy.copy(self)
        out.ids = self.ids.cpu()
        out.weights = None if self.weights is None else self.weights.cpu()
        return out


class SparseMoe(nn.Module):
    """One layer's mixture: router, experts and (GLM) shared experts."""

    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        self.index, self.m = index, cfg.moe
        self.gate = Router(cfg, self.m)
        self.experts = Experts(self.m.num_experts, cfg.hidden_size, self.m.intermediate_size)
        self.shared_experts = None
        self.parallel = None        # expert parallelism's dispatch (engines/tp/experts.py)
        if self.m.shared_experts:
            self.shared_experts = MLP(cfg.hidden_size, self.m.intermediate_size * self.m.shared_experts)

    def forward(self, x: torch.Tensor, backend: Backend,
                capture: RoutingCapture | None = None) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden], summed over the tensor-parallel group."""
        logits = self.router_logits(x, backend)
        ids, weights = route(logits, self.gate.e_score_correction_bias, self.m)
        if capture is not None:
            capture.record(self.index, ids, weights)
        if self.parallel is not None:
            return self.parallel.forward(self, x, ids, weights, backend)
        out = backend.experts(x, ids, weights, self.experts)
        if self.shared_experts is not None:
            out = out + self.shared_experts.partial(x, backend)
        return backend.all_reduce(out)

    def router_logits(self, x: torch.Tensor, backend: Backend) -> torch.Tensor:
        """[T, E]: GLM's in float32, as its checkpoints' router is (kept in float32 by
        the reference too); the others' in the model's dtype, by the backend's product
        (torch's CPU product of one bfloat16 row by a [16, 512] router took 70 us, the
        CPU backend's 1-8 row kernel a few)."""
        w = self.gate.weight
        if self.m.router == "grouped_sigmoid":
            return torch.nn.functional.linear(x.float(), w.float())
        return backend.linear(x, w)
