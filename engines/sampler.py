"""Sampling parameters and the batched sampler.

Order of operations: penalties, then temperature, top-k, top-p, min-p (each on the
distribution the previous one left), then one draw. Randomness for a request's n-th
output token comes from a generator seeded by (seed, n) alone, so a seeded request
draws the same tokens whatever its batch neighbours, and whichever process samples it.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields

import torch

_MASK64 = (1 << 64) - 1

# Every stop string is matched against the output after every token: these keep that
# (and a request's size) bounded; 100k stop strings once cost 4.4 ms per token.
MAX_STOP_STRINGS = 32
MAX_STOP_LENGTH = 256            # characters of one stop string
MAX_STOP_TOKEN_IDS = 1024


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1                      # -1 or 0: no limit
    min_p: float = 0.0
    repetition_penalty: float = 1.0      # over prompt and output; > 1 discourages repeats
    frequency_penalty: float = 0.0       # per occurrence in the output
    presence_penalty: float = 0.0        # once per token present in the output
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None

    def __post_init__(self) -> None:
        check_stop_limits(self.stop, self.stop_token_ids)
        checks = [
            (isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1, "max_new_tokens must be an integer >= 1"),
            (self.temperature >= 0, "temperature must be >= 0"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (isinstance(self.top_k, int) and self.top_k >= -1, "top_k must be -1, 0 or a positive integer"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (self.repetition_penalty > 0, "repetition_penalty must be > 0"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2]"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty must be in [-2, 2]"),
            (all(isinstance(s, str) and s for s in self.stop), "stop must be non-empty strings"),
            (all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids must be token ids"),
            (self.seed is None or isinstance(self.seed, int), "seed must be an integer"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @classmethod
    def from_dict(cls, raw: dict | None) -> "SamplingParams":
        raw = dict(raw or {})
        unknown = set(raw) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown sampling parameters: {', '.join(sorted(unknown))}")
        for key in ("stop", "stop_token_ids"):
            if key in raw:
                value = raw[key]
                raw[key] = (value,) if isinstance(value, (str, int)) else tuple(value or ())
        try:
            return cls(**raw)
        except TypeError as e:
            raise ValueError(f"bad sampling parameters: {e}") from None

    def to_dict(self) -> dict:
        d = asdict(self)
        return d | {"stop": list(self.stop), "stop_token_ids": list(self.stop_token_ids)}

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def check_stop_limits(stop: tuple[str, ...], stop_token_ids: tuple[int, ...]) -> None:
    """ValueError (400 at the workers) naming the parameter past its cap."""
    if len(stop) > MAX_STOP_STRINGS:
        raise ValueError(f"stop: at most {MAX_STOP_STRINGS} strings, got {len(stop)}")
    longest = max((len(s) for s in stop if isinstance(s, str)), default=0)
    if longest > MAX_STOP_LENGTH:
        raise ValueError(f"stop: at most {MAX_STOP_LENGTH} characters a string, got {longest}")
    if len(stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise ValueError(f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} ids, got "
                         f"{len(stop_token_ids)}")


def step_seed(seed: int, step: int) -> int:
    """splitmix64 of (seed, step): independent streams per output position."""
    z = (seed * 0x9E3779B97F4A7C15 + (step + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def apply_penalties(logits: torch.Tensor, p: SamplingParams, prompt: list[int],
                    output: list[int]) -> torch.Tensor:
    """One row of logits [V] with the repetition/frequency/presence penalties applied."""
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt) | set(output)), dtype=torch.long, device=logits.device)
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if output and (p.frequency_penalty or p.presence_penalty):
        counts = torch.bincount(torch.tensor(output, device=logits.device), minlength=logits.shape[0])
        counts = counts[:logits.shape[0]].to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def filter_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                 top_p: torch.Tensor, min_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [B, V] -> (probabilities sorted descending with filtered entries zeroed, their ids)."""
    scaled, ids = torch.sort(logits / temperature[:, None], dim=-1, descending=True)
    rank = torch.arange(logits.shape[1], device=logits.device)[None, :]
    scaled = scaled.masked_fill(rank >= top_k[:, None], float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs              # mass of strictly better tokens
    probs = probs.masked_fill(before >= top_p[:, None], 0.0)
    probs = probs.masked_fill(probs < min_p[:, None] * probs[:, :1], 0.0)
    return probs / probs.sum(-1, keepdim=True), ids


class Sampler:
    """Picks one token per row. `steps[i]` is how many tokens row i has emitted so far."""

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams], seeds: list[int],
                 steps: list[int], prompts: list[list[int]], outputs: list[list[int]]) -> list[int]:
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        for i, p in enumerate(params):
            if p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty:
                logits[i] = apply_penalties(logits[i].clone(), p, prompts[i], outputs[i])
        chosen = logits.argmax(-1).tolist()
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if sampled:
            for i, token in zip(sampled, self._draw(logits[sampled], [params[i] for i in sampled],
                                                    [step_seed(seeds[i], steps[i]) for i in sampled])):
                chosen[i] = token
        return chosen

    def _draw(self, logits: torch.Tensor, params: list[SamplingParams], seeds: list[int]) -> list[int]:
        dev, vocab = logits.device, logits.shape[1]

        def column(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=logits.dtype, device=dev)

        probs, ids = filter_probs(
            logits, column([p.temperature for p in params]),
            torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=dev),
            column([p.top_p for p in params]), column([p.min_p for p in params]))
        # Inverse CDF on the sorted distribution: one uniform per row from its own generator.
        u = column([torch.rand(1, generator=torch.Generator().manual_seed(s), dtype=torch.float64).item()
                    for s in seeds])
        cdf = torch.cumsum(probs, dim=-1)
        pick = torch.searchsorted(cdf, u[:, None].to(cdf.dtype), right=True).clamp_(max=vocab - 1)
        # never land on a zeroed tail entry because of rounding in the cumulative sum
        last_kept = (probs > 0).sum(-1, keepdim=True) - 1
        pick = torch.minimum(pick, last_kept)
        return ids.gather(1, pick).squeeze(1).tolist()
