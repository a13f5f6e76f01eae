"""The paged KV pool seen as rows, and page tables turned into pool rows.

The pool is page-major, [pages, layers, 2 (K/V), page_size, kv_heads, head_dim], so one
page of every layer is one contiguous chunk for the transfer engine. Attention sees it
as flat rows of [kv_heads, head_dim]: row(page, layer, kv, offset) =
((page * layers + layer) * 2 + kv) * page_size + offset. Batches name rows of layer 0's
K; each layer's K and V are views starting at their own offset.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


class PagedKV:
    """Row views of the pool and per-layer offsets into them."""

    def __init__(self, buffer: torch.Tensor) -> None:
        _, self.num_layers, _, self.page_size, self.kv_heads, self.head_dim = buffer.shape
        self.rows = buffer.view(-1, self.kv_heads, self.head_dim)     # [R, kv_heads, head_dim]
        self.elems = buffer.view(-1, self.head_dim)                   # [R * kv_heads, head_dim]
        # views starting at each (layer, K/V), so layer-0 rows index them without an
        # addition per layer and step
        self._rows = [[self.rows[self.offset(i, kv):] for kv in (0, 1)] for i in range(self.num_layers)]
        self._elems = [[self.elems[self.offset(i, kv) * self.kv_heads:] for kv in (0, 1)]
                       for i in range(self.num_layers)]

    def offset(self, layer: int, kv: int) -> int:
        return (layer * 2 + kv) * self.page_size

    def write(self, layer: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        k_rows, v_rows = self._rows[layer]
        k_rows.index_copy_(0, rows, k)
        v_rows.index_copy_(0, rows, v)

    def layer_rows(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V rows of `layer`, indexed by layer-0 K rows: [R', kv_heads, head_dim] each."""
        k_rows, v_rows = self._rows[layer]
        return k_rows, v_rows

    def read(self, layer: int, kv: int, rows: torch.Tensor) -> torch.Tensor:
        """K (kv=0) or V of layer-0 pool rows `rows`: [len(rows), kv_heads, head_dim]."""
        return self._rows[layer][kv].index_select(0, rows)

    def gather(self, layer: int, kv: int, index: torch.Tensor) -> torch.Tensor:
        flat = self._elems[layer][kv].index_select(0, index.view(-1))
        return flat.view(*index.shape, self.head_dim)                 # [B, kv_heads, S, head_dim]


@dataclass(frozen=True)
class PageRows:
    """Page tables -> layer-0 K pool rows, on the pool's device."""
    page_size: int
    page_stride: int              # pool rows per page: layers * 2 * page_size
    kv_heads: int
    device: torch.device

    def tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def rows(self, page_table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The row of each position of a sequence whose pages are `page_table`."""
        pages = page_table[positions // self.page_size]
        return pages * self.page_stride + positions % self.page_size

    def read_rows(self, rows: list[int], positions: list[int],
                  page_tables: list[list[int]]) -> torch.Tensor:
        """[b, S]: the row of each position 0..S-1 of batch rows `rows`, S the longest
        context; a shorter one is padded with rows of its first page."""
        span = max(positions[i] for i in rows) + 1
        width = -(-span // self.page_size)
        table = self.tensor([page_tables[i][:width] + [page_tables[i][0]] * (width - len(page_tables[i][:width]))
                             for i in rows])
        steps = torch.arange(span, device=self.device)
        return table[:, steps // self.page_size] * self.page_stride + steps % self.page_size
