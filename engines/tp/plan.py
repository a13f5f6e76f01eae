"""Which part of the model one rank of a tensor-parallel group holds (Megatron's split).

Attention: query heads in N equal runs; key/value heads in N equal runs when N divides
their count, else (N a multiple of it) each kv head on N / kv ranks, the ones whose
query heads read it (SGLang's and vLLM's replication). The MLP's intermediate
dimension in N equal runs. q/k/v and gate/up are split by output rows (column
parallel), o and down by input columns (row parallel, summed by an all-reduce).
Embedding, norms and LM head are whole on every rank: the leader alone computes
logits (it alone samples), so a vocabulary split would only add an all-gather.

Mixture of experts (engines/models/moe.py). Under --tp N each expert's intermediate
dimension is split like the MLP's (gate/up rows, down columns), GLM's shared experts
too; the router and its e_score_correction_bias are whole. Under --ep N (expert
parallelism, engines/tp/experts.py) rank r holds experts [r*E/N, (r+1)*E/N) whole and
the tokens go to them by all-to-all; the attention is then split by heads as above
(--tp N --ep N) or whole on every rank (--ep N alone: `replicated`, every rank's KV
pool holding every kv head), and shared experts are whole on every rank. The KV does
not depend on the experts: a prefill and a decode of any TP/EP sizes exchange it.
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
    size: int                  # ranks of the group: max(--tp, --ep)
    experts: bool = False      # experts partitioned over the ranks (--ep size)
    replicated: bool = False   # attention and dense MLPs whole on every rank (--ep alone)

    @staticmethod
    def problem(cfg: ModelConfig, size: int, ep: int = 1) -> str | None:
        """Why a model cannot be split `size` ways (--tp) with experts over `ep` ranks
        (--ep), or None."""
        if size < 1:
            return f"--tp must be at least 1, got {size}"
        if ep < 1:
            return f"--ep must be at least 1, got {ep}"
        if ep > 1:
            if cfg.moe is None:
                return f"--ep {ep} needs a mixture-of-experts model; this one is dense"
            if size not in (1, ep):
                return f"--ep {ep} with --tp {size}: --ep must be 1 or equal to --tp"
            if cfg.moe.num_experts % ep:
                return f"--ep {ep} does not divide the model's {cfg.moe.num_experts} experts"
            if size == 1:
                return None            # attention and dense MLPs whole on every rank
        if cfg.num_heads % size:
            return f"--tp {size} does not divide the model's {cfg.num_heads} attention heads"
        if cfg.intermediate_size % size and (cfg.moe is None or cfg.moe.dense_layers):
            return f"--tp {size} does not divide the MLP's {cfg.intermediate_size} intermediate size"
        if cfg.moe is not None and ep == 1 and cfg.moe.intermediate_size % size:
            return (f"--tp {size} does not divide the experts' {cfg.moe.intermediate_size} "
                    "intermediate size (moe_intermediate_size)")
        kv = cfg.num_kv_heads
        if kv % size and size % kv:
            return (f"--tp {size} neither divides the model's {kv} key/value heads nor is a "
                    "multiple of them")
        return None

    @classmethod
    def for_rank(cls, cfg: ModelConfig, rank: int, size: int, ep: int = 1) -> "TpPlan":
        """Rank `rank`'s plan at --tp `size` --ep `ep` (the group has max(size, ep))."""
        problem = cls.problem(cfg, size, ep)
        if problem is not None:
            raise ValueError(problem)
        group = max(size, ep)
        if not 0 <= rank < group:
            raise ValueError(f"rank {rank} outside a group of {group}")
        return cls(rank, group, experts=ep > 1, replicated=size == 1 and ep > 1)

    @property
    def split(self) -> int:
        """Ranks the attention and the dense MLPs are split over (1: replicated)."""
        return 1 if self.replicated else self.size

    def _part(self, n: int) -> range:
        """This rank's run of n things split `split` ways."""
        k = n // self.split
        r = 0 if self.replicated else self.rank
        return range(r * k, (r + 1) * k)

    def q_heads(self, cfg: ModelConfig) -> range:
        return self._part(cfg.num_heads)

    def kv_heads(self, cfg: ModelConfig) -> range:
        """This rank's key/value heads: those its query heads read."""
        q = self.q_heads(cfg)
        groups = cfg.kv_groups
        return range(q.start // groups, (q.stop - 1) // groups + 1)

    def intermediate(self, cfg: ModelConfig) -> range:
        return self._part(cfg.intermediate_size)

    def expert_intermediate(self, cfg: ModelConfig) -> range:
        """This rank's run of each expert's (and the shared experts') intermediate
        dimension: split under --tp, whole under --ep."""
        n = cfg.moe.intermediate_size
        return range(n) if self.experts else self._part(n)

    def held_experts(self, cfg: ModelConfig) -> range:
        """The experts this rank holds: all but under --ep."""
        e = cfg.moe.num_experts
        if not self.experts:
            return range(e)
        n = e // self.size
        return range(self.rank * n, (self.rank + 1) * n)

    def config(self, cfg: ModelConfig) -> ModelConfig:
        """The model as this rank computes it: its heads and MLP slice (its experts'
        intermediate slice; the number of experts stays the router's)."""
        moe = cfg.moe and replace(cfg.moe, intermediate_size=len(self.expert_intermediate(cfg)))
        return replace(cfg, num_heads=len(self.q_heads(cfg)), num_kv_heads=len(self.kv_heads(cfg)),
                       intermediate_size=len(self.intermediate(cfg)), moe=moe)
