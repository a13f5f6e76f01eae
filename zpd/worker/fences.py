"""Decode pages that a prefill write may still reach ("fenced"), and when they come back.

A request that ends while its prefill may still be writing its KV leaves its pages
fenced: reusing them could let that late write corrupt another request. A fence
ends when the prefill answers for the (room, epoch) (`kv_done`/`kv_failed`: nothing
more will land), when the prefill turns out to be a new process (the old one, and
its writes, are gone), or when a fence longer than any write has passed.

That last clock only runs while the prefill is alive. A silent prefill may be
frozen in the middle of a write (SIGSTOP, a stalled VM) with its own clock stopped;
when it wakes, the write goes on. So while the prefill is dead to us the fence is
renewed, until it has lasted `dead_limit` seconds (rounded up to a whole fence),
after which the pages are returned: a prefill that never comes back leaks nothing
forever.
"""
from __future__ import annotations

import logging
from typing import Callable, NamedTuple

from zpd.wire.loop import Loop, Timer

log = logging.getLogger("zpd.worker.fences")

Key = tuple[int, int]          # (room, epoch)


class Fence(NamedTuple):
    pages: list[int]
    prefill: str               # the endpoint whose write may still land
    since: float
    timer: Timer


class Fences:
    """The fenced pages of one decode; hands them to `free` when safe (the page book's
    allocator: zpd/worker/pages.py)."""

    def __init__(self, loop: Loop, free: Callable[[list[int]], None], seconds: float,
                 dead_limit: float, is_dead: Callable[[str], bool]) -> None:
        self.loop, self.free = loop, free
        self.seconds, self.dead_limit, self.is_dead = seconds, dead_limit, is_dead
        self.by_key: dict[Key, Fence] = {}

    def __bool__(self) -> bool:
        return bool(self.by_key)

    @property
    def pages(self) -> int:
        return sum(len(f.pages) for f in self.by_key.values())

    def add(self, key: Key, pages: list[int], prefill: str) -> None:
        timer = self.loop.call_later(self.seconds, self._expired, key)
        self.by_key[key] = Fence(pages, prefill, self.loop.time(), timer)

    def answered(self, key: Key, prefill: str) -> bool:
        """`prefill` answered for `key`: if it fenced pages, they are free now."""
        fence = self.by_key.get(key)
        if fence is None or fence.prefill != prefill:
            return False
        self._free(key)
        return True

    def release_prefill(self, prefill: str) -> int:
        """Free every fence of `prefill` (it restarted); returns how many."""
        keys = [key for key, fence in self.by_key.items() if fence.prefill == prefill]
        for key in keys:
            self._free(key)
        return len(keys)

    def _expired(self, key: Key) -> None:
        fence = self.by_key.get(key)
        if fence is None:
            return
        waited, dead = self.loop.time() - fence.since, self.is_dead(fence.prefill)
        if dead and waited < self.dead_limit:
            log.info("room=%d epoch=%d: prefill %s silent; keeping %d pages fenced", *key,
                     fence.prefill, len(fence.pages))
            self.by_key[key] = fence._replace(timer=self.loop.call_later(self.seconds, self._expired, key))
            return
        if dead:
            log.error("room=%d epoch=%d: prefill %s silent for %.0f s; returning %d fenced pages",
                      *key, fence.prefill, waited, len(fence.pages))
        self._free(key)

    def _free(self, key: Key) -> None:
        fence = self.by_key.pop(key)
        fence.timer.cancel()
        self.free(fence.pages)
