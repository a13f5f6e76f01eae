"""Batched forward passes through page tables: prefill of whole prompts, decode steps."""
from __future__ import annotations

import torch

from engines.attention import DecodeGroup, DecodeMeta, LastTokens, PrefillMeta, group_by_length
from engines.kv.pool import KVPool
from engines.loader import LoadedModel
from engines.cpu.kernels import kernel_for


class ModelRunner:
    """Runs one model against one KV pool. Inputs are plain lists; outputs are logits of
    the last position of each sequence, [B, vocab], in the model's dtype."""

    def __init__(self, model: LoadedModel, pool: KVPool) -> None:
        self.model, self.pool, self.device = model, pool, model.device
        L = pool.layout
        self.page_size, self.kv_heads = L.page_size, L.num_kv_heads
        self.page_stride = L.num_layers * 2 * L.page_size     # pool rows per page
        self.kernel = kernel_for(pool.dtype, pool.device.type)   # None: torch's attention

    def _rows(self, page_table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        pages = page_table[positions // self.page_size]
        return pages * self.page_stride + positions % self.page_size

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def prefill(self, prompts: list[list[int]], page_tables: list[list[int]],
                starts: list[int] | None = None) -> torch.Tensor:
        """Compute and store the KV of each prompt from position starts[i] on (the KV
        before it is in its pages already: a cached prefix); logits of each prompt's
        last token."""
        starts = starts or [0] * len(prompts)
        lens = [len(p) - s for p, s in zip(prompts, starts)]
        if min(lens) < 1:      # its last token would be another prompt's (the cache leaves one)
            raise ValueError(f"a prefill computes at least one token of each prompt: {lens}")
        tables = [self._tensor(pt) for pt in page_tables]
        positions = [torch.arange(s, len(p), device=self.device) for p, s in zip(prompts, starts)]
        rows = torch.cat([self._rows(t, pos) for t, pos in zip(tables, positions)])
        meta = PrefillMeta(lens, rows)
        if any(starts):
            meta.starts = starts
            meta.context_rows = [self._rows(t, torch.arange(s, device=self.device)) if s else None
                                 for t, s in zip(tables, starts)]
        ids = self._tensor([t for p, s in zip(prompts, starts) for t in p[s:]])
        last = torch.cumsum(self._tensor(lens), 0) - 1
        ends = [len(p) - 1 for p in prompts]
        meta.last = LastTokens(last, self._decode_meta(rows[last], ends, page_tables))
        hidden = self.model.net(ids, torch.cat(positions), self.pool.kv, meta)   # [B, hidden]
        return self.model.net.logits(hidden)

    def decode(self, tokens: list[int], positions: list[int],
               page_tables: list[list[int]]) -> torch.Tensor:
        """Feed token i at position i of its sequence; it attends to positions 0..pos."""
        pos = self._tensor(positions)
        own = self._tensor([pt[p // self.page_size] for pt, p in zip(page_tables, positions)])
        meta = self._decode_meta(own * self.page_stride + pos % self.page_size, positions, page_tables)
        hidden = self.model.net(self._tensor(tokens), pos, self.pool.kv, meta)
        return self.model.net.logits(hidden)

    def _decode_meta(self, write_rows: torch.Tensor, positions: list[int],
                     page_tables: list[list[int]]) -> DecodeMeta:
        """Batch row i at positions[i] of its sequence, attending to positions 0..positions[i]."""
        if self.kernel is not None:
            everyone = list(range(len(positions)))
            return DecodeMeta(write_rows, [], self.kernel, self._read_rows(everyone, positions, page_tables),
                              self._tensor(positions) + 1)
        groups = group_by_length(positions)
        whole = len(groups) == 1
        if whole:                                  # one group: the batch's own row order
            groups = [list(range(len(positions)))]
        return DecodeMeta(write_rows, [self._group(rows, positions, page_tables, whole) for rows in groups])

    def _read_rows(self, rows: list[int], positions: list[int],
                   page_tables: list[list[int]]) -> torch.Tensor:
        """[b, S]: the layer-0 K pool row of each position 0..S-1 of batch rows `rows`, S
        the longest context; a shorter one is padded with rows of its first page."""
        span = max(positions[i] for i in rows) + 1
        width = -(-span // self.page_size)
        table = self._tensor([page_tables[i][:width] + [page_tables[i][0]] * (width - len(page_tables[i][:width]))
                              for i in rows])
        steps = torch.arange(span, device=self.device)
        return table[:, steps // self.page_size] * self.page_stride + steps % self.page_size

    def _group(self, rows: list[int], positions: list[int], page_tables: list[list[int]],
               whole: bool) -> DecodeGroup:
        """Read rows and mask of batch rows `rows`, padded to the longest of them."""
        read_rows = self._read_rows(rows, positions, page_tables)       # [b, S]
        span = read_rows.shape[1]
        steps = torch.arange(span, device=self.device)
        heads = torch.arange(self.kv_heads, device=self.device)
        padded = any(positions[i] + 1 < span for i in rows)
        pos = self._tensor([positions[i] for i in rows]) if padded else None
        return DecodeGroup(
            members=None if whole else self._tensor(rows),
            read_index=read_rows[:, None, :] * self.kv_heads + heads[None, :, None],  # [b, Hkv, S]
            padding=(steps[None, :] > pos[:, None])[:, None, None, :] if padded else None)  # [b, 1, 1, S]
