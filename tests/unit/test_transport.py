"""Unit tests for transport/: coalescing, the fake backend, the helper thread
(through FabricDriver), the fault wrapper and plan parsing. No Mooncake, no
processes; every wait is bounded."""

from __future__ import annotations

import ctypes
import importlib
import logging
import random
import select
import sys
import threading
import time

import pytest

import transport
from transport.base import check_runs
from transport.fake import FabricDriver
from transport.mooncake import _unavailable_message, configure_timeouts
from transport.threaded import ThreadedBackend

PAGE = 64


class Buf:
    """A ctypes buffer with its address, filled with a recognisable pattern."""

    def __init__(self, nbytes: int, seed: int | None = None) -> None:
        self.raw = ctypes.create_string_buffer(nbytes)
        self.addr = ctypes.addressof(self.raw)
        if seed is not None:
            rng = random.Random(seed)
            ctypes.memmove(self.addr, bytes(rng.randrange(256) for _ in range(nbytes)), nbytes)

    def page(self, i: int) -> bytes:
        return self.raw.raw[i * PAGE:(i + 1) * PAGE]


def wait_for(backend: transport.Backend, n: int = 1, timeout: float = 5.0) -> list[transport.Completion]:
    """Poll like a scheduler: sleep on the fd, drain, until n completions came."""
    done: list[transport.Completion] = []
    deadline = time.monotonic() + timeout
    while len(done) < n:
        left = deadline - time.monotonic()
        assert left > 0, f"only {done} after {timeout} s"
        select.select([backend.fileno()], [], [], left)
        done += backend.poll_completions()
    return done


def wait_until(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.001)


def readable(backend: transport.Backend) -> bool:
    return bool(select.select([backend.fileno()], [], [], 0)[0])


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


def fake(fabric: transport.FakeFabric, buf: Buf, **kw: int) -> transport.Backend:
    backend = transport.create_backend("fake", fabric=fabric, **kw)
    backend.register(buf.addr, len(buf.raw))
    return backend


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

def threaded(fabric: transport.FakeFabric, buf: Buf, driver: FabricDriver | None = None,
             timeout_s: float = 10.0) -> tuple[ThreadedBackend, FabricDriver]:
    driver = driver or FabricDriver(fabric)
    backend = ThreadedBackend(driver, transfer_timeout_s=timeout_s)
    backend.register(buf.addr, len(buf.raw))
    return backend, driver


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


class DyingDriver(FabricDriver):
    """Submits after `release` is set, then blows up on the first check."""

    def __init__(self, fabric: transport.FakeFabric) -> None:
        super().__init__(fabric)
        self.release = threading.Event()

    def submit(self, peer: str, run: transport.Run) -> object | None:
        assert self.release.wait(5)
        return super().submit(peer, run)

    def check(self, handle: object) -> int:
        raise RuntimeError("driver exploded")


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
    a.write(1, "anyone", [(src.addr, dst.addr, 1)])
    a.write(2, "anyone", [])
    done = {c.transfer_id: c for c in wait_for(a, 2)}
    assert not done[1].ok and "refused" in done[1].reason
    assert done[2].ok and done[2].nbytes == 0
    a.close()


# ---- fault wrapper -----------------------------------------------------------

def faulty(plan: transport.fault_plan.PlanLike) -> tuple[transport.FaultyBackend, transport.Backend, Buf, Buf]:
    fabric, src, dst = transport.FakeFabric(), Buf(16 * PAGE, seed=6), Buf(16 * PAGE)
    a = transport.FaultyBackend(transport.create_backend("fake", fabric=fabric), plan)
    a.register(src.addr, len(src.raw))
    return a, fake(fabric, dst), src, dst


def test_fault_fail_and_drop_write_nothing() -> None:
    a, b, src, dst = faulty("fail:count=1,reason=nic-down;drop:count=1")
    assert isinstance(transport.create_backend("fake", fabric=transport.FakeFabric(), fault_plan=""),
                      transport.FaultyBackend)
    for tid in range(3):
        a.write(tid, b.session_id, [(src.addr + tid * PAGE, dst.addr + tid * PAGE, PAGE)])
    done = {c.transfer_id: c for c in wait_for(a, 3)}
    assert (done[0].ok, done[0].reason) == (False, "nic-down")
    assert (done[1].ok, done[1].reason, done[1].nbytes) == (True, "", PAGE)  # lost
    assert done[2].ok
    assert dst.page(0) == dst.page(1) == bytes(PAGE) and dst.page(2) == src.page(2)


def test_fault_delay_lands_late() -> None:
    a, b, src, dst = faulty("delay:seconds=0.3")
    started = time.monotonic()
    a.write(1, b.session_id, [(src.addr, dst.addr, PAGE)])
    assert a.poll_completions() == [] and dst.page(0) == bytes(PAGE)
    [c] = wait_for(a)
    assert c.ok and time.monotonic() - started >= 0.3 and dst.page(0) == src.page(0)


def test_fault_hang_until_cancel_or_close() -> None:
    a, b, src, dst = faulty(transport.FaultRule("hang", ids=frozenset({1, 2})))
    a.write(1, b.session_id, [(src.addr, dst.addr, PAGE)])
    a.write(2, b.session_id, [(src.addr, dst.addr, PAGE)])
    a.write(3, b.session_id, [(src.addr, dst.addr + PAGE, PAGE)])
    assert [c.transfer_id for c in wait_for(a)] == [3]
    time.sleep(0.05)
    assert a.poll_completions() == []
    a.cancel(1)
    assert [(c.transfer_id, c.reason) for c in wait_for(a)] == [(1, "cancelled")]
    a.close()
    assert [(c.transfer_id, c.ok, c.reason) for c in wait_for(a)] == [(2, False, "closed")]
    assert dst.page(0) == bytes(PAGE)


