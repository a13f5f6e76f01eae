"""Where a prefill's prompt pages come from: the prefix cache's pages for the prompt's
cached prefix (referenced, shared with other requests), then new pages from the pool,
evicting idle cached pages for room. With the cache off, only new pages."""
from __future__ import annotations

from typing import Callable

from engines.kv.pool import KVPool
from engines.kv.prefix_cache import PrefixCache, cache_status
from zpd.wire.recent import Recent
from zpd.worker.jobs import PrefillJob


class PromptPages:
    """A prefill's page source; also what its status and /metrics say of the cache."""

    def __init__(self, pool: KVPool, cached: bool, version: Callable[[], str]) -> None:
        self.pool, self.page_size, self.version = pool, pool.layout.page_size, version
        self.cache = PrefixCache(pool.allocator, self.page_size) if cached else None
        self.recent = Recent(60, width=2)      # (cached, looked-up) prompt tokens

    def keys(self, job: PrefillJob) -> list[bytes]:
        """The prefix-cache keys of the job's prompt under the current weights (none
        with the cache off)."""
        if self.cache is None:
            return []
        version = self.version()
        if job.prefix_keys is None or job.prefix_keys[0] != version:
            job.prefix_keys = (version, self.cache.keys(job.req.prompt, version))
        return job.prefix_keys[1]

    def hit(self, job: PrefillJob) -> int:
        """Pages of the job's prompt the cache holds now."""
        return self.cache.peek(self.keys(job), len(job.req.prompt)) if self.cache else 0

    def fits(self, job: PrefillJob) -> bool:
        """Pages enough for the job now (its own hits are not room to evict)."""
        need, room = self.pool.pages_for(len(job.req.prompt)), self.pool.allocator.free
        if self.cache is not None:
            hit = self.hit(job)
            need -= hit
            room += max(0, self.cache.evictable - hit)
        return need <= room

    def take(self, job: PrefillJob) -> int:
        """Give the job its pages (`fits` said they are there); the cached pages it
        skips computing."""
        n = len(job.req.prompt)
        cached = self.cache.match(self.keys(job), n) if self.cache is not None else []
        rest = self.pool.pages_for(n) - len(cached)
        if self.cache is not None:
            self.cache.make_room(rest)
        job.req.pages, job.skip = cached + self.pool.allocator.alloc(rest), len(cached)
        self.recent.add(len(cached) * self.page_size, n)
        return len(cached)

    def computed(self, job: PrefillJob) -> None:
        """The job's prompt KV is computed: its full pages join the cache."""
        if self.cache is not None:
            self.cache.insert(self.keys(job), job.req.pages, job.skip)

    def free(self, pages: list[int]) -> None:
        """Give a job's pages back: the cache's are released to it, the rest freed."""
        own = self.cache.release(pages) if self.cache is not None else pages
        if own:
            self.pool.allocator.free_pages(own)

    def invalidate(self) -> int:
        """Drop every cached page (new weights, or a flush); the pages freed."""
        return self.cache.invalidate() if self.cache is not None else 0

    def status(self) -> dict:
        """cache_status's fields, with the last minute's hits for /metrics."""
        status = cache_status(self.cache)
        hits, asked = self.recent.totals()
        status["prefix_cache"] |= {"recent_hit_tokens": hits, "recent_query_tokens": asked}
        return status
