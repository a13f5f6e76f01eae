"""Sampling parameters and the batched sampler.

Order of operations: penalties, then temperature, top-k, top-p, min-p (each on the
distribution the previous one left), then one draw. Randomness for a request's n-th
output token comes from a generator seeded by (seed, n) alone, so a seeded request
draws the same tokens whatever its batch neighbours, and whichever process samples it.
Logprobs, for the requests that ask, come from the same logits (`token_logprobs`).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields

import torch

from engines.cpu.layer_ops import layer_ops

_MASK64 = (1 << 64) - 1

# Bounds checked at admission (README, "zpd run", lists them). Outside them the
# sampler's arithmetic breaks in float32, the narrowest dtype it computes in: a
# temperature or top_p that rounds to 0 divides by zero, a top_k past int64 cannot
# become a tensor, a tiny or huge repetition penalty overflows the logits.
TEMPERATURE_RANGE = (1e-5, 100.0)        # or exactly 0: greedy
TOP_P_MIN = 1e-6                         # far above float32's smallest normal
INT32_MAX = 2**31 - 1                    # top_k, max_new_tokens, stop token ids
REPETITION_PENALTY_RANGE = (0.01, 100.0)
PENALTY_MAX = 2.0                        # |frequency_penalty|, |presence_penalty| (OpenAI's range)
SEED_RANGE = (-2**63, 2**63 - 1)         # int64, what the wire and torch carry
MAX_STOP_STRINGS, MAX_STOP_CHARS = 64, 256   # each step decodes the tail they could end in
MAX_STOP_TOKEN_IDS = 1024
MAX_TOP_LOGPROBS = 20                    # top_logprobs_num (OpenAI's bound for top_logprobs)


def _integer(value: object, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _real(value: object, low: float, high: float) -> bool:
    """A number in [low, high]; NaN and infinities fail the comparison."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and low <= value <= high


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling; a value outside the bounds above raises ValueError
    naming the parameter (status 400 at a worker)."""
    max_new_tokens: int = 128
    min_new_tokens: int = 0              # no EOS, stop token or stop string finishes it before
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
    return_logprob: bool = False         # report each output token's logprob
    top_logprobs_num: int = 0            # and its N most likely alternatives (> 0 implies logprobs)

    def __post_init__(self) -> None:
        for name, ok, bound in self._checks():
            if not ok:
                raise ValueError(f"{name} must be {bound}, got {_show(getattr(self, name))}")

    def _checks(self) -> list[tuple[str, bool, str]]:
        """(parameter, within bounds, the bounds in words), in field order."""
        t_low, t_high = TEMPERATURE_RANGE
        r_low, r_high = REPETITION_PENALTY_RANGE
        return [
            ("max_new_tokens", _integer(self.max_new_tokens, 1, INT32_MAX),
             f"an integer in [1, {INT32_MAX}]"),
            ("min_new_tokens", _integer(self.min_new_tokens, 0, _bound(self.max_new_tokens)),
             "an integer in [0, max_new_tokens]"),
            ("temperature", _real(self.temperature, 0, 0) or _real(self.temperature, t_low, t_high),
             f"0 (greedy) or in [{t_low}, {t_high:g}]"),
            ("top_p", _real(self.top_p, TOP_P_MIN, 1.0), f"in [{TOP_P_MIN}, 1]"),
            ("top_k", _integer(self.top_k, -1, INT32_MAX), f"-1 or 0 (no limit) or in [1, {INT32_MAX}]"),
            ("min_p", _real(self.min_p, 0.0, 1.0), "in [0, 1]"),
            ("repetition_penalty", _real(self.repetition_penalty, r_low, r_high),
             f"in [{r_low}, {r_high:g}]"),
            ("frequency_penalty", _real(self.frequency_penalty, -PENALTY_MAX, PENALTY_MAX),
             f"in [-{PENALTY_MAX:g}, {PENALTY_MAX:g}]"),
            ("presence_penalty", _real(self.presence_penalty, -PENALTY_MAX, PENALTY_MAX),
             f"in [-{PENALTY_MAX:g}, {PENALTY_MAX:g}]"),
            ("stop", _stop_ok(self.stop),
             f"at most {MAX_STOP_STRINGS} non-empty strings of at most {MAX_STOP_CHARS} characters"),
            ("stop_token_ids", _stop_ids_ok(self.stop_token_ids),
             f"at most {MAX_STOP_TOKEN_IDS} token ids in [0, {INT32_MAX}]"),
            ("ignore_eos", isinstance(self.ignore_eos, bool), "true or false"),
            ("seed", self.seed is None or _integer(self.seed, *SEED_RANGE),
             f"null or an integer in [{SEED_RANGE[0]}, {SEED_RANGE[1]}]"),
            ("return_logprob", isinstance(self.return_logprob, bool), "true or false"),
            ("top_logprobs_num", _integer(self.top_logprobs_num, 0, MAX_TOP_LOGPROBS),
             f"an integer in [0, {MAX_TOP_LOGPROBS}]"),
        ]

    @classmethod
    def from_dict(cls, raw: dict | None) -> "SamplingParams":
        if raw is not None and not isinstance(raw, dict):
            raise ValueError(f"sampling parameters must be an object, got {type(raw).__name__}")
        raw = dict(raw or {})
        unknown = set(raw) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown sampling parameters: {', '.join(sorted(map(str, unknown)))}")
        for key in ("stop", "stop_token_ids"):
            if key in raw:
                raw[key] = _as_tuple(raw[key])
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

    @property
    def wants_logprobs(self) -> bool:
        return self.return_logprob or self.top_logprobs_num > 0

    @property
    def filtered(self) -> bool:
        """Top-k, top-p or min-p cut the distribution (they need it sorted)."""
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0

    @property
    def penalised(self) -> bool:
        return self.repetition_penalty != 1.0 or bool(self.frequency_penalty or self.presence_penalty)


def _bound(max_new_tokens: object) -> int:
    """max_new_tokens as min_new_tokens' upper bound (0 when it is itself invalid, whose
    own check then names it first)."""
    return max_new_tokens if _integer(max_new_tokens, 1, INT32_MAX) else 0


def _as_tuple(value: object) -> object:
    """A single stop string or id, or a list of them, as a tuple; anything else is
    left as it is for the check to name."""
    if value is None:
        return ()
    if isinstance(value, (str, int)):
        return (value,)
    return tuple(value) if isinstance(value, (list, tuple)) else value


def _stop_ok(stop: object) -> bool:
    return isinstance(stop, tuple) and len(stop) <= MAX_STOP_STRINGS and \
        all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stop)


def _stop_ids_ok(ids: object) -> bool:
    return isinstance(ids, tuple) and len(ids) <= MAX_STOP_TOKEN_IDS and \
        all(_integer(t, 0, INT32_MAX) for t in ids)


def _show(value: object) -> str:
    """The refused value, short (a huge int has no repr: Python refuses to print it)."""
    if isinstance(value, (tuple, list, dict)):
        return f"{type(value).__name__} of {len(value)}"
    try:
        text = repr(value)
    except ValueError:
        return f"an int of {value.bit_length()} bits"
    return text if len(text) <= 40 else text[:37] + "..."


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


@dataclass
class Sampled:
    """One sampling step: a token per row and, for the rows whose request asked, its
    logprob and top alternatives (None for the others)."""
    tokens: list[int]
    logprobs: list[float | None]
    top: list[list[tuple[int, float]] | None]


def token_logprobs(logits: torch.Tensor, params: list[SamplingParams], tokens: list[int]
                   ) -> tuple[list[float | None], list[list[tuple[int, float]] | None]]:
    """For each row whose request asks, the logprob of its sampled token and (with
    top_logprobs_num N) the N most likely tokens as (token id, logprob), highest first;
    None for the other rows, which cost nothing.

    `logits` are the rows after penalties, in float32 at least. The distribution is
    log_softmax(logits / temperature) over the whole vocabulary (temperature 1 for a
    greedy request): what the draw starts from, before top-k, top-p and min-p cut it.
    So the sampled token's logprob is never -inf, and a token filtered out still has
    its logprob (vLLM's "processed_logprobs"; the truncated distribution would give
    -inf to every filtered alternative and renormalise the rest).
    """
    rows = [i for i, p in enumerate(params) if p.wants_logprobs]
    logprobs: list[float | None] = [None] * len(params)
    top: list[list[tuple[int, float]] | None] = [None] * len(params)
    if not rows:
        return logprobs, top
    dev = logits.device
    temps = torch.tensor([1.0 if params[i].greedy else params[i].temperature for i in rows],
                         dtype=logits.dtype, device=dev)
    logp = torch.log_softmax(logits[rows] / temps[:, None], dim=-1)
    picked = logp.gather(1, torch.tensor([[tokens[i]] for i in rows], device=dev))[:, 0].tolist()
    k = min(max(params[i].top_logprobs_num for i in rows), logp.shape[1])
    values, ids = logp.topk(k, dim=-1) if k else (logp[:, :0], logp[:, :0])
    values, ids = values.tolist(), ids.tolist()
    for j, i in enumerate(rows):
        logprobs[i] = picked[j]
        n = params[i].top_logprobs_num
        if n:
            top[i] = list(zip(ids[j][:n], values[j][:n]))
    return logprobs, top


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """[B] column of each row of `probs` where its cumulative sum first passes u times
    the row's total (so rounding in the sum cannot run past the end), never past the
    last column that has any probability."""
    cdf = torch.cumsum(probs, dim=-1)
    pick = torch.searchsorted(cdf, (u.to(cdf.dtype) * cdf[:, -1])[:, None], right=True)
    last = probs.shape[1] - 1 - (probs > 0).flip(-1).int().argmax(-1, keepdim=True)
    return torch.minimum(pick, last).squeeze(1)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(-1) of [B, V] logits, by the compiled kernel where there is one
    (engines/cpu/layer_ops.py: torch's CPU argmax is a scalar loop, 0.84 ms for 16 rows
    of 49,152 float32 logits and 2.3 ms in bfloat16, against 0.08 ms)."""
    ops = layer_ops(logits.dtype, logits.device.type)
    if ops is None or logits.dim() != 2 or not logits.is_contiguous() or logits.shape[1] == 0:
        return logits.argmax(-1)
    return ops.argmax(logits)


