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
            out = cls(**{k: (float if known[k] == "float" else int)(v) for k, v in got.items()})
        except ValueError:
            raise ModelError(f"bad null model spec {spec!r}: every value is a number; "
                             f"{SPELLING}") from None
        return out.checked(spec)

    def checked(self, spec: str) -> "NullSpec":
        times = (self.step_ms, self.prefill_us)
        if self.seed < 0 or not all(math.isfinite(t) and t >= 0 for t in times):
            raise ModelError(f"bad null model spec {spec!r}: times and seed are finite, >= 0")
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


SPELLING = "spell it null[:STEP_MS] or null:step_ms=MS,prefill_us=US,kv_bytes=N,seed=N"


def is_null(spec: str) -> bool:
    return spec == "null" or spec.startswith("null:")
