"""The order a prefill takes its queued jobs in: callers take turns.

A prefill's queue was first come, first served: one HTTP call of 64 prompts of 2,000
tokens to score (max_new_tokens 0, top 20 logprobs) queued 64 jobs, and a bystander's
4-token request that came a moment later waited for all of them (14 s with the tiny
model, 25 s with SmolLM2). Here each job belongs to a caller (the router that sent it,
its client and the user that client named; a recompute, to the decode that asked),
and a step takes jobs round-robin between callers, the caller served least recently
first, each caller's own jobs in their order. A newcomer is in the next step, so it
waits for at most the step under way, whatever another caller has queued; and a step
takes at most the tokens this worker computes in --prefill-step-seconds (StepBudget),
so the step under way is short (SmolLM2 on one CPU thread computed 8,192 tokens in one
30 s step).
"""
from __future__ import annotations

from itertools import chain, zip_longest
from typing import Hashable, Iterable, Protocol


class Job(Protocol):
    caller: Hashable


class FairTurns:
    """Which caller's job a prefill step takes next."""

    def __init__(self) -> None:
        self.steps = 0
        self.last: dict[Hashable, int] = {}    # caller -> the step that last served it

    def order(self, pending: Iterable[Job]) -> list[Job]:
        """`pending` (in arrival order) as a step should take it."""
        mine: dict[Hashable, list[Job]] = {}
        for job in pending:
            mine.setdefault(job.caller, []).append(job)
        callers = sorted(mine, key=lambda c: self.last.get(c, -1))    # stable: arrival breaks ties
        turns = zip_longest(*(mine[c] for c in callers))
        return [job for job in chain.from_iterable(turns) if job is not None]

    def first(self, pending: Iterable[Job]) -> Job | None:
        """The job `order` puts first, without ordering the rest (asked on every turn of
        the loop: it stops at the first job of a caller not served yet, whom nobody beats)."""
        best, best_at = None, 0
        for job in pending:
            at = self.last.get(job.caller, -1)
            if at < 0:
                return job
            if best is None or at < best_at:
                best, best_at = job, at
        return best

    def served(self, batch: list[Job], waiting: Iterable[Job]) -> None:
        """A step took `batch`; forget callers with nothing left queued (one that comes
        back counts as new, and is served first), so the book stays as small as the queue."""
        self.steps += 1
        for job in batch:
            self.last[job.caller] = self.steps
        left = {job.caller for job in waiting}
        self.last = {c: s for c, s in self.last.items() if c in left}


class StepBudget:
    """The most tokens a prefill step takes: `cap` (--max-prefill-tokens), and what the
    worker computed per second in its recent steps times `seconds` (0: no such bound)."""

    def __init__(self, cap: int, seconds: float, floor: int) -> None:
        self.cap, self.seconds, self.floor = cap, seconds, floor
        self.rate: float | None = None        # tokens per second, a moving average

    def tokens(self) -> int:
        if not self.seconds or self.rate is None:
            return self.cap
        return max(self.floor, min(self.cap, int(self.rate * self.seconds)))

    def took(self, tokens: int, seconds: float) -> None:
        """A step computed `tokens` in `seconds`."""
        if tokens <= 0 or seconds <= 0:
            return
        rate = tokens / seconds
        self.rate = rate if self.rate is None else 0.7 * self.rate + 0.3 * rate
