"""The KV page book: the one owner of a worker's pages.

Every page of the pool is in exactly one of four states, and
free + held + fenced + cached == total (`PageBook.check`):

- free: the allocator's, handed out next;
- held: in a live request's page table (its KV being computed, written to or from a
  peer, or decoded); a prefix-cache page that several requests share is held once;
- fenced: its request ended while a prefill's write into it may still land
  (zpd/worker/fences.py says until when);
- cached: kept by the prefix cache for the next request with that prefix.

The schedulers reserve, release and fence a request's pages here and nowhere else:
the allocator and the prefix cache (engines/kv/) are the book's own. The prefix cache
may be off (--no-prefix-cache, --clear-freed-pages); `NoCache` then stands in for it,
so no caller asks which.
"""
from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Protocol

from engines.kv.allocator import PageAllocator
from engines.kv.pool import KVPool
from engines.kv.prefix_cache import PrefixCache, cache_status
from engines.loader import LoadedModel
from engines.request import Request
from zpd.config import WorkerConfig
from zpd.wire.loop import Loop
from zpd.wire.recent import Recent
from zpd.worker.fences import Fences, Key

log = logging.getLogger("zpd.worker.pages")

FENCE_SLACK_S = 5.0        # a fence outlasts the longest write by this much


class PageError(RuntimeError):
    """The book was asked the impossible (a request's pages reserved or released twice)
    or found its invariant broken: a bug in the caller or the book, said loudly."""


