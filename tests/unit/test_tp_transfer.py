"""KV transfer between a prefill of TP p and a decode of TP d (engines/tp/transfer.py),
on the fake transport: real bytes copied between registered pools. Every pair of
sizes over 4 kv heads, and over 2 with replication (TP 4 over 2 heads on either side);
random page ids on both sides. After the writes every decode rank's pages hold exactly
its heads of the whole KV, and nothing else moved."""
from __future__ import annotations

import dataclasses
import itertools
import random
import re
from typing import Callable

import pytest
import torch

import transport
from engines.kv.layout import KVLayout
from engines.tp.transfer import LocalPool, RankPool, TransferPlanner
from zpd.wire.protocol import Hello
from zpd.worker.compat import compat_hash
from zpd.worker.peers import model_layout, pool_problem
from zpd.worker.writes import transfer_runs

PAGES, LAYERS, PAGE_SIZE, HEAD_DIM = 12, 2, 4, 3
HEAD_PAGE_BYTES = LAYERS * 2 * PAGE_SIZE * HEAD_DIM * 8          # float64


def rank_heads(kv: int, size: int, rank: int) -> range:
    """engines/tp/plan.py's split: equal runs, or each head on size/kv ranks."""
    if kv >= size:
        n = kv // size
        return range(rank * n, (rank + 1) * n)
    h = rank // (size // kv)
    return range(h, h + 1)


def pools(kv: int, size: int, backend: transport.Backend) -> list[LocalPool]:
    """`size` ranks' zeroed pools of `kv` heads, registered with `backend`."""
    out = []
    for r in range(size):
        heads = rank_heads(kv, size, r)
        buf = torch.zeros(PAGES, LAYERS, 2, PAGE_SIZE, len(heads), HEAD_DIM, dtype=torch.float64)
        backend.register(buf.data_ptr(), buf.numel() * buf.element_size())
        out.append(LocalPool(heads, buf.data_ptr(), buf))
    return out


def first_poll(backend: transport.Backend) -> transport.Completion:
    """A fake backend's completion: its first poll after the write has it."""
    [done] = backend.poll_completions()
    return done


class Pair:
    """A prefill of TP p and a decode of TP d on one fake fabric, and the whole KV of
    a request of `n` pages: whole[i] is the request's page i, every kv head."""

    def __init__(self, kv: int, p: int, d: int, seed: int,
                 backends: tuple[transport.Backend, transport.Backend] | None = None,
                 wait: Callable[[transport.Backend], transport.Completion] = first_poll) -> None:
        """`backends`: the prefill's and the decode's (two fakes on one fabric unless
        given); `wait` returns a write's completion."""
        if backends is None:
            fabric = transport.FakeFabric()
            backends = transport.FakeBackend(fabric), transport.FakeBackend(fabric)
        self.prefill, self.decode = backends
        self.wait = wait
        self.sources, self.dests = pools(kv, p, self.prefill), pools(kv, d, self.decode)
        self.registered: list[tuple[int, int]] = []
        self.planner = TransferPlanner(self._register)
        self.rng = random.Random(seed)
        self.ids = itertools.count(1)
        self.kv = kv

    def _register(self, addr: int, nbytes: int) -> None:
        self.registered.append((addr, nbytes))
        self.prefill.register(addr, nbytes)

    def pages(self, n: int) -> tuple[list[int], list[int]]:
        """Random distinct page ids on each side; some runs of consecutive ones."""
        def side(run: list[int]) -> list[int]:
            rest = self.rng.sample([q for q in range(PAGES) if q not in run], n - len(run))
            return rest[:1] + run + rest[1:]
        return side([5, 6]), side([2, 3])             # pages 5, 6 -> 2, 3: one run

    def fill(self, ours: list[int]) -> torch.Tensor:
        """Random KV of len(ours) pages, written into our pages of every source pool."""
        whole = torch.randn(len(ours), LAYERS, 2, PAGE_SIZE, self.kv, HEAD_DIM, dtype=torch.float64)
        for src in self.sources:
            src.buffer[ours] = whole[..., src.heads.start:src.heads.stop, :]
        return whole

    def send(self, ours: list[int], theirs: list[int]) -> list[transport.Run]:
        runs = transfer_runs(self.planner.plan(self.sources, self.dests, ours, theirs), ours, theirs)
        self.prefill.write(next(self.ids), self.decode.session_id, runs)
        done = self.wait(self.prefill)
        assert done.ok, done.reason
        return runs

    def check_landed(self, whole: torch.Tensor, theirs: list[int]) -> None:
        for dst in self.dests:
            assert torch.equal(dst.buffer[theirs], whole[..., dst.heads.start:dst.heads.stop, :])
            others = [q for q in range(PAGES) if q not in theirs]
            assert not dst.buffer[others].any()                # no other page touched


