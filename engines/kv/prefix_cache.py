"""A cache of computed prompt pages, so a prompt shared by many requests (GRPO's
samples of one prompt, a conversation resent with one more turn) is computed once.

Only full pages are cached. A page's key is a hash chain: the key of the page before
it, the weight version, and the page's own tokens, so a page matches only after the
very same tokens before it under the very same weights (KV depends on both). Keys
are BLAKE2b digests: a client cannot craft a prompt whose key equals another's.

The cache owns its pages (the allocator counts them allocated). A request that uses
one holds a reference; a page no request references is *cached*: kept for the next
match, and evicted, least recently used first, when the pool needs room. Pages are
accounted as free + held + fenced + cached == total.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from engines.kv.allocator import PageAllocator


@dataclass(eq=False)
class Entry:
    key: bytes
    page: int
    refs: int = 0


def page_keys(tokens: list[int], page_size: int, version: str, pages: int) -> list[bytes]:
    """The keys of the first `pages` full pages of `tokens`."""
    keys, prev = [], version.encode()
    for i in range(pages):
        chunk = array("q", tokens[i * page_size:(i + 1) * page_size]).tobytes()
        prev = hashlib.blake2b(prev + chunk, digest_size=16).digest()
        keys.append(prev)
    return keys


class PrefixCache:
    def __init__(self, allocator: PageAllocator, page_size: int) -> None:
        self.allocator, self.page_size = allocator, page_size
        self.by_key: dict[bytes, Entry] = {}
        self.by_page: dict[int, Entry] = {}       # every page the cache owns, stale ones too
        self.idle: OrderedDict[int, Entry] = OrderedDict()   # refs == 0, least recent first
        self.hit_tokens = 0
        self.query_tokens = 0

    @property
    def cached(self) -> int:
        """Pages kept for reuse that no request references."""
        return len(self.idle)

    @property
    def evictable(self) -> int:
        return len(self.idle)

    def owns(self, page: int) -> bool:
        return page in self.by_page

    # --- use -----------------------------------------------------------------------

    def keys(self, tokens: list[int], version: str) -> list[bytes]:
        """The keys of every full page of `tokens` (computed once per request)."""
        return page_keys(tokens, self.page_size, version, len(tokens) // self.page_size)

    def _usable(self, keys: list[bytes], tokens: int) -> list[bytes]:
        return keys[:(tokens - 1) // self.page_size]     # one token is always computed

    def peek(self, keys: list[bytes], tokens: int) -> int:
        """How many leading pages of a `tokens`-long prompt are cached."""
        n = 0
        for key in self._usable(keys, tokens):
            if key not in self.by_key:
                break
            n += 1
        return n

    def match(self, keys: list[bytes], tokens: int) -> list[int]:
        """The pages of the longest cached prefix of a `tokens`-long prompt whose page
        keys are `keys`, referenced for the caller. At least one token is left to
        compute: its logits are needed."""
        pages = []
        for key in self._usable(keys, tokens):
            entry = self.by_key.get(key)
            if entry is None:
                break
            self._ref(entry)
            pages.append(entry.page)
        self.query_tokens += tokens
        self.hit_tokens += len(pages) * self.page_size
        return pages

    def insert(self, keys: list[bytes], pages: list[int], skip: int) -> list[int]:
        """Adopt a just-computed prompt's full pages after its first `skip` (which
        came from the cache); returns the pages adopted, now referenced by the caller.
        A page whose key is cached already (computed by another request meanwhile) is
        not adopted: it stays the caller's own."""
        adopted = []
        for i in range(skip, len(keys)):
            if keys[i] in self.by_key:
                continue
            entry = Entry(keys[i], pages[i], refs=1)
            self.by_key[keys[i]] = entry
            self.by_page[pages[i]] = entry
            adopted.append(pages[i])
        return adopted

    def release(self, pages: list[int]) -> list[int]:
        """Drop the caller's references to the cache's pages among `pages`, deepest
        first (so a prompt's later pages are evicted before its earlier ones); returns
        the pages that are not the cache's (the caller frees those)."""
        own = []
        for page in reversed(pages):
            entry = self.by_page.get(page)
            if entry is None:
                own.append(page)
                continue
            entry.refs -= 1
            if entry.refs == 0:
                if self.by_key.get(entry.key) is entry:
                    self.idle[page] = entry
                else:                              # invalidated while in use
                    del self.by_page[page]
                    self.allocator.free_pages([page])
        return own[::-1]

    def _ref(self, entry: Entry) -> None:
        if entry.refs == 0:
            self.idle.pop(entry.page, None)
        entry.refs += 1

    # --- room and invalidation --------------------------------------------------------

    def make_room(self, pages: int) -> bool:
        """Evict idle pages, least recently used first, until `pages` are free."""
        while self.allocator.free < pages and self.idle:
            page, entry = self.idle.popitem(last=False)
            del self.by_key[entry.key], self.by_page[page]
            self.allocator.free_pages([page])
        return self.allocator.free >= pages

    def invalidate(self) -> int:
        """Forget every entry (new weights, or flush_cache): idle pages are freed now,
        referenced ones when their last user lets go. Returns the pages freed now."""
        freed = list(self.idle)
        self.idle.clear()
        for page in freed:
            del self.by_page[page]
        self.by_key.clear()
        if freed:
            self.allocator.free_pages(freed)
        return len(freed)



def cache_status(cache: PrefixCache | None) -> dict:
    """A worker's status fields for its cache (None: turned off): the cached pages
    (merged into kv_pages), enabled and hit rate, and the counters /metrics exports."""
    hits, asked = (cache.hit_tokens, cache.query_tokens) if cache is not None else (0, 0)
    return {"cached": cache.cached if cache is not None else 0,
            "prefix_cache": {"enabled": cache is not None,
                             "hit_rate": round(hits / asked, 4) if asked else 0.0},
            "counters": {"prefix_cache_hit_tokens": hits, "prefix_cache_query_tokens": asked}}