@dataclass(frozen=True)
class Prefix:
    """A request's first `tokens` tokens as the prefix cache sees them: the keys of
    their full pages under the weight `version` (none with the cache off). A hit takes
    at most the first `reusable` tokens' whole pages (None: any): a prompt whose
    logprobs are asked for computes the positions they read."""
    version: str
    tokens: int
    keys: tuple[bytes, ...]
    reusable: int | None = None

    def usable(self, page_size: int) -> tuple[bytes, ...]:
        """The keys a cache hit may take."""
        return self.keys if self.reusable is None else self.keys[:self.reusable // page_size]


class NoCache:
    """The prefix cache turned off: it keeps nothing, so each answer is the one an
    empty cache would give."""

    cached = evictable = 0

    def __init__(self, allocator: PageAllocator) -> None:
        self.allocator = allocator
        self.by_page: dict = {}
        self.idle: dict = {}

    def keys(self, tokens: list[int], version: str) -> list[bytes]:
        return []

    def peek(self, keys: tuple[bytes, ...], tokens: int) -> int:
        return 0

    def match(self, keys: tuple[bytes, ...], tokens: int) -> list[int]:
        return []

    def insert(self, keys: tuple[bytes, ...], pages: list[int], skip: int) -> list[int]:
        return []

    def release(self, pages: list[int]) -> list[int]:
        return list(pages)

    def make_room(self, pages: int) -> bool:
        return self.allocator.free >= pages

    def invalidate(self) -> int:
        return 0


class PageHost(Protocol):
    """What `PageBook.for_worker` reads of a worker: its settings, pool, loop and model
    (whose version keys the prefix cache)."""
    cfg: WorkerConfig
    pool: KVPool
    loop: Loop
    model: LoadedModel


class PageBook:
    """A worker's KV pages: who holds which, what is fenced or cached, and the room
    left. A request's pages are `req.pages` (what the model reads); the book records
    each holder and how many of its leading pages came from the cache."""

    def __init__(self, pool: KVPool, loop: Loop, caching: bool, version: Callable[[], str],
                 fence_s: float, dead_limit: float, is_dead: Callable[[str], bool]) -> None:
        self.allocator, self.page_size = pool.allocator, pool.layout.page_size
        self.caching, self.version = caching, version
        self.cache = PrefixCache(self.allocator, self.page_size) if caching \
            else NoCache(self.allocator)
        self.fences = Fences(loop, self.allocator.free_pages, fence_s, dead_limit, is_dead)
        self.holders: dict[Request, int] = {}      # request -> its leading pages from the cache
        self.recent = Recent(60, width=2)          # (cached, looked-up) prefix tokens

    @classmethod
    def for_worker(cls, core: PageHost,
                   is_dead: Callable[[str], bool] = lambda endpoint: False) -> PageBook:
        """The book of `core`'s pool. `is_dead(prefill)`: that prefill is silent, so a
        write of its may be frozen mid-way (a decode's fences wait longer then)."""
        cfg = core.cfg
        # --clear-freed-pages asks that no request's KV outlive it: nothing is cached then
        return cls(core.pool, core.loop, cfg.prefix_cache and not cfg.clear_freed_pages,
                   lambda: core.model.version, cfg.deadlines.transfer + FENCE_SLACK_S,
                   cfg.deadlines.dead_fence, is_dead)

    def __contains__(self, req: object) -> bool:
        """`req` holds pages now."""
        return req in self.holders

    # --- looking up ------------------------------------------------------------------

    def prefix(self, req: Request, tokens: int, known: Prefix | None = None,
               reusable: int | None = None) -> Prefix:
        """`req`'s first `tokens` tokens (its prompt, then its output) under the current
        weights, of which a hit takes at most `reusable`; `known` when it is that
        already (keys are hashed once per epoch)."""
        version = self.version()
        if known is not None and (known.version, known.tokens, known.reusable) == (version, tokens, reusable):
            return known
        extra = tokens - len(req.prompt)
        text = req.prompt + req.output[:extra] if extra > 0 else req.prompt[:tokens]
        return Prefix(version, tokens, tuple(self.cache.keys(text, version)), reusable)

    def hit(self, prefix: Prefix) -> int:
        """Leading pages of `prefix` the cache holds now (of those a hit may take)."""
        return self.cache.peek(prefix.usable(self.page_size), prefix.tokens)

    def fits(self, prefix: Prefix, pages: int) -> bool:
        """`reserve(_, prefix, pages)` would succeed now (a prefix's own cached pages
        are no room to evict for it)."""
        hit = self.hit(prefix)
        return pages - hit <= self.allocator.free + max(0, self.cache.evictable - hit)

    # --- holding ---------------------------------------------------------------------

    def reserve(self, req: Request, prefix: Prefix, pages: int) -> int | None:
        """Give `req` `pages` pages: the cache's for the leading pages of `prefix`
        (shared, referenced), then new ones, evicting idle cached pages for room.
        How many came from the cache; None, with nothing taken, if there is no room."""
        if req in self.holders:
            raise PageError(f"rid={req.rid!r} holds pages already")
        cached = self.cache.match(prefix.usable(self.page_size), prefix.tokens)
        if not self.cache.make_room(pages - len(cached)):
            self.cache.release(cached)
            return None
        req.pages = cached + self.allocator.alloc(pages - len(cached))
        self.holders[req] = len(cached)
        self.recent.add(len(cached) * self.page_size, prefix.tokens)
        return len(cached)

    def computed(self, req: Request, prefix: Prefix) -> None:
        """`req`'s pages hold the KV of `prefix` now: its full pages join the cache."""
        self.cache.insert(prefix.keys, req.pages, self._holding(req))

    def release(self, req: Request) -> None:
        """Take back `req`'s pages: the cache's go back to it, the rest are freed."""
        own = self._let_go(req)
        if own:
            self.allocator.free_pages(own)

    def fence(self, req: Request, key: Key, prefill: str) -> None:
        """As `release`, but `req`'s own pages stay fenced while `prefill`'s write for
        `key` (room, epoch) may still land. The cache's go back: no write targets them
        (a kv_dest leaves cached pages out; a page is adopted once its write is done)."""
        own = self._let_go(req)
        if own:
            self.fences.add(key, own, prefill)

    def _holding(self, req: Request) -> int:
        skip = self.holders.get(req)
        if skip is None:
            raise PageError(f"rid={req.rid!r} holds no pages (released twice?)")
        return skip

    def _let_go(self, req: Request) -> list[int]:
        self._holding(req)
        del self.holders[req]
        own, req.pages = self.cache.release(req.pages), []
        return own

    # --- fences ----------------------------------------------------------------------

    def answered(self, key: Key, prefill: str) -> bool:
        """`prefill` answered for `key`: its fenced pages, if any, are free now."""
        return self.fences.answered(key, prefill)

    def prefill_restarted(self, prefill: str) -> int:
        """`prefill` is a new process: none of its writes can land; fences freed."""
        return self.fences.release_prefill(prefill)

    @property
    def fenced(self) -> int:
        return self.fences.pages

    # --- the cache as a whole --------------------------------------------------------

    def invalidate(self) -> int:
        """Drop every cached page (a flush): idle ones are freed now, those in use
        once their last user lets go. The pages freed now."""
        return self.cache.invalidate()

    def weights_changed(self) -> None:
        """KV computed under the old weights must never be used again."""
        if self.caching:
            log.info("prefix cache invalidated (new weights): %d pages freed", self.invalidate())

    # --- counts ----------------------------------------------------------------------

    @property
    def in_use(self) -> int:
        """Pages anyone has: held, fenced or cached."""
        return self.allocator.allocated

    def counts(self) -> dict[str, int]:
        """status' kv_pages: total, free, held, fenced, cached."""
        held = {p for req in self.holders for p in req.pages}      # a shared page once
        return {"total": self.allocator.total, "free": self.allocator.free, "held": len(held),
                "fenced": self.fences.pages, "cached": self.cache.cached}

    def status(self) -> dict:
        """The prefix cache's status fields (prefix_cache, counters), with the last
        minute's hits for /metrics."""
        status = cache_status(self.cache if self.caching else None)
        del status["cached"]                       # counted in kv_pages
        hits, asked = self.recent.totals()
        status["prefix_cache"] |= {"recent_hit_tokens": hits, "recent_query_tokens": asked}
        return status

    def check(self) -> None:
        """The invariant: every page is free, held, fenced or cached, and only one of
        them; a shared cached page is referenced once per holder. Raises PageError."""
        try:
            self.allocator.check()
        except AssertionError as e:
            raise PageError(f"allocator: {e}") from None
        c = self.counts()
        if c["free"] + c["held"] + c["fenced"] + c["cached"] != c["total"]:
            raise PageError(f"free + held + fenced + cached != total: {c}")
        uses = Counter(p for req in self.holders for p in req.pages)
        fenced = [p for fence in self.fences.by_key.values() for p in fence.pages]
        states = list(uses) + fenced + list(self.cache.idle)
        if len(set(states)) != len(states) or len(states) != self.allocator.allocated:
            raise PageError(f"a page is in two states, or in none: {c}")
        shared = {p: e.refs for p, e in self.cache.by_page.items() if e.refs}
        wrong = [p for p, n in uses.items() if n != shared.get(p, 1)] + \
            [p for p in shared if p not in uses]
        if wrong:
            raise PageError(f"pages {wrong[:5]} are held by other than their holders")
