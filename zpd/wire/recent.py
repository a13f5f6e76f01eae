"""Totals over the last few seconds, for rates a scrape reads (generation tokens per
second, prefix-cache hit rate): what happened recently, not since start, and not
between two scrapes (several scrapers, or none for a while, must not change it).

Amounts are added into one bucket per second, so the memory is bounded by the span
whatever the traffic; a bucket older than the span is dropped as time moves on.
"""
from __future__ import annotations

import time
from collections import deque
from typing import Callable


class Recent:
    """Sums of one or more amounts over the last `span` seconds."""

    def __init__(self, span: int = 10, width: int = 1,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if span < 1:
            raise ValueError(f"span {span} s: at least one second")
        self.span, self.width, self.clock = int(span), width, clock
        self.started = clock()
        self._buckets: deque[list] = deque()         # [whole second, amount, amount, ...]

    def add(self, *amounts: float) -> None:
        """Count `amounts` (as many as `width`) now."""
        now = int(self.clock())
        if not self._buckets or self._buckets[-1][0] != now:
            self._buckets.append([now] + [0] * self.width)
            self._drop(now)
        bucket = self._buckets[-1]
        for i, amount in enumerate(amounts[:self.width]):
            bucket[i + 1] += amount

    def totals(self) -> list[float]:
        """Each amount's sum over the span (the buckets of its whole seconds)."""
        self._drop(int(self.clock()))
        return [sum(b[i + 1] for b in self._buckets) for i in range(self.width)]

    def per_second(self) -> float:
        """The first amount's sum over the span divided by the time its buckets cover
        (since start while that is shorter; at least a second, so one early token is no
        spike): a rate that falls to 0 when nothing happens."""
        now = self.clock()
        since = max(int(now) - self.span + 1, self.started)
        return self.totals()[0] / max(now - since, 1.0)

    def _drop(self, now: int) -> None:
        while self._buckets and self._buckets[0][0] <= now - self.span:
            self._buckets.popleft()
