"""The batched sampler (its parameters are in engines/sampling_params.py).

Order of operations: penalties, then temperature, top-k, top-p, min-p (each on the
distribution the previous one left), then one draw. Randomness for a request's n-th
output token comes from a generator seeded by (seed, n) alone, so a seeded request
draws the same tokens whatever its batch neighbours, and whichever process samples it.
Logprobs, for the requests that ask, come from the same logits (`token_logprobs`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from engines.grammar_mask import Allowed
from engines.sampling_params import SamplingParams
from engines.torch_backend import TorchBackend

_MASK64 = (1 << 64) - 1


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
    logprob, top alternatives and token_ids_logprob ids' logprobs (None for the others)."""
    tokens: list[int]
    logprobs: list[float | None]
    top: list[list[tuple[int, float]] | None]
    ids: list[list[float] | None]


def token_logprobs(logits: torch.Tensor, params: list[SamplingParams], tokens: list[int]
                   ) -> tuple[list[float | None], list[list[tuple[int, float]] | None],
                              list[list[float] | None]]:
    """For each row whose request asks, the logprob of its sampled token, (with
    top_logprobs_num N) the N most likely tokens as (token id, logprob), highest first,
    and (with token_ids_logprob) the logprobs of those ids, in the order asked; None
    for the other rows, which cost nothing.

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
    ids: list[list[float] | None] = [None] * len(params)
    if not rows:
        return logprobs, top, ids
    dev = logits.device
    temps = torch.tensor([1.0 if params[i].greedy else params[i].temperature for i in rows],
                         dtype=logits.dtype, device=dev)
    logp = torch.log_softmax(logits[rows] / temps[:, None], dim=-1)
    picked = logp.gather(1, torch.tensor([[tokens[i]] for i in rows], device=dev))[:, 0].tolist()
    k = min(max(params[i].top_logprobs_num for i in rows), logp.shape[1])
    values, best = logp.topk(k, dim=-1) if k else (logp[:, :0], logp[:, :0])
    values, best = values.tolist(), best.tolist()
    for j, i in enumerate(rows):
        logprobs[i] = picked[j]
        n = params[i].top_logprobs_num
        if n:
            top[i] = list(zip(best[j][:n], values[j][:n]))
        asked = params[i].output_ids_logprob
        if asked:
            ids[i] = logp[j, torch.tensor(asked, device=dev)].tolist()
    return logprobs, top, ids


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """[B] column of each row of `probs` where its cumulative sum first passes u times
    the row's total (so rounding in the sum cannot run past the end), never past the
    last column that has any probability."""
    cdf = torch.cumsum(probs, dim=-1)
    pick = torch.searchsorted(cdf, (u.to(cdf.dtype) * cdf[:, -1])[:, None], right=True)
    last = probs.shape[1] - 1 - (probs > 0).flip(-1).int().argmax(-1, keepdim=True)
    return torch.minimum(pick, last).squeeze(1)


class Sampler:
    """Picks one token per row. `steps[i]` is how many tokens row i has emitted so far.
    `eos_ids`: the model's end tokens, which a row may not draw (nor its own stop token
    ids) before its min_new_tokens, as SGLang's min-new-tokens penalty does: their
    logits become -inf, so greedy and sampled rows alike draw something else.
    `argmax`: the runner's backend's (engines/backend.py; on CPU a kernel), else torch's."""

    def __init__(self, eos_ids: tuple[int, ...] = (),
                 argmax: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self.eos_ids = tuple(eos_ids)
        self.argmax = argmax or TorchBackend().argmax

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams], seeds: list[int],
                 steps: list[int], prompts: list[list[int]], outputs: list[list[int]]) -> list[int]:
        return self.sample(logits, params, seeds, steps, prompts, outputs).tokens

    def sample(self, logits: torch.Tensor, params: list[SamplingParams], seeds: list[int],
               steps: list[int], prompts: list[list[int]], outputs: list[list[int]],
               allowed: Allowed | None = None) -> Sampled:
        """The tokens, with the logprobs of the rows that ask (`token_logprobs`);
        `allowed`: the constrained rows' grammar masks (engines/grammar_mask.py), applied
        last, so greedy and sampled rows alike draw an allowed token (and their logprobs
        are of the masked distribution, as SGLang's)."""
        penalised = [i for i, p in enumerate(params) if p.penalised]
        banned = self._banned(params, steps, logits.shape[1], allowed.ended if allowed else set())
        # Greedy rows alone need no float32 copy: the maximum is the same in the
        # model's dtype. A copy before writing: the model's logits are an inference
        # tensor, which may not be updated in place outside inference mode.
        whole = allowed is not None and len(allowed.rows) == logits.shape[0]
        written = bool(penalised or banned or allowed and not whole)
        if written or any(not p.greedy or p.wants_logprobs for p in params):
            logits = logits.to(torch.promote_types(logits.dtype, torch.float32), copy=written)
        for i in penalised:
            logits[i] = apply_penalties(logits[i].clone(), params[i], prompts[i], outputs[i])
        for i, ids in banned.items():
            logits[i, ids] = float("-inf")
        if whole:                # every row constrained: one pass makes the masked copy
            logits = torch.where(allowed.blocked, float("-inf"), logits)
        elif allowed is not None:
            rows = torch.tensor(allowed.rows, device=logits.device)
            logits[rows] = logits[rows].masked_fill(allowed.blocked, float("-inf"))
        chosen = self.argmax(logits).tolist()
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if sampled:
            for i, token in zip(sampled, self._draw(logits[sampled], [params[i] for i in sampled],
                                                    [step_seed(seeds[i], steps[i]) for i in sampled])):
                chosen[i] = token
        return Sampled(chosen, *token_logprobs(logits, params, chosen))

    def _banned(self, params: list[SamplingParams], steps: list[int], vocab: int,
                ended: set[int]) -> dict[int, list[int]]:
        """Row -> the end tokens it may not draw yet (rows still short of min_new_tokens,
        but for those whose grammar is complete: an end token is all they may draw)."""
        out = {}
        for i, p in enumerate(params):
            if steps[i] < p.min_new_tokens and i not in ended:
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
