"""Unit tests for transport/: coalescing, the fake backend and the helper thread
(through FabricDriver). No Mooncake, no processes; every wait is bounded."""

from __future__ import annotations

import logging
import random
import threading
import time

import pytest

import transport
from transport.base import check_runs
from transport.fake import FabricDriver
from tests.unit.transport_bufs import PAGE, Buf, fake, readable, threaded, wait_for, wait_until


# ---- coalescing -------------------------------------------------------------

def test_coalesce_merges_only_pairs_consecutive_on_both_sides() -> None:
    runs = transport.coalesce_runs(1000, [0, 1, 2, 5, 6, 9], 5000, [3, 4, 5, 0, 2, 3], 10)
    assert runs == [(1000, 5030, 30), (1050, 5000, 10), (1060, 5020, 10), (1090, 5030, 10)]
    assert transport.coalesce_runs(0, [], 0, [], 10) == []
    with pytest.raises(transport.TransportError):
        transport.coalesce_runs(0, [1, 2], 0, [1], 10)


@pytest.mark.parametrize("seed", range(30))
def test_coalesced_runs_cover_exactly_the_per_page_mapping(seed: int) -> None:
    rng = random.Random(seed)
    n, page = rng.randrange(1, 200), rng.choice([1, 3, 64])
    src = list(range(400))
    rng.shuffle(src)
    src = sorted(src[:n]) if rng.random() < 0.5 else src[:n]
    dst, nxt = [], rng.randrange(400)
    for _ in range(n):  # mostly contiguous destination runs with random jumps
        nxt = nxt + 1 if rng.random() < 0.8 else rng.randrange(400)
        dst.append(nxt)
    runs = transport.coalesce_runs(10_000, src, 900_000, dst, page)
    expected = {10_000 + s * page + b: 900_000 + d * page + b
                for s, d in zip(src, dst) for b in range(page)}
    got = {}
    for s, d, nbytes in runs:
        for b in range(nbytes):
            assert s + b not in got, "a source byte is copied twice"
            got[s + b] = d + b
    assert got == expected
    for (s1, d1, n1), (s2, d2, _) in zip(runs, runs[1:]):
        assert not (s1 + n1 == s2 and d1 + n1 == d2), "two runs should have been merged"


def test_split_batches_and_run_checks() -> None:
    runs = [(i, i, 1) for i in range(2500)]
    assert [len(b) for b in transport.split_batches(runs)] == [1024, 1024, 452]
    assert transport.split_batches([]) == []
    assert check_runs([(1, 2, 0), (1, 2, 3)]) == [(1, 2, 3)]
    with pytest.raises(transport.TransportError):
        check_runs([(1, 2, -3)])


# ---- fake backend -----------------------------------------------------------

@pytest.fixture
def pair() -> tuple[transport.FakeFabric, Buf, Buf]:
    return transport.FakeFabric(), Buf(64 * PAGE, seed=1), Buf(64 * PAGE)


def test_fake_backend_copies_scattered_pages(pair) -> None:
    fabric, src, dst = pair
    a, b = fake(fabric, src), fake(fabric, dst)
    src_pages, dst_pages = [3, 4, 5, 10, 11, 40], [7, 8, 9, 0, 63, 1]
    a.write(1, b.session_id, transport.coalesce_runs(src.addr, src_pages, dst.addr, dst_pages, PAGE))
    [c] = wait_for(a)
    assert (c.transfer_id, c.ok, c.reason, c.nbytes) == (1, True, "", 6 * PAGE)
    for s, d in zip(src_pages, dst_pages):
        assert dst.page(d) == src.page(s)
    assert dst.page(2) == bytes(PAGE)


def test_fake_out_of_range_write_fails_and_later_writes_work(pair) -> None:
    fabric, src, dst = pair
    a, b = fake(fabric, src), fake(fabric, dst)
    a.write(1, b.session_id, [(src.addr, dst.addr + 63 * PAGE + 1, PAGE)])  # runs past the end
    a.write(2, b.session_id, [(src.addr + 64 * PAGE, dst.addr, 1)])        # unregistered source
    a.write(3, "fake:nobody", [(src.addr, dst.addr, PAGE)])                 # unknown peer
    failed = {c.transfer_id: c for c in wait_for(a, 3)}
    assert not any(c.ok for c in failed.values())
    assert "outside" in failed[1].reason and "source" in failed[2].reason
    assert dst.raw.raw == bytes(len(dst.raw))
    a.write(4, b.session_id, [(src.addr, dst.addr, PAGE)])
    assert wait_for(a)[0].ok and dst.page(0) == src.page(0)


