"""The dense MLP: down(SiLU(gate) * up), gate and up fused in one projection."""
from __future__ import annotations

import torch
from torch import nn

from engines.backend import Backend


def param(*shape: int) -> nn.Parameter:
    # Uninitialised: every value is overwritten by the checkpoint loader.
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.inter = inter
        self.shards = {"gate": (0, self.inter), "up": (self.inter, self.inter)}
        self.gate_up_proj = nn.Module()
        self.gate_up_proj.weight = param(2 * self.inter, hidden)
        self.down_proj = nn.Module()
        self.down_proj.weight = param(hidden, self.inter)

    def forward(self, x: torch.Tensor, backend: Backend, capture=None) -> torch.Tensor:
        """`capture`: a mixture's routing record (engines/models/moe.py), which a dense
        layer leaves as it is."""
        return backend.all_reduce(self.partial(x, backend))

    def partial(self, x: torch.Tensor, backend: Backend) -> torch.Tensor:
        """This rank's part of the product (all of it on one rank), not yet summed."""
        return backend.mlp(x, self.gate_up_proj.weight, self.down_proj.weight)