class Sampler:
    """Picks one token per row. `steps[i]` is how many tokens row i has emitted so far.
    `eos_ids`: the model's end tokens, which a row may not draw (nor its own stop token
    ids) before its min_new_tokens, as SGLang's min-new-tokens penalty does: their
    logits become -inf, so greedy and sampled rows alike draw something else."""

    def __init__(self, eos_ids: tuple[int, ...] = ()) -> None:
        self.eos_ids = tuple(eos_ids)

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams], seeds: list[int],
                 steps: list[int], prompts: list[list[int]], outputs: list[list[int]]) -> list[int]:
        return self.sample(logits, params, seeds, steps, prompts, outputs).tokens

    def sample(self, logits: torch.Tensor, params: list[SamplingParams], seeds: list[int],
               steps: list[int], prompts: list[list[int]], outputs: list[list[int]]) -> Sampled:
        """The tokens, with the logprobs of the rows that ask (`token_logprobs`)."""
        penalised = [i for i, p in enumerate(params) if p.penalised]
        banned = self._banned(params, steps, logits.shape[1])
        # Greedy rows alone need no float32 copy: the maximum is the same in the
        # model's dtype. A copy before writing: the model's logits are an inference
        # tensor, which may not be updated in place outside inference mode.
        written = bool(penalised or banned)
        if written or any(not p.greedy or p.wants_logprobs for p in params):
            logits = logits.to(torch.promote_types(logits.dtype, torch.float32), copy=written)
        for i in penalised:
            logits[i] = apply_penalties(logits[i].clone(), params[i], prompts[i], outputs[i])
        for i, ids in banned.items():
            logits[i, ids] = float("-inf")
        chosen = argmax(logits).tolist()
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if sampled:
            for i, token in zip(sampled, self._draw(logits[sampled], [params[i] for i in sampled],
                                                    [step_seed(seeds[i], steps[i]) for i in sampled])):
                chosen[i] = token
        return Sampled(chosen, *token_logprobs(logits, params, chosen))

    def _banned(self, params: list[SamplingParams], steps: list[int], vocab: int
                ) -> dict[int, list[int]]:
        """Row -> the end tokens it may not draw yet (rows still short of min_new_tokens)."""
        out = {}
        for i, p in enumerate(params):
            if steps[i] < p.min_new_tokens:
                ids = sorted({t for t in self.eos_ids + p.stop_token_ids if 0 <= t < vocab})
                if ids:
                    out[i] = ids
        return out

    def _draw(self, logits: torch.Tensor, params: list[SamplingParams], seeds: list[int]) -> list[int]:
        """Inverse CDF, one uniform per row from its own generator: over the sorted,
        filtered distribution for rows with top-k/top-p/min-p, over the vocabulary in
        id order for the others (sorting the whole vocabulary is most of a plain
        temperature draw's cost, and the order does not change the distribution)."""
        dev, vocab = logits.device, logits.shape[1]

        def column(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=logits.dtype, device=dev)
        u = column([torch.rand(1, generator=torch.Generator().manual_seed(s), dtype=torch.float64).item()
                    for s in seeds])
        tokens = [0] * len(params)
        plain = [i for i, p in enumerate(params) if not p.filtered]
        if plain:
            rows = torch.tensor(plain, device=dev)
            probs = torch.softmax(logits[rows] / column([params[i].temperature for i in plain])[:, None], -1)
            for i, t in zip(plain, _inverse_cdf(probs, u[rows]).tolist()):
                tokens[i] = t
        cut = [i for i, p in enumerate(params) if p.filtered]
        if cut:
            rows = torch.tensor(cut, device=dev)
            probs, ids = filter_probs(
                logits[rows], column([params[i].temperature for i in cut]),
                torch.tensor([params[i].top_k if params[i].top_k > 0 else vocab for i in cut], device=dev),
                column([params[i].top_p for i in cut]), column([params[i].min_p for i in cut]))
            pick = _inverse_cdf(probs, u[rows])
            for i, t in zip(cut, ids.gather(1, pick[:, None]).squeeze(1).tolist()):
                tokens[i] = t
        return tokens
