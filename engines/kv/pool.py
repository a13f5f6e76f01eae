"""The KV pool: one contiguous buffer per worker, registered with the transfer engine once."""
from __future__ import annotations

import torch

from engines.kv.allocator import PageAllocator, page_runs
from engines.kv.layout import KVLayout
from engines.kv.paged import PagedKV

DEFAULT_PAGE_SIZE = 16


class KVPool:
    """Buffer [pages, layers, 2, page_size, kv_heads, head_dim] plus its page allocator."""

    def __init__(self, layout: KVLayout, num_pages: int, dtype: torch.dtype,
                 device: torch.device, clear_on_free: bool = False,
                 buffer: torch.Tensor | None = None) -> None:
        """`clear_on_free`: zero every page as it is freed, so a page handed to the next
        request (or read by a foreign transfer engine, which Mooncake does not stop)
        holds nothing of the last one's KV. `buffer`: memory of `shape` to hold it in
        (shared with another process) instead of a new one."""
        self.layout, self.num_pages, self.dtype, self.device = layout, num_pages, dtype, device
        self.allocator = PageAllocator(num_pages, self.clear_pages if clear_on_free else None)
        self.buffer: torch.Tensor | None = None
        self.kv: PagedKV | None = None
        self.allocate_memory(buffer)

    @classmethod
    def with_budget(cls, layout: KVLayout, megabytes: float, dtype: torch.dtype,
                    device: torch.device, clear_on_free: bool = False) -> "KVPool":
        pages = int(megabytes * 2**20 // layout.page_bytes)
        if pages < 1:
            raise ValueError(f"{megabytes} MB holds no page of {layout.page_bytes} bytes")
        return cls(layout, pages, dtype, device, clear_on_free)

    def clear_pages(self, pages: list[int]) -> None:
        """Zero `pages` (each contiguous run in one call)."""
        if self.buffer is None:
            return                                   # released: nothing left to read
        for start, length in page_runs(sorted(pages)):
            self.buffer[start:start + length].zero_()
        self.synchronize()          # zeroed before the page is handed out and written again

    def synchronize(self) -> None:
        """Wait for queued GPU work on the pool (kernels are asynchronous; a transfer
        engine reading or writing pages does not wait for them). Nothing to do on CPU."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.layout.pool_shape(self.num_pages)

    def allocate_memory(self, buffer: torch.Tensor | None = None) -> None:
        """A zeroed buffer, or `buffer` (of `shape`: memory another process shares)."""
        if buffer is None:
            buffer = torch.zeros(self.shape, dtype=self.dtype, device=self.device)
        self.buffer = buffer
        self.kv = PagedKV(self.buffer)

    def release_memory(self) -> None:
        """Drop the buffer (the caller has checked no page is in use)."""
        self.buffer, self.kv = None, None

    @property
    def data_ptr(self) -> int:
        return self.buffer.data_ptr()

    @property
    def nbytes(self) -> int:
        return self.num_pages * self.layout.page_bytes

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.layout.page_size)
