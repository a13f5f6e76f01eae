"""Page allocation for the KV pool: plain Python, contiguous runs preferred.

Contiguous pages coalesce into one transfer entry, so `alloc` takes the smallest free
run that fits whole (best fit) and only splits across runs when none does.
"""
from __future__ import annotations

from typing import Callable

import bisect


class PoolFull(Exception):
    """Not enough free pages now; the caller should wait (back-pressure), not fail."""


class PageAllocator:
    def __init__(self, total: int, on_free: Callable[[list[int]], None] | None = None) -> None:
        """`on_free(pages)` runs before freed pages can be handed out again (the pool
        clears them there when asked to)."""
        if total <= 0:
            raise ValueError("a pool needs at least one page")
        self.total, self.on_free = total, on_free
        self._starts: list[int] = [0]          # sorted starts of free runs
        self._lengths: dict[int, int] = {0: total}
        self._free = total
        self._allocated: set[int] = set()

    @property
    def free(self) -> int:
        return self._free

    @property
    def allocated(self) -> int:
        return len(self._allocated)

    def can_alloc(self, n: int) -> bool:
        return n <= self._free

    def alloc(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError("negative page count")
        if n > self._free:
            raise PoolFull(f"need {n} pages, {self._free} free of {self.total}")
        pages: list[int] = []
        while len(pages) < n:
            pages += self._take(n - len(pages))
        self._allocated.update(pages)
        self._free -= n
        return pages

    def _take(self, n: int) -> list[int]:
        fits = [s for s in self._starts if self._lengths[s] >= n]
        if fits:
            start = min(fits, key=lambda s: self._lengths[s])
        else:
            start = max(self._starts, key=lambda s: self._lengths[s])
        length = self._lengths.pop(start)
        self._starts.remove(start)
        take = min(n, length)
        if take < length:
            self._insert(start + take, length - take)
        return list(range(start, start + take))

    def free_pages(self, pages: list[int]) -> None:
        bad = [p for p in pages if p not in self._allocated]
        if bad or len(set(pages)) != len(pages):
            raise ValueError(f"freeing pages that are not allocated: {bad[:5] or 'duplicates'}")
        if self.on_free is not None:
            self.on_free(pages)
        self._allocated.difference_update(pages)
        self._free += len(pages)
        for start, length in page_runs(sorted(pages)):
            self._insert(start, length)

    def _insert(self, start: int, length: int) -> None:
        """Add a free run, merging with its neighbours."""
        i = bisect.bisect_left(self._starts, start)
        if i > 0:
            prev = self._starts[i - 1]
            if prev + self._lengths[prev] == start:
                start, length = prev, length + self._lengths.pop(prev)
                self._starts.pop(i - 1)
                i -= 1
        if i < len(self._starts) and start + length == self._starts[i]:
            length += self._lengths.pop(self._starts.pop(i))
        self._starts.insert(i, start)
        self._lengths[start] = length

    def check(self) -> None:
        """Invariant: free runs and allocated pages partition the pool exactly."""
        free = [p for s in self._starts for p in range(s, s + self._lengths[s])]
        assert len(free) == self._free, "free count drifted"
        assert not set(free) & self._allocated, "a page is both free and allocated"
        assert len(free) + len(self._allocated) == self.total, "pages lost"
        assert self._starts == sorted(self._starts), "free runs unsorted"
        assert all(s + self._lengths[s] < t for s, t in zip(self._starts, self._starts[1:])), \
            "adjacent free runs not merged"


def page_runs(sorted_pages: list[int]) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for p in sorted_pages:
        if runs and runs[-1][0] + runs[-1][1] == p:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((p, 1))
    return runs