def test_fake_completes_after_n_polls(pair) -> None:
    fabric, src, dst = pair
    a, b = fake(fabric, src, complete_after_polls=3), fake(fabric, dst)
    assert not readable(a)
    a.write(1, b.session_id, [(src.addr, dst.addr, PAGE)])
    for _ in range(3):
        assert readable(a), "the fd must keep the scheduler polling"
        assert a.poll_completions() == [] and dst.page(0) == bytes(PAGE)
    [c] = a.poll_completions()
    assert c.ok and dst.page(0) == src.page(0)
    assert not readable(a)


def test_fake_cancel_and_close(pair) -> None:
    fabric, src, dst = pair
    a, b = fake(fabric, src, complete_after_polls=1), fake(fabric, dst)
    a.write(1, b.session_id, [(src.addr, dst.addr, PAGE)])
    a.write(2, b.session_id, [(src.addr, dst.addr + PAGE, PAGE)])
    a.cancel(1)
    a.cancel(99)  # unknown ids are ignored
    assert a.poll_completions() == [transport.Completion(1, False, "cancelled", PAGE, pytest.approx(0, abs=1))]
    a.close()
    a.write(3, b.session_id, [(src.addr, dst.addr, PAGE)])
    assert [(c.transfer_id, c.ok, c.reason) for c in a.poll_completions()] == \
        [(2, False, "closed"), (3, False, "closed")]
    assert dst.raw.raw == bytes(len(dst.raw))


def test_fake_rejects_duplicate_ids_and_missing_fabric(pair) -> None:
    fabric, src, dst = pair
    a, b = fake(fabric, src, complete_after_polls=5), fake(fabric, dst)
    a.write(1, b.session_id, [(src.addr, dst.addr, PAGE)])
    with pytest.raises(transport.TransportError):
        a.write(1, b.session_id, [(src.addr, dst.addr, PAGE)])
    with pytest.raises(transport.TransportError, match="fabric"):
        transport.create_backend("fake")
    with pytest.raises(transport.TransportError, match="unknown transport backend"):
        transport.create_backend("carrier-pigeon")


# ---- helper thread (ThreadedBackend over FabricDriver) ------------------------

def scattered(src: Buf, dst: Buf, n: int) -> list[transport.Run]:
    """n one-byte runs that cannot be coalesced (destination goes backwards)."""
    return [(src.addr + i, dst.addr + n - 1 - i, 1) for i in range(n)]


def test_threaded_batches_stay_within_the_entry_limit() -> None:
    fabric, src, dst = transport.FakeFabric(), Buf(3000, seed=2), Buf(3000)
    a, driver = threaded(fabric, src)
    b, _ = threaded(fabric, dst)
    a.write(1, b.session_id, scattered(src, dst, 2000))
    a.write(2, b.session_id, [(src.addr + 2000 + i, dst.addr + 2000 + i * 2 % 1000, 1) for i in range(500)])
    done = wait_for(a, 2)
    assert all(c.ok for c in done), done
    assert driver.submitted == 2500
    assert driver.max_in_flight <= transport.MAX_BATCH_ENTRIES
    assert dst.raw.raw[:2000] == src.raw.raw[:2000][::-1]
    a.close(), b.close()


def test_threaded_cancel_skips_batches_not_yet_submitted() -> None:
    fabric, src, dst = transport.FakeFabric(), Buf(3000, seed=3), Buf(3000)
    a, driver = threaded(fabric, src)
    b, _ = threaded(fabric, dst)
    driver.gate.clear()
    a.write(1, b.session_id, scattered(src, dst, 3000))
    wait_until(lambda: driver.submitted >= transport.MAX_BATCH_ENTRIES)
    a.cancel(1)
    driver.gate.set()
    [c] = wait_for(a)
    assert (c.ok, c.reason) == (False, "cancelled")
    assert driver.submitted == transport.MAX_BATCH_ENTRIES  # the in-flight batch finished
    assert dst.raw.raw[-1024:] == src.raw.raw[:1024][::-1] and dst.raw.raw[:1000] == bytes(1000)
    a.close(), b.close()


def test_threaded_close_fails_every_pending_transfer() -> None:
    fabric, src, dst = transport.FakeFabric(), Buf(100, seed=4), Buf(100)
    a, driver = threaded(fabric, src)
    b, _ = threaded(fabric, dst)
    driver.gate.clear()
    for tid in range(5):
        a.write(tid, b.session_id, [(src.addr + tid, dst.addr + tid, 1)])
    wait_until(lambda: driver.submitted == 5)
    a.close()
    a.write(9, b.session_id, [(src.addr, dst.addr, 1)])
    done = wait_for(a, 6)
    assert sorted(c.transfer_id for c in done) == [0, 1, 2, 3, 4, 9]
    assert all(not c.ok and c.reason == "closed" for c in done)
    assert driver.closed_with_outstanding == 5  # in flight, never seen to finish
    with pytest.raises(transport.TransportError):
        a.register(src.addr, 1)
    b.close()


