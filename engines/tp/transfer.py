"""The KV transfer from a prefill of TP p into a decode of TP d, for any p and d.

Every rank's pool is [pages, layers, 2, page_size, its kv heads, head_dim]
(engines/kv/pool.py): one page of one rank is one contiguous chunk holding that rank's
heads, and every rank of a worker has the same page ids. A decode rank whose kv heads
are exactly one of our ranks' (equal TP sizes, or replicas of one range) is written
straight from that rank's pool, one write per run of pages. Any other destination
range (p > d, p < d, replication on one side only) is gathered first: the range's heads
of our pages are copied out of our ranks' pools into a staging buffer laid out as that
destination's pages, then written from there. So a mismatched transfer is as many
contiguous writes as a matched one, plus one local copy per source pool it reads.

Staging: one buffer per distinct destination head range, [our pool's pages, layers,
2, page_size, len(range), head_dim], made (and registered with the transport) the
first time that range is written, then kept. A page's slot is its page id here: a
page is held while a write of it may still read its slot, and two jobs sharing a
prefix page stage the same bytes, so no allocator is needed. A range that several
decode ranks hold (TP above the kv heads) is staged once and written to each.
Cost: the ranges a decode announces are disjoint (zpd/worker/peers.py refuses
others), so the staging of all decodes of one TP is at most our pool's pages x every
kv head (one more TP-1-sized pool), and none when their ranges match ours; each other
split of the heads (a decode of another TP) adds up to as much again.

This module imports neither transport nor zpd (engines import neither): a `PoolWrite`
says which page runs go where, and zpd/worker/writes.py makes the transport's runs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch


@dataclass(frozen=True)
class RankPool:
    """One rank's KV pool as a peer sees it: the model's kv heads it holds and the
    address of its page 0. A worker at TP 1 has one, of every kv head."""
    heads: range
    base_addr: int

    def announced(self) -> list[int]:
        """As a hello carries it: [head_start, head_stop, base_addr]."""
        return [self.heads.start, self.heads.stop, self.base_addr]


@dataclass(frozen=True, eq=False)
class LocalPool(RankPool):
    """One of this worker's ranks' pools, readable here: `buffer` is
    [pages, layers, 2, page_size, len(heads), head_dim] at `base_addr` (None, and
    address 0, while its memory is released)."""
    buffer: torch.Tensor | None = None


@dataclass(frozen=True)
class PoolWrite:
    """Our page k (at src_base + k * page_bytes) into the destination's page paired
    with it (at dst_base + j * page_bytes), for every pair of the transfer."""
    src_base: int
    dst_base: int
    page_bytes: int


def head_page_bytes(buffer: torch.Tensor) -> int:
    """Bytes of one kv head of one page (every layer, K and V) in a pool buffer."""
    _, layers, two, page_size, _, head_dim = buffer.shape
    return layers * two * page_size * head_dim * buffer.element_size()


def _segments(sources: Sequence[LocalPool], heads: range) -> Iterator[tuple[LocalPool, range]]:
    """`heads` cut into runs each held by one source pool (the first that holds it)."""
    h = heads.start
    while h < heads.stop:
        src = next((s for s in sources if h in s.heads), None)
        if src is None:
            raise ValueError(f"kv head {h} is in none of this worker's pools")
        stop = min(src.heads.stop, heads.stop)
        yield src, range(h, stop)
        h = stop


def _holding(sources: Sequence[LocalPool], heads: range, rank: int) -> int | None:
    """The address of a source pool of exactly `heads`: our rank of the same number if
    it is one (at equal TP sizes rank r writes rank r, replicas included), else the
    first; None if none is."""
    if rank < len(sources) and sources[rank].heads == heads:
        return sources[rank].base_addr
    return next((s.base_addr for s in sources if s.heads == heads), None)


class TransferPlanner:
    """One prefill's KV writes into decodes of any TP, staging the head ranges none of
    our pools holds as such. `register(addr, nbytes)` makes a new staging buffer a
    source of transfers (the transport backend's `register`)."""

    def __init__(self, register: Callable[[int, int], None]) -> None:
        self.register = register
        self.staging: dict[range, torch.Tensor] = {}       # destination heads -> buffer

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.staging.values())

    def plan(self, sources: Sequence[LocalPool], dests: Sequence[RankPool],
             ours: Sequence[int], theirs: Sequence[int]) -> list[PoolWrite]:
        """The writes that put our pages `ours` into the decode's pages `theirs` (pair
        by pair) in every destination pool, gathering into staging first where needed.
        A ValueError (or the register callback's error) names what cannot be done."""
        if len(ours) != len(theirs):
            raise ValueError(f"{len(ours)} pages of ours for {len(theirs)} of the decode's")
        head_bytes = head_page_bytes(sources[0].buffer)
        staged: dict[range, int] = {}              # gathered for this transfer: its base
        writes = []
        for rank, dest in enumerate(dests):
            base = _holding(sources, dest.heads, rank)
            if base is None:
                base = staged.get(dest.heads) or self._gather(sources, dest.heads, ours)
                staged[dest.heads] = base
            writes.append(PoolWrite(base, dest.base_addr, head_bytes * len(dest.heads)))
        return writes

    def _gather(self, sources: Sequence[LocalPool], heads: range, ours: Sequence[int]) -> int:
        """Copy the `heads` of our pages into their slots of the range's staging buffer."""
        stage = self._buffer(sources, heads)
        for src, part in _segments(sources, heads):
            idx = torch.tensor(list(ours), dtype=torch.long, device=src.buffer.device)
            a, b = part.start - src.heads.start, part.stop - src.heads.start
            rows = src.buffer[..., a:b, :].index_select(0, idx)   # [len(ours), L, 2, S, b-a, D]
            a, b = part.start - heads.start, part.stop - heads.start
            stage[..., a:b, :].index_copy_(0, idx.to(stage.device), rows.to(stage.device))
        if stage.device.type == "cuda":
            torch.cuda.synchronize(stage.device)      # copied before the transport reads it
        return stage.data_ptr()

    def _buffer(self, sources: Sequence[LocalPool], heads: range) -> torch.Tensor:
        """The range's staging buffer, made and registered the first time, on the device
        of the pool that holds its first head."""
        stage = self.staging.get(heads)
        if stage is None:
            first = next(src for src, _ in _segments(sources, heads))
            pages, layers, two, page_size, _, head_dim = first.buffer.shape
            stage = torch.zeros(pages, layers, two, page_size, len(heads), head_dim,
                                dtype=first.buffer.dtype, device=first.buffer.device)
            self.register(stage.data_ptr(), stage.numel() * stage.element_size())
            self.staging[heads] = stage
        return stage

    def release(self, unregister: Callable[[int], None]) -> None:
        """Drop every staging buffer (with our pool's memory released; the next
        mismatched write makes them again)."""
        for stage in self.staging.values():
            unregister(stage.data_ptr())
        self.staging.clear()
