"""--clear-freed-pages: a freed KV page holds nothing of the request that had it."""
from __future__ import annotations

import pytest
import torch

from engines.kv.layout import KVLayout
from engines.kv.pool import KVPool
from tests.unit.inproc import InprocCluster

LAYOUT = KVLayout(num_layers=2, page_size=4, num_kv_heads=2, head_dim=8, dtype="float32",
                  element_bytes=4)


@pytest.mark.parametrize("clear", [False, True])
def test_freed_pages_are_zeroed_only_when_asked(clear):
    pool = KVPool(LAYOUT, 10, torch.float32, torch.device("cpu"), clear_on_free=clear)
    pages = pool.allocator.alloc(6)
    pool.buffer[pages] = 1.0
    pool.allocator.free_pages([pages[0], pages[2], pages[3], pages[5]])
    freed, kept = pool.buffer[[pages[0], pages[2], pages[3], pages[5]]], pool.buffer[[pages[1], pages[4]]]
    assert bool((freed == 0).all()) is clear
    assert bool((kept == 1).all())                # pages still held are untouched


@pytest.mark.parametrize("clear", [False, True])
def test_no_kv_left_in_either_pool_after_a_request(clear):
    c = InprocCluster(clear_freed_pages=clear)
    try:
        rid = c.submit([5, 17, 99, 3, 42, 7, 250, 1, 64, 31, 8, 200, 13, 77, 150, 9, 21], 8)
        assert c.run(rid).finish["type"] == "length"
        c.check_pages()
        for core in (c.prefill, c.decode):
            empty = bool((core.pool.buffer == 0).all())
            assert empty is clear, core.cfg.role   # without the flag the KV stays readable
    finally:
        c.close()
