"""The seam between a model and the hardware: the layer operations a model calls.

A model (engines/models/) computes through one `Backend`, chosen once per runner
(`engines.runner.backend_for`) and handed to its forward. engines/torch_backend.py
is the reference, in torch's ops, and what CUDA runs; engines/cpu/backend.py runs the
compiled CPU kernels where they take the dtype and shape, and the reference where not.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from engines.kv.meta import DecodeMeta, PrefillMeta
from engines.kv.paged import PageRows, PagedKV


@dataclass(frozen=True)
class Heads:
    """A layer's attention heads: q query heads over kv key/value heads of `dim`."""
    q: int
    kv: int
    dim: int
    qk_norm: bool = False         # an RMSNorm on each query and key head before rotary (Qwen3)

    @property
    def scale(self) -> float:
        return self.dim ** -0.5


class ExpertWeights(Protocol):
    """A mixture's expert weights (engines/models/moe.py's `Experts`)."""
    num: int                      # experts

    def expert(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert e's (gate_up [2I, hidden], down [hidden, I])."""

    def stacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All of them: [E, 2I, hidden] and [E, hidden, I]."""


class Backend(Protocol):
    """The operations of one layer. Shapes: T tokens (a packed prefill) or B sequences
    (a decode step); every tensor is in the model's dtype on its device."""

    def linear(self, x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, in] @ weight [out, in]^T (+ bias) -> [T, out]."""

    def mlp(self, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        """down(SiLU(gate) * up) of x [T, hidden], gate_up = [gate; up] [2 I, hidden]."""

    def experts(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                experts: ExpertWeights) -> torch.Tensor:
        """A mixture's routed experts: row t of x [T, hidden] through the MLPs of experts
        ids[t] ([T, k]), summed by weights[t] (float32) -> [T, hidden]; this rank's
        part, not yet summed over the group. The place a fused-MoE kernel plugs in."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x [T, dim] -> weight * x / rms(x)."""

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (rms_norm(x + residual), x + residual)."""

    def rope_write(self, qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv: PagedKV,
                   layer: int, write_rows: torch.Tensor, heads: Heads,
                   qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None, keys: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """qkv [T, (Hq + 2 Hkv) D]: rotary embedding (after the q/k norms, weights and
        eps, where the model has them) of queries and keys, and the keys and values
        written to `layer`'s pool rows -> (q [T, Hq, D], k, v [T, Hkv, D]); k and v may
        be None unless `keys` (a prefill attends to its own)."""

    def prefill_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          meta: PrefillMeta, kv: PagedKV, layer: int, heads: Heads) -> torch.Tensor:
        """Causal attention within each packed sequence and over its cached prefix in
        the pool -> [T, Hq, D]."""

    def decode_attention(self, q: torch.Tensor, kv: PagedKV, layer: int, meta: DecodeMeta,
                         heads: Heads) -> torch.Tensor:
        """q [B, Hq, D] attends to its sequence's whole context in the pool -> [B, Hq, D]."""

    def prepare(self, write_rows: torch.Tensor, positions: list[int], page_tables: list[list[int]],
                pages: PageRows) -> DecodeMeta:
        """A batch's decode attention in the form `decode_attention` reads: row i at
        positions[i] of its sequence attends to positions 0..positions[i]."""

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """logits.argmax(-1) of [B, V] logits of any dtype, a NaN counting as the maximum."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks of the model's tensor-parallel group, in place (a
        row-parallel product's partial sums; engines/tp/); x itself on one rank."""