class Fatal(BaseException):
    """Not an Exception: what a helper thread cannot survive (a failed run is an Exception
    and fails only its transfer, see below)."""


class DyingDriver(FabricDriver):
    """Submits after `release` is set, then blows up on the first check."""

    def __init__(self, fabric: transport.FakeFabric) -> None:
        super().__init__(fabric)
        self.release = threading.Event()

    def submit(self, peer: str, run: transport.Run) -> object | None:
        assert self.release.wait(5)
        return super().submit(peer, run)

    def check(self, handle: object) -> int:
        raise Fatal("driver exploded")


def test_helper_thread_death_fails_pending_and_later_writes(caplog) -> None:
    fabric, src, dst = transport.FakeFabric(), Buf(100), Buf(100)
    a, driver = threaded(fabric, src, DyingDriver(fabric))
    b, _ = threaded(fabric, dst)
    with caplog.at_level(logging.ERROR, logger="transport"):
        for tid in range(3):  # one in flight, two queued behind it
            a.write(tid, b.session_id, [(src.addr, dst.addr, 1)])
        driver.release.set()
        done = wait_for(a, 3)
    assert sorted(c.transfer_id for c in done) == [0, 1, 2]
    assert all(not c.ok and "driver exploded" in c.reason for c in done)
    assert any("helper thread died" in r.getMessage() for r in caplog.records)
    a.write(7, b.session_id, [(src.addr, dst.addr, 1)])
    [late] = wait_for(a)
    assert (late.transfer_id, late.ok) == (7, False) and "died" in late.reason
    a.close(), b.close()


class RaisingDriver(FabricDriver):
    """Raises on submitting (or checking) the runs that go to one destination address,
    as pybind does for an address past 2**64."""

    def __init__(self, fabric: transport.FakeFabric, bad_dst: int, on: str) -> None:
        super().__init__(fabric)
        self.bad_dst, self.on = bad_dst, on

    def submit(self, peer: str, run: transport.Run) -> object | None:
        if self.on == "submit" and run[1] == self.bad_dst:
            raise TypeError("transfer_submit_write(): incompatible function arguments")
        return super().submit(peer, run)

    def check(self, handle: object) -> int:
        if self.on == "check" and handle.run[1] == self.bad_dst:
            raise OverflowError("int too big to convert")
        return super().check(handle)


@pytest.mark.parametrize("on", ["submit", "check"])
def test_a_run_that_raises_fails_its_transfer_not_the_helper_thread(on) -> None:
    fabric, src, dst = transport.FakeFabric(), Buf(100, seed=3), Buf(100)
    a, _ = threaded(fabric, src, RaisingDriver(fabric, dst.addr + 50, on))
    b, _ = threaded(fabric, dst)
    a.write(1, b.session_id, [(src.addr, dst.addr + 50, 10), (src.addr + 20, dst.addr + 20, 5)])
    [bad] = wait_for(a)
    assert (bad.transfer_id, bad.ok) == (1, False)
    assert ("incompatible" if on == "submit" else "too big") in bad.reason
    a.write(2, b.session_id, [(src.addr, dst.addr, 10)])
    [good] = wait_for(a)
    assert (good.transfer_id, good.ok) == (2, True) and dst.raw.raw[:10] == src.raw.raw[:10]
    assert a._thread.is_alive()
    a.close(), b.close()


def test_threaded_deadline_fails_a_stuck_transfer_and_the_peer_recovers() -> None:
    fabric, src, dst = transport.FakeFabric(), Buf(100, seed=5), Buf(100)
    a, driver = threaded(fabric, src, timeout_s=0.2)
    b, _ = threaded(fabric, dst)
    driver.gate.clear()
    started = time.monotonic()
    a.write(1, b.session_id, [(src.addr, dst.addr, 10)])
    [c] = wait_for(a)
    assert not c.ok and "timeout" in c.reason and 0.2 <= time.monotonic() - started < 2
    driver.gate.set()
    a.write(2, b.session_id, [(src.addr, dst.addr, 10)])
    assert wait_for(a)[0].ok and dst.raw.raw[:10] == src.raw.raw[:10]
    a.close(), b.close()


def test_threaded_refused_submit_and_empty_write() -> None:
    fabric, src, dst = transport.FakeFabric(), Buf(100), Buf(100)
    driver = FabricDriver(fabric)
    driver.submit = lambda peer, run: None  # type: ignore[method-assign]
    a, _ = threaded(fabric, src, driver)
    b, _ = threaded(fabric, dst)                  # a peer that answers: only the submit refuses
    a.write(1, b.session_id, [(src.addr, dst.addr, 1)])
    a.write(2, "anyone", [])
    done = {c.transfer_id: c for c in wait_for(a, 2)}
    assert not done[1].ok and "refused" in done[1].reason
    assert done[2].ok and done[2].nbytes == 0
    a.close()
    b.close()