def test_fault_cancel_during_delay_and_set_fault_at_run_time() -> None:
    a, b, src, dst = faulty(None)
    a.set_fault("delay:seconds=5")
    a.write(1, b.session_id, [(src.addr, dst.addr, PAGE)])
    a.cancel(1)
    assert [(c.transfer_id, c.reason) for c in wait_for(a)] == [(1, "cancelled")]
    a.set_fault([transport.FaultRule("fail", match=lambda tid: tid % 2 == 0, skip=1)])
    for tid in (2, 3, 4):
        a.write(tid, b.session_id, [(src.addr, dst.addr, PAGE)])
    done = {c.transfer_id: c.ok for c in wait_for(a, 3)}
    assert done == {2: True, 3: True, 4: False}  # 2 skipped, 3 not selected
    a.set_fault(None)
    a.write(5, b.session_id, [(src.addr, dst.addr, PAGE)])
    assert wait_for(a)[0].ok
    time.sleep(0.1)
    assert dst.page(0) == src.page(0)


def test_fault_plan_parsing() -> None:
    plan = transport.FaultPlan.parse(" delay:seconds=2.5, count=3 ; drop:skip=1,count=1;hang:ids=7|9 ")
    assert [(r.mode, r.count, r.skip, r.ids, r.seconds) for r in plan.rules] == [
        ("delay", 3, 0, None, 2.5), ("drop", 1, 1, None, 0.0), ("hang", None, 0, frozenset({7, 9}), 0.0)]
    [rule] = transport.FaultPlan.parse('{"mode": "fail", "count": 1, "reason": "nic down"}').rules
    assert (rule.mode, rule.count, rule.reason) == ("fail", 1, "nic down")
    assert transport.FaultPlan.parse("  ").rules == []
    [rule] = transport.FaultPlan.parse('[{"mode": "hang", "ids": [4]}]').rules
    assert rule.ids == frozenset({4})


@pytest.mark.parametrize("text", [
    "explode", "fail:count", "fail:count=-1", "fail:count=1.5", "fail:colour=red",
    "delay", "delay:seconds=0", "hang:seconds=1", "drop:ids=a|b", "[1, 2]", "{not json",
])
def test_bad_fault_plans_raise_a_clear_error(text: str) -> None:
    with pytest.raises(transport.FaultPlanError) as err:
        transport.create_backend("fake", fabric=transport.FakeFabric(), fault_plan=text)
    assert "bad fault plan" in str(err.value) and repr(text.strip()) in str(err.value)
    assert isinstance(err.value, ValueError)


def test_create_backend_wraps_only_for_a_given_plan(monkeypatch) -> None:
    monkeypatch.setenv("ZPD_TRANSPORT_FAULT", "fail")     # zpd's business (zpd/env.py), not transport's
    fabric = transport.FakeFabric()
    wrapped = transport.create_backend("fake", fabric=fabric, fault_plan="fail:count=1")
    plain = transport.create_backend("fake", fabric=fabric)
    assert isinstance(wrapped, transport.FaultyBackend) and not isinstance(plain, transport.FaultyBackend)
    wrapped.write(1, plain.session_id, [])
    assert [(c.transfer_id, c.ok) for c in wait_for(wrapped)] == [(1, False)]


# ---- Mooncake absent ------------------------------------------------------------

def test_import_transport_without_mooncake(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "mooncake", None)
    monkeypatch.setitem(sys.modules, "mooncake.engine", None)
    for name in [m for m in sys.modules if m == "transport" or m.startswith("transport.")]:
        monkeypatch.delitem(sys.modules, name)
    fresh = importlib.import_module("transport")
    assert fresh is not transport and fresh.FakeFabric is not None
    with pytest.raises(fresh.BackendUnavailableError) as err:
        fresh.create_backend("mooncake")
    assert "pip install mooncake-transfer-engine-non-cuda" in str(err.value)
    assert "mooncake-transfer-engine (CUDA)" in str(err.value)
    assert isinstance(err.value, ImportError) and isinstance(err.value, fresh.TransportError)


def test_missing_shared_library_message_shows_apt_get_and_the_original_error() -> None:
    msg = _unavailable_message(ImportError("libibverbs.so.1: cannot open shared object file"))
    assert "apt-get install -y libibverbs1 librdmacm1 libnuma1" in msg and "libibverbs.so.1" in msg
    cuda = _unavailable_message(ImportError("libcudart.so.12: cannot open shared object file"))
    assert "mooncake-transfer-engine-non-cuda" in cuda and "libcudart.so.12" in cuda


def test_mooncake_timeouts_stay_below_ours() -> None:
    env = {"MC_TCP_STATUS_TIMEOUT_SEC": "2", "MC_TCP_PROGRESS_TIMEOUT_SEC": "300"}
    assert configure_timeouts(10.0, env) == {"MC_TCP_PROGRESS_TIMEOUT_SEC": "5",
                                             "MC_TCP_STATUS_TIMEOUT_SEC": "2"}
    assert configure_timeouts(0.5, {})["MC_TCP_PROGRESS_TIMEOUT_SEC"] == "1"


def test_threaded_connect_opens_the_session_on_the_helper_thread() -> None:
    fabric, src, dst = transport.FakeFabric(), Buf(64, seed=4), Buf(64)
    a, driver = threaded(fabric, src)
    b, _ = threaded(fabric, dst)
    a.connect(b.session_id)
    a.connect("no-such-session")                  # logged; the first write would say why
    wait_until(lambda: driver.opened == [b.session_id])
    a.write(1, b.session_id, [(src.addr, dst.addr, 64)])
    [c] = wait_for(a)
    assert c.ok and dst.raw.raw == src.raw.raw
    a.close(), b.close()
