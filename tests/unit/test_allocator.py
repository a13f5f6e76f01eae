"""Page allocator: invariant under random alloc/free, contiguity preference, pool-full signal."""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engines.kv.allocator import PageAllocator, PoolFull


@settings(max_examples=200, deadline=None)
@given(total=st.integers(1, 200), ops=st.lists(st.tuples(st.booleans(), st.integers(0, 40)), max_size=80),
       seed=st.integers(0, 2**32))
def test_invariant_after_random_alloc_free(total, ops, seed):
    rng, a, held = random.Random(seed), PageAllocator(total), []
    for is_alloc, n in ops:
        if is_alloc:
            if n > a.free:
                with pytest.raises(PoolFull):
                    a.alloc(n)
            else:
                pages = a.alloc(n)
                assert len(pages) == n == len(set(pages))
                assert not set(pages) & {p for h in held for p in h}
                held.append(pages)
        elif held:
            a.free_pages(held.pop(rng.randrange(len(held))))
        a.check()
        assert a.free + sum(map(len, held)) == total
    for h in held:
        a.free_pages(h)
    a.check()
    assert a.free == total and a._starts == [0]


def test_prefers_one_contiguous_run():
    a = PageAllocator(100)
    a.alloc(10)
    second = a.alloc(5)
    a.alloc(20)
    a.free_pages(second)                          # a 5-page hole between two allocations
    pages = a.alloc(4)
    assert pages == list(range(10, 14))           # best fit takes the hole, contiguous
    big = a.alloc(30)
    assert big == list(range(big[0], big[0] + 30))


def test_splits_only_when_no_run_fits():
    a = PageAllocator(10)
    x, y = a.alloc(5), a.alloc(5)
    a.free_pages(x[:2])
    a.free_pages(y[:2])
    assert sorted(a.alloc(4)) == [0, 1, 5, 6]


def test_double_free_and_foreign_pages_are_errors():
    a = PageAllocator(8)
    pages = a.alloc(3)
    a.free_pages(pages)
    with pytest.raises(ValueError):
        a.free_pages(pages)
    with pytest.raises(ValueError):
        a.free_pages([7])
    a.check()
    assert a.free == 8
