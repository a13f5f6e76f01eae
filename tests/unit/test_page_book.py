"""The KV page book (zpd/worker/pages.py): its state machine keeps
free + held + fenced + cached == total after every operation, refuses a double
release loudly, and is the only code in zpd/ that touches the allocator or the
prefix cache."""
from __future__ import annotations

import ast
import random
from pathlib import Path

import pytest
import torch

from engines.kv.layout import KVLayout
from engines.kv.pool import KVPool
from engines.request import Request
from engines.sampler import SamplingParams
from zpd.wire.loop import Loop
from zpd.worker.pages import PageBook, PageError

ROOT = Path(__file__).resolve().parents[2]
PAGE = 4
TOTAL = 12


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(params=[True, False], ids=["cache", "no_cache"])
def world(request):
    clock, dead = Clock(), set()
    loop = Loop(clock=clock)
    layout = KVLayout(num_layers=1, page_size=PAGE, num_kv_heads=1, head_dim=2,
                      dtype="float32", element_bytes=4)
    pool = KVPool(layout, TOTAL, torch.float32, torch.device("cpu"))
    book = PageBook(pool, loop, request.param, lambda: "v1", fence_s=7.0, dead_limit=60.0,
                    is_dead=lambda p: p in dead)

    def advance(seconds: float) -> None:
        for _ in range(int(seconds * 2)):
            clock.now += 0.5
            loop.run_once(max_wait=0)

    yield book, advance
    loop.close()


def req(prompt: list[int], rid: str = "r") -> Request:
    return Request(rid, list(prompt), SamplingParams())


def take(book: PageBook, r: Request, pages: int) -> int | None:
    """Reserve `pages` for `r` (its prompt as the prefix) and check the book."""
    got = book.reserve(r, book.prefix(r, len(r.prompt)), pages)
    book.check()
    return got


def counts(book: PageBook) -> tuple[int, int, int, int]:
    c = book.counts()
    assert c["free"] + c["held"] + c["fenced"] + c["cached"] == c["total"] == TOTAL, c
    return c["free"], c["held"], c["fenced"], c["cached"]


PROMPT = list(range(1, 11))              # 10 tokens: 2 full pages usable from a cache


def test_reserve_and_release(world):
    book, _ = world
    a = req(PROMPT)
    assert take(book, a, 4) == 0 and len(a.pages) == 4 and a in book
    assert counts(book) == (8, 4, 0, 0)
    book.release(a)
    book.check()
    assert a.pages == [] and a not in book and counts(book) == (12, 0, 0, 0)


def test_double_release_and_double_reserve_are_refused_loudly(world):
    book, _ = world
    a = req(PROMPT)
    take(book, a, 3)
    with pytest.raises(PageError, match="holds pages already"):
        take(book, a, 1)
    book.release(a)
    with pytest.raises(PageError, match="released twice"):
        book.release(a)
    with pytest.raises(PageError, match="released twice"):
        book.fence(a, (1, 0), "p1")
    book.check()
    assert counts(book) == (12, 0, 0, 0)


def test_computed_pages_are_cached_and_shared(world):
    book, _ = world
    a, b = req(PROMPT, "a"), req(PROMPT, "b")
    take(book, a, 3)
    book.computed(a, book.prefix(a, len(PROMPT)))
    book.check()
    cached = 2 if book.caching else 0
    assert take(book, b, 3) == cached                   # a's two full pages, shared
    assert b.pages[:cached] == a.pages[:cached]
    assert counts(book) == (12 - 6 + cached, 6 - cached, 0, 0)   # a shared page counts once
    book.release(a)
    book.check()
    book.release(b)
    book.check()
    assert counts(book) == (12 - cached, 0, 0, cached)
    assert book.invalidate() == cached
    book.check()
    assert counts(book) == (12, 0, 0, 0)


def test_no_room_takes_nothing(world):
    book, _ = world
    a, b = req(PROMPT, "a"), req(PROMPT, "b")
    take(book, a, 10)
    book.computed(a, book.prefix(a, len(PROMPT)))
    prefix = book.prefix(b, len(PROMPT))
    assert not book.fits(prefix, 5)
    assert take(book, b, 5) is None and b.pages == [] and b not in book
    assert counts(book) == (2, 10, 0, 0)
    assert book.fits(prefix, 4 if book.caching else 2)    # its cached pages need no room
    assert take(book, b, 4 if book.caching else 2) is not None


