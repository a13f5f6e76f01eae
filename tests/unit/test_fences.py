"""Fences: pages come back when the prefill answers, restarts, or a fence passes while
it is alive; a silent (maybe frozen mid-write) prefill keeps them fenced up to a limit."""
from __future__ import annotations

import pytest

from engines.kv.allocator import PageAllocator
from zpd.worker.fences import Fences
from zpd.wire.loop import Loop


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def world():
    clock, dead = Clock(), set()
    loop = Loop(clock=clock)
    alloc = PageAllocator(16)
    fences = Fences(loop, alloc.free_pages, seconds=7.0, dead_limit=60.0, is_dead=lambda p: p in dead)

    def advance(seconds: float) -> None:
        for _ in range(int(seconds * 2)):
            clock.now += 0.5
            loop.run_once(max_wait=0)

    yield fences, alloc, dead, advance
    loop.close()


def test_the_prefills_answer_frees_at_once_but_only_its_own(world):
    fences, alloc, _, _ = world
    fences.add((1, 0), alloc.alloc(3), "p1")
    assert not fences.answered((1, 0), "p2") and fences.pages == 3
    assert fences.answered((1, 0), "p1") and alloc.free == 16 and not fences


def test_a_live_prefills_fence_ends_after_the_fence_time(world):
    fences, alloc, _, advance = world
    fences.add((1, 0), alloc.alloc(3), "p1")
    advance(6.5)
    assert fences.pages == 3
    advance(1.0)
    assert alloc.free == 16


def test_a_silent_prefills_fence_is_kept_until_it_answers_or_the_limit(world):
    fences, alloc, dead, advance = world
    fences.add((1, 0), alloc.alloc(3), "frozen")
    fences.add((2, 0), alloc.alloc(2), "gone")
    dead |= {"frozen", "gone"}
    advance(30)
    assert fences.pages == 5                 # frozen mid-write: its clock stopped
    dead.discard("frozen")                   # it answers pings again ...
    advance(7.5)
    assert fences.pages == 2                 # ... and gets one more fence period
    advance(22)
    assert fences.pages == 2                 # 59.5 s: renewed at 56 s for one more period
    advance(4)
    assert alloc.free == 16                  # the limit: a prefill that never came back


def test_a_restarted_prefill_releases_its_fences(world):
    fences, alloc, dead, _ = world
    fences.add((1, 0), alloc.alloc(3), "p1")
    fences.add((2, 0), alloc.alloc(2), "p2")
    dead.add("p1")
    assert fences.release_prefill("p1") == 1 and fences.pages == 2
