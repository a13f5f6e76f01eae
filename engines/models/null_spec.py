"""The null model's spec (`--model null[:OPTIONS]`, spelled out in engines/models/null.py) and
its config: what the HTTP front and `zpd launch` need of it, without torch."""
from __future__ import annotations

import math
from dataclasses import dataclass, fields

from engines.config import ModelConfig, ModelError
from engines.models.tiny import BOS_ID, EOS_ID

VOCAB = 258                          # the byte tokenizer's: 256 bytes, BOS, EOS


@dataclass(frozen=True)
class NullSpec:
    """The null model's options (the module's docstring gives the spelling)."""
    step_ms: float = 20.0
    prefill_us: float = 50.0
    kv_bytes: int = 4096
    seed: int = 0
    experts: tuple[int, int] = (0, 0)     # a mixture's (total, active per token); (0, 0): dense
    expert_share: float = 0.95            # of the weights, the routed experts' part

    def step_s(self, batch: int) -> float:
        """One decode step of `batch` sequences: step_ms for a dense model. A mixture's
        step reads the weights outside the experts and the experts its tokens chose,
        in expectation 1 - (1 - k/E)^batch of them (each token k of E, uniformly):
        step_ms is the step that reads every weight."""
        total, active = self.experts
        if not total:
            return self.step_ms * 1e-3
        read = 1.0 - (1.0 - active / total) ** max(batch, 1)
        return self.step_ms * 1e-3 * ((1.0 - self.expert_share) + self.expert_share * read)

    @classmethod
    def parse(cls, spec: str) -> "NullSpec":
        if not is_null(spec):
            raise ModelError(f"{spec!r} is not a null model spec")
        opts = spec[len("null:"):].split(",") if spec != "null" else []
        got = {}
        for i, opt in enumerate(opts):
            key, eq, value = opt.partition("=")
            key, value = (key, value) if eq else ("step_ms" if i == 0 else "", key)
            got[key.strip()] = value.strip()
        known = {f.name: f.type for f in fields(cls)}
        if set(got) - set(known):
            raise ModelError(f"bad null model spec {spec!r}: unknown option "
                             f"{sorted(set(got) - set(known))[0]!r}; {SPELLING}")
        try:
            out = cls(**{k: _VALUES.get(known[k], int)(v) for k, v in got.items()})
        except ValueError:
            raise ModelError(f"bad null model spec {spec!r}: every value is a number "
                             f"(experts: TOTAL/ACTIVE); {SPELLING}") from None
        return out.checked(spec)

    def checked(self, spec: str) -> "NullSpec":
        times = (self.step_ms, self.prefill_us)
        if self.seed < 0 or not all(math.isfinite(t) and t >= 0 for t in times):
            raise ModelError(f"bad null model spec {spec!r}: times and seed are finite, >= 0")
        total, active = self.experts
        if (total or active) and not 1 <= active <= total:
            raise ModelError(f"bad null model spec {spec!r}: experts=TOTAL/ACTIVE needs "
                             f"1 <= ACTIVE <= TOTAL (got {total}/{active})")
        if not 0.0 <= self.expert_share <= 1.0:
            raise ModelError(f"bad null model spec {spec!r}: expert_share is a fraction "
                             f"of the weights, 0 to 1 (got {self.expert_share})")
        if self.kv_bytes < 16 or self.kv_bytes % 16:
            raise ModelError(f"bad null model spec {spec!r}: kv_bytes is a multiple of 16 "
                             f"(got {self.kv_bytes})")
        return self

    @property
    def version(self) -> str:
        """The weight version a worker loaded with this spec reports by default."""
        return "null" if not self.seed else f"null:seed={self.seed}"

    def config(self, itemsize: int = 4) -> ModelConfig:
        """One layer, one KV head of kv_bytes / 2 (K and V) per token in a dtype of
        `itemsize` bytes (a torch dtype's `itemsize`; float32's by default)."""
        head_dim = self.kv_bytes // 2 // itemsize
        return ModelConfig(architecture="null", vocab_size=VOCAB, hidden_size=head_dim,
                           intermediate_size=0, num_layers=1, num_heads=1, num_kv_heads=1,
                           head_dim=head_dim, max_position=1 << 20, rms_norm_eps=0.0,
                           rope_theta=0.0, bos_token_id=BOS_ID, eos_token_ids=(EOS_ID,))


SPELLING = ("spell it null[:STEP_MS] or null:step_ms=MS,prefill_us=US,kv_bytes=N,seed=N"
            "[,experts=TOTAL/ACTIVE,expert_share=F]")


def _experts(value: str) -> tuple[int, int]:
    total, slash, active = value.partition("/")
    if not slash:
        raise ValueError(value)
    return int(total), int(active)


# how each option's value is read (by its annotation); int otherwise
_VALUES = {"float": float, "tuple[int, int]": _experts}


def is_null(spec: str) -> bool:
    return spec == "null" or spec.startswith("null:")
