"""Which part of the model one rank of a tensor-parallel group holds (Megatron's split).

Attention: query heads in N equal runs; key/value heads in N equal runs when N divides
their count, else (N a multiple of it) each kv head on N / kv ranks, the ones whose
query heads read it (SGLang's and vLLM's replication). The MLP's intermediate
dimension in N equal runs. q/k/v and gate/up are split by output rows (column
parallel), o and down by input columns (row parallel, summed by an all-reduce).
Embedding, norms and LM head are whole on every rank: the leader alone computes
logits (it alone samples), so a vocabulary split would only add an all-gather.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from engines.config import ModelConfig


@dataclass(frozen=True)
class Shard:
    """What a rank's part of a model is part of: the whole model's config and the
    rank's plan (LoadedModel.shard; None for a whole model)."""
    whole: ModelConfig
    plan: "TpPlan"


@dataclass(frozen=True)
class TpPlan:
    rank: int
    size: int

    @staticmethod
    def problem(cfg: ModelConfig, size: int) -> str | None:
        """Why a model cannot be split `size` ways, or None."""
        if size < 1:
            return f"--tp must be at least 1, got {size}"
        if cfg.num_heads % size:
            return f"--tp {size} does not divide the model's {cfg.num_heads} attention heads"
        if cfg.intermediate_size % size:
            return f"--tp {size} does not divide the MLP's {cfg.intermediate_size} intermediate size"
        kv = cfg.num_kv_heads
        if kv % size and size % kv:
            return (f"--tp {size} neither divides the model's {kv} key/value heads nor is a "
                    "multiple of them")
        return None

    @classmethod
    def for_rank(cls, cfg: ModelConfig, rank: int, size: int) -> "TpPlan":
        problem = cls.problem(cfg, size)
        if problem is not None:
            raise ValueError(problem)
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} outside a group of {size}")
        return cls(rank, size)

    def q_heads(self, cfg: ModelConfig) -> range:
        n = cfg.num_heads // self.size
        return range(self.rank * n, (self.rank + 1) * n)

    def kv_heads(self, cfg: ModelConfig) -> range:
        """This rank's key/value heads: those its query heads read."""
        q = self.q_heads(cfg)
        groups = cfg.kv_groups
        return range(q.start // groups, (q.stop - 1) // groups + 1)

    def intermediate(self, cfg: ModelConfig) -> range:
        n = cfg.intermediate_size // self.size
        return range(self.rank * n, (self.rank + 1) * n)

    def config(self, cfg: ModelConfig) -> ModelConfig:
        """The model as this rank computes it: its heads and MLP slice."""
        return replace(cfg, num_heads=len(self.q_heads(cfg)), num_kv_heads=len(self.kv_heads(cfg)),
                       intermediate_size=len(self.intermediate(cfg)))
