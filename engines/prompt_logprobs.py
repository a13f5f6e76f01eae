"""Prompt logprobs from a prefill: which rows the last layer computes for them, and
the logits projection over the vocabulary in chunks of rows.

Contract: the logprob of prompt token p is the raw log_softmax of the model's logits
at position p - 1, in float32 (float64 for a float64 model): no temperature, no
penalties, as SGLang's input_token_logprobs. Position 0 has none (SGLang reports
null there), so asking from 0 or 1 gives positions 1..len-1.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

# The most bytes of float logits one chunk of rows holds ([rows, vocab]). The chunk's
# transient peak is this, 1.5x while a bfloat16/float16 model's logits are copied to
# float: no log-softmax is materialised. Each answer is its logit less the row's
# log-sum-exp, computed in place over the chunk: on CPU, torch.log_softmax and
# torch.logsumexp cost 1.6x and 2.1x as much, their [rows, vocab] results or scratch
# being fresh pages each chunk. A long prompt never holds [tokens, vocab] at once.
LOGITS_CHUNK_BYTES = 64 << 20


@dataclass(frozen=True)
class PromptLogprobAsk:
    """What one prompt asks for: logprobs of positions start..len-1 (SGLang's
    logprob_start_len), with its top_k alternatives and the logprobs of token_ids at
    each of them where asked."""
    start: int
    top_k: int = 0
    token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class PromptLogprobs:
    """A prompt's logprobs at positions first..len-1, one entry per position."""
    first: int                                          # max(start, 1)
    token_logprobs: list[float]                         # of prompt[p] given prompt[:p]
    top: list[list[tuple[int, float]]] | None = None    # top_k (id, logprob), highest first
    token_ids: list[list[float]] | None = None          # of ask.token_ids, in their order


@dataclass(frozen=True)
class ScoredRun:
    """The positions whose logits a prompt's logprobs read: first - 1 .. len - 2."""
    position: int                 # of the run's first row
    count: int


def scored_run(ask: PromptLogprobAsk | None, length: int, start: int) -> ScoredRun | None:
    """The run of prompt rows an ask needs computed. A prefill from `start` (a cached
    prefix before it) computes positions start..length-1 only, so it refuses an ask
    that reads a logit before start: the caller prefills from at most max(k, 1) - 1."""
    if ask is None:
        return None
    if not 0 <= ask.start < length or ask.top_k < 0:
        raise ValueError(f"prompt logprobs from {ask.start} (top {ask.top_k}) of a {length}-token prompt")
    first = max(ask.start, 1)
    if first - 1 < start:
        raise ValueError(f"prompt logprobs from position {ask.start} read the logits of position "
                         f"{first - 1}, inside the cached prefix of {start}: prefill from <= {first - 1}")
    return ScoredRun(first - 1, length - first)


def _logsumexp_(logits: torch.Tensor) -> torch.Tensor:
    """log(sum(exp(row))) of each row [rows, 1], overwriting `logits` (no scratch)."""
    top = logits.amax(dim=-1, keepdim=True)
    return logits.sub_(top).exp_().sum(dim=-1, keepdim=True).log_().add_(top)


def _rows_of(ids: dict, owner: list[int], lo: int, hi: int):
    """(prompt, its rows in the chunk lo..hi-1) for each prompt asking token_ids there."""
    for i in ids:
        mine = [r - lo for r in range(lo, hi) if owner[r] == i]
        if mine:
            yield i, mine


def chunk_rows(vocab: int, dtype: torch.dtype, bound: int) -> int:
    return max(1, bound // (vocab * torch.finfo(dtype).bits // 8))


@torch.inference_mode()
def prompt_logprobs(logits_of: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                    prompts: list[list[int]], asks: list[PromptLogprobAsk | None],
                    runs: list[ScoredRun | None], vocab: int,
                    per_row: bool = False) -> list[PromptLogprobs | None]:
    """hidden [R, hidden]: the runs' final hidden states, run after run (prompts
    without one have none); logits_of(hidden rows) -> their logits, a tensor this
    overwrites (inference mode: the model's weights are inference tensors).
    `per_row` (--deterministic): by torch.log_softmax, the sampler's own
    (engines/sampler.py, token_logprobs), so a generation's output logprobs and a
    scoring pass's are the same bits."""
    targets, owner = [], []
    for i, (p, run) in enumerate(zip(prompts, runs)):
        if run is not None:
            targets += p[run.position + 1:run.position + 1 + run.count]
            owner += [i] * run.count
    target = torch.tensor(targets, dtype=torch.long, device=hidden.device)
    dtype = torch.promote_types(hidden.dtype, torch.float32)
    step = chunk_rows(vocab, dtype, LOGITS_CHUNK_BYTES)
    top_k = max((a.top_k for a in asks if a is not None), default=0)
    chosen: list[torch.Tensor] = []
    tops: list[tuple[torch.Tensor, torch.Tensor]] = []  # (logprobs, ids) of the top_k per chunk
    ids: dict[int, list[torch.Tensor]] = {i: [] for i, a in enumerate(asks) if a is not None and a.token_ids}
    for lo in range(0, len(targets), step):
        hi = min(lo + step, len(targets))
        logits = logits_of(hidden[lo:hi]).to(dtype)                             # [rows, vocab]
        if per_row:
            logits = torch.log_softmax(logits, dim=-1)     # its log-sum-exp is then 0, bit for bit
        # Every answer's logit is read off first: the log-sum-exp then overwrites the chunk.
        picked = logits.gather(1, target[lo:hi, None])[:, 0]
        best = logits.topk(min(top_k, vocab), dim=-1) if top_k else None
        given = [(i, mine, logits[mine][:, list(asks[i].token_ids)])
                 for i, mine in _rows_of(ids, owner, lo, hi)]
        lse = logits.new_zeros(hi - lo, 1) if per_row else _logsumexp_(logits)     # [rows, 1]
        chosen.append(picked - lse[:, 0])
        if best is not None:
            tops.append((best.values - lse, best.indices))
        for i, mine, got in given:
            ids[i].append(got - lse[mine])
        del logits                                 # before the next chunk's: one chunk at a time
    return _split(asks, runs, torch.cat(chosen).tolist() if chosen else [], tops, ids)


def _split(asks: list[PromptLogprobAsk | None], runs: list[ScoredRun | None], chosen: list[float],
           tops: list[tuple[torch.Tensor, torch.Tensor]], ids: dict[int, list[torch.Tensor]]
           ) -> list[PromptLogprobs | None]:
    """The flat per-row answers -> each prompt's record."""
    values = torch.cat([v for v, _ in tops]).tolist() if tops else []
    top_ids = torch.cat([t for _, t in tops]).tolist() if tops else []
    out: list[PromptLogprobs | None] = []
    at = 0
    for i, (ask, run) in enumerate(zip(asks, runs)):
        if run is None:
            out.append(None)
            continue
        span = range(at, at + run.count)
        at += run.count
        top = [list(zip(top_ids[r][:ask.top_k], values[r][:ask.top_k])) for r in span] if ask.top_k else None
        given = None
        if ask.token_ids:
            given = torch.cat(ids[i]).tolist() if ids[i] else []
        out.append(PromptLogprobs(run.position + 1, chosen[span.start:span.stop], top, given))
    return out