SIZES = [(kv, p, d) for kv in (4, 2) for p in (1, 2, 4) for d in (1, 2, 4)]


@pytest.mark.parametrize("kv,p,d", SIZES, ids=[f"kv{kv}-p{p}-d{d}" for kv, p, d in SIZES])
def test_every_decode_rank_gets_exactly_its_heads(kv, p, d):
    pair = Pair(kv, p, d, seed=kv * 100 + p * 10 + d)
    ours, theirs = pair.pages(7)
    whole = pair.fill(ours)
    runs = pair.send(ours, theirs)
    pair.check_landed(whole, theirs)
    # as many writes as a matched transfer: one per run of pages, per decode rank
    per_rank = len(transport.coalesce_runs(0, ours, 0, theirs, 1))
    assert per_rank < len(ours) and len(runs) == d * per_rank
    # staged: each distinct decode range that no prefill rank holds as such, once
    ours_ranges = {s.heads for s in pair.sources}
    staged = {dst.heads for dst in pair.dests} - ours_ranges
    assert set(pair.planner.staging) == staged and len(pair.registered) == len(staged)
    assert pair.planner.nbytes <= PAGES * kv * HEAD_PAGE_BYTES


@pytest.mark.parametrize("kv,size", [(4, 1), (4, 2), (4, 4), (2, 4)])
def test_matched_sizes_write_straight_from_our_pools(kv, size):
    pair = Pair(kv, size, size, seed=size)
    ours, theirs = [0, 1, 2, 9, 4], [7, 8, 9, 3, 11]
    pair.fill(ours)
    got = pair.send(ours, theirs)
    assert got == [run for s, t in zip(pair.sources, pair.dests)
                   for run in transport.coalesce_runs(s.base_addr, ours, t.base_addr, theirs,
                                                      HEAD_PAGE_BYTES * len(s.heads))]
    assert len(got) == 3 * size and not pair.planner.staging and not pair.registered


def test_staging_is_made_once_and_reused_by_later_transfers():
    pair = Pair(4, 1, 2, seed=5)
    for _ in range(3):
        ours, theirs = pair.pages(4)
        whole = pair.fill(ours)
        for dst in pair.dests:
            dst.buffer.zero_()
        pair.send(ours, theirs)
        pair.check_landed(whole, theirs)
    assert len(pair.registered) == 2 and pair.planner.nbytes == PAGES * 4 * HEAD_PAGE_BYTES
    unregistered = []
    pair.planner.release(unregistered.append)
    assert sorted(unregistered) == sorted(a for a, _ in pair.registered) and not pair.planner.staging


def test_replicated_decode_heads_are_staged_once_and_written_to_each_replica():
    pair = Pair(2, 1, 4, seed=9)                       # decode ranks hold heads 0, 0, 1, 1
    ours, theirs = pair.pages(5)
    whole = pair.fill(ours)
    pair.send(ours, theirs)
    pair.check_landed(whole, theirs)
    assert set(pair.planner.staging) == {range(0, 1), range(1, 2)}