def test_fence_holds_own_pages_until_the_prefill_answers(world):
    book, advance = world
    a, b = req(PROMPT, "a"), req(PROMPT, "b")
    take(book, a, 3)
    book.computed(a, book.prefix(a, len(PROMPT)))
    take(book, b, 4)
    cached = 2 if book.caching else 0
    book.fence(b, (7, 0), "p1")                      # the cache's pages go back, unfenced
    book.check()
    assert b.pages == [] and book.fenced == 4 - cached
    assert not book.answered((7, 0), "p2") and book.fenced == 4 - cached
    assert book.answered((7, 0), "p1")
    book.check()
    assert book.fenced == 0
    book.release(a)
    c = req([9] * 10, "c")
    take(book, c, 2)
    book.fence(c, (8, 0), "p1")
    assert book.fenced == 2
    advance(6.5)
    assert book.fenced == 2
    advance(1.0)                                     # a live prefill's fence passes
    book.check()
    assert book.fenced == 0 and counts(book)[1] == 0


def test_a_restarted_prefill_frees_its_fences(world):
    book, _ = world
    a = req(PROMPT)
    take(book, a, 3)
    book.fence(a, (1, 0), "p1")
    assert book.fenced == 3 and book.prefill_restarted("p1") == 1
    book.check()
    assert counts(book) == (12, 0, 0, 0)


def test_invalidated_pages_in_use_go_when_their_user_lets_go(world):
    book, _ = world
    a = req(PROMPT)
    take(book, a, 3)
    book.computed(a, book.prefix(a, len(PROMPT)))
    assert book.invalidate() == 0                    # in use: not freed yet
    book.check()
    book.release(a)
    book.check()
    assert counts(book) == (12, 0, 0, 0)


def test_check_finds_a_page_outside_the_book(world):
    book, _ = world
    a = req(PROMPT)
    take(book, a, 3)
    book.allocator.alloc(1)                          # allocated to nobody the book knows
    with pytest.raises(PageError, match="free \\+ held"):
        book.check()


def test_check_finds_a_page_held_twice(world):
    book, _ = world
    a, b = req(PROMPT, "a"), req([9] * 10, "b")
    take(book, a, 3)
    take(book, b, 3)
    b.pages[0] = a.pages[2]                          # two requests' KV in one page
    with pytest.raises(PageError):
        book.check()


def test_random_operations_keep_the_invariant(world):
    book, advance = world
    rng = random.Random(7)
    prompts = [[rng.randrange(3) for _ in range(rng.randrange(2, 14))] for _ in range(6)]
    live: list[Request] = []
    for step in range(400):
        op = rng.random()
        if op < 0.4:
            r = req(rng.choice(prompts), f"r{step}")
            prefix, need = book.prefix(r, len(r.prompt)), rng.randrange(1, 6)
            need = max(need, -(-len(r.prompt) // PAGE))
            fits = book.fits(prefix, need)                # may be cautious, never wrong
            got = book.reserve(r, prefix, need)
            assert got is not None or not fits
            assert (r in book) == (got is not None)
            assert len(r.pages) == (0 if got is None else need)
            if got is not None:
                live.append(r)
                if rng.random() < 0.7:
                    book.computed(r, prefix)
        elif op < 0.7 and live:
            book.release(live.pop(rng.randrange(len(live))))
        elif op < 0.85 and live:
            book.fence(live.pop(rng.randrange(len(live))), (step, 0), rng.choice(["p1", "p2"]))
        elif op < 0.9:
            book.answered((rng.randrange(step + 1), 0), "p1")
        elif op < 0.95:
            book.invalidate()
        else:
            advance(1.0)
        book.check()
    for r in live:
        book.release(r)
    advance(8.0)
    book.check()
    assert counts(book)[:3] == (TOTAL - book.counts()["cached"], 0, 0)


# --- nothing else in zpd/ touches the allocator or the prefix cache -----------------


def direct_page_uses(path: Path) -> list[str]:
    """Where a file imports the allocator or the prefix cache, reads an `allocator`
    attribute, or asks whether a cache is there (`cache is None`)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        line = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.ImportFrom) and node.module in (
                "engines.kv.allocator", "engines.kv.prefix_cache"):
            found.append(f"{line} imports {node.module}")
        elif isinstance(node, ast.Import) and any(
                a.name.startswith(("engines.kv.allocator", "engines.kv.prefix_cache"))
                for a in node.names):
            found.append(f"{line} imports the allocator or the prefix cache")
        elif isinstance(node, ast.Attribute) and node.attr == "allocator":
            found.append(f"{line} reads .allocator")
        elif isinstance(node, ast.Compare) and ast.unparse(node.left).lower().endswith("cache") and \
                any(isinstance(c, ast.Constant) and c.value is None for c in node.comparators):
            found.append(f"{line} asks whether a cache is there")
    return found


def test_only_the_page_book_touches_the_allocator_and_the_prefix_cache():
    book = ROOT / "zpd" / "worker" / "pages.py"
    uses = [u for path in sorted((ROOT / "zpd").rglob("*.py")) if path != book
            for u in direct_page_uses(path)]
    assert uses == []
    assert direct_page_uses(book)                    # the check sees what it looks for