def test_a_head_none_of_our_pools_holds_is_refused():
    pair = Pair(4, 2, 2, seed=1)
    with pytest.raises(ValueError, match="kv head 4"):
        pair.planner.plan(pair.sources, [RankPool(range(3, 5), 64)], [0], [0])
    with pytest.raises(ValueError, match="pages"):
        pair.planner.plan(pair.sources, pair.dests[:1], [0, 1], [0])


def test_a_failed_registration_keeps_no_staging():
    def refuse(addr: int, nbytes: int) -> None:
        raise transport.TransportError("no more memory regions")
    pair = Pair(4, 1, 2, seed=2)
    pair.planner = TransferPlanner(refuse)
    with pytest.raises(transport.TransportError):
        pair.planner.plan(pair.sources, pair.dests, [0], [0])
    assert not pair.planner.staging


# --- what a hello announces ----------------------------------------------------------

LAYOUT = KVLayout(LAYERS, PAGE_SIZE, 4, HEAD_DIM, "float64", 8)


def hello(announced: list[list[int]]) -> Hello:
    return Hello("inproc://d", LAYOUT, "h", "fake:9", announced, PAGES, "v")


@pytest.mark.parametrize("d", [1, 2, 4, 8])
def test_every_tp_split_is_an_acceptable_announcement(d):
    announced = [[h.start, h.stop, 4096 * (r + 1) << 20] for r, h in
                 ((r, rank_heads(4, d, r)) for r in range(d))]
    assert pool_problem(hello(announced), LAYOUT, "fake:1") == ""


@pytest.mark.parametrize("announced,reason", [
    ([[0, 2, 1 << 30]], r"kv heads \[2, 4\) are in no pool"),
    ([[0, 2, 1 << 30], [3, 4, 2 << 30]], r"kv heads \[2, 3\) are in no pool"),
    ([[0, 3, 1 << 30], [2, 4, 2 << 30]], r"overlap at \[2, 3\)"),
    ([[0, 5, 1 << 30]], r"holds kv heads \[0, 5\) of the model's 4"),
    ([[2, 2, 1 << 30], [0, 4, 2 << 30]], r"pool 0 holds kv heads \[2, 2\)"),
    ([[0, 4, 2**64 - PAGES * 4 * HEAD_PAGE_BYTES]], "not a valid address range"),
    ([[0, 2, 1 << 30], [2, 4, 2**64 - PAGES * 2 * HEAD_PAGE_BYTES]], "not a valid address range"),
    ([[0, 4]], "pool 0 has 2 numbers"),
    ([], "0 pools announced"),
])
def test_impossible_pools_are_named(announced, reason):
    assert re.search(reason, pool_problem(hello(announced), LAYOUT, "fake:1"))


def test_the_model_layout_counts_every_rank_heads():
    part = dataclasses.replace(LAYOUT, num_kv_heads=1)
    ranks = [RankPool(rank_heads(4, 4, r), 1) for r in range(4)]
    assert model_layout(part, ranks) == LAYOUT


def test_compat_hash_names_every_kv_head_whatever_the_tp():
    """A rank's model and layout hold part of the heads; given the whole model's config
    the hash is the one a TP 1 worker computes."""
    from engines.models.tiny import TINY_CONFIG
    from engines.config import ModelConfig
    whole = ModelConfig.from_dict(TINY_CONFIG)
    part = dataclasses.replace(whole, num_heads=1, num_kv_heads=1, intermediate_size=32)
    model = type("Model", (), {"cfg": whole, "tokenizer": None, "chat": None})()
    rank = type("Model", (), {"cfg": part, "tokenizer": None, "chat": None})()
    layout = KVLayout.for_model(whole, PAGE_SIZE, torch.float64)
    rank_layout = KVLayout.for_model(part, PAGE_SIZE, torch.float64)
    assert compat_hash(rank, rank_layout, whole) == compat_hash(model, layout)
    assert compat_hash(rank, rank_layout) != compat_hash(model, layout)
