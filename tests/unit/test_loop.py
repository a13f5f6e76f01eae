"""Loop tests: timer order, cancel, compaction, fake clock, fault isolation,
cross-thread wakeup, fd and socket dispatch."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator

import pytest
import zmq

from zpd.wire import protocol as p
from zpd.wire.loop import Loop
from zpd.wire.net import Dealer, Router


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def loop(clock: FakeClock) -> Iterator[Loop]:
    lp = Loop(clock=clock, compact_min=8)
    yield lp
    lp.close()


@pytest.fixture
def real_loop() -> Iterator[Loop]:
    lp = Loop()
    yield lp
    lp.close()


def test_timers_fire_in_deadline_order_only_when_due(loop: Loop, clock: FakeClock) -> None:
    fired: list[str] = []
    for name, delay in [("c", 3.0), ("a", 1.0), ("b", 2.0), ("a2", 1.0)]:
        loop.call_later(delay, fired.append, name)
    loop.run_once(max_wait=0)
    assert fired == []
    clock.now += 1.5
    loop.run_once(max_wait=0)
    assert fired == ["a", "a2"]  # equal deadlines keep scheduling order
    clock.now += 10
    loop.run_once(max_wait=0)
    assert fired == ["a", "a2", "b", "c"]
    assert loop.pending_timers == 0


def test_cancel(loop: Loop, clock: FakeClock) -> None:
    fired: list[int] = []
    keep = loop.call_later(1, fired.append, 1)
    drop = loop.call_later(1, fired.append, 2)
    drop.cancel()
    drop.cancel()  # idempotent: must not be counted twice
    assert not drop.active and keep.active
    assert loop.pending_timers == 1
    clock.now += 2
    loop.run_once(max_wait=0)
    assert fired == [1]
    keep.cancel()  # after firing: a no-op
    assert loop.pending_timers == 0 and loop.heap_size == 0


def test_heap_is_compacted_when_cancelled_entries_dominate(loop: Loop) -> None:
    timers = [loop.call_later(60 + i, lambda: None) for i in range(1000)]
    for t in timers[:990]:
        t.cancel()
    assert loop.pending_timers == 10
    assert loop.heap_size < 100  # without compaction it would still be 1000
    # Steady churn (cancel + reschedule, like requests) stays bounded too.
    live = timers[990:]
    for i in range(10_000):
        live[i % 10].cancel()
        live[i % 10] = loop.call_later(60 + i, lambda: None)
    assert loop.pending_timers == 10 and loop.heap_size < 100


def test_timer_scheduled_for_now_by_a_timer_runs_next_iteration(loop: Loop, clock: FakeClock) -> None:
    count = [0]

    def again() -> None:
        count[0] += 1
        loop.call_at(clock.now, again)

    loop.call_at(clock.now, again)
    loop.run_once(max_wait=0)
    assert count[0] == 1  # did not spin forever inside one iteration
    loop.run_once(max_wait=0)
    assert count[0] == 2


def test_every_keeps_its_period_and_skips_missed_beats(loop: Loop, clock: FakeClock) -> None:
    beats: list[float] = []
    periodic = loop.every(1.0, lambda: beats.append(clock.now))
    for _ in range(3):
        clock.now += 1.0
        loop.run_once(max_wait=0)
    assert beats == [1001.0, 1002.0, 1003.0]
    clock.now += 10.5  # a stall: one beat, not ten
    loop.run_once(max_wait=0)
    assert len(beats) == 4
    periodic.cancel()
    clock.now += 5
    loop.run_once(max_wait=0)
    assert len(beats) == 4


def test_raising_callback_is_logged_and_loop_continues(
        loop: Loop, clock: FakeClock, caplog: pytest.LogCaptureFixture) -> None:
    fired: list[str] = []

    def boom() -> None:
        raise RuntimeError("handler bug")

    loop.call_later(1, boom)
    loop.call_later(1, fired.append, "after")
    loop.every(1, boom)
    with caplog.at_level(logging.ERROR, logger="zpd.wire.loop"):
        clock.now += 1
        loop.run_once(max_wait=0)
        clock.now += 1
        loop.run_once(max_wait=0)
    assert fired == ["after"]
    errors = [r for r in caplog.records if r.name == "zpd.wire.loop"]
    assert len(errors) == 3  # boom once + the periodic twice: it survived
    assert all(r.exc_info and "handler bug" in r.getMessage() + str(r.exc_info[1]) for r in errors)


def test_poll_sleeps_until_next_deadline(real_loop: Loop) -> None:
    fired: list[float] = []
    due = real_loop.time() + 0.05
    real_loop.call_at(due, lambda: fired.append(real_loop.time()))
    real_loop.run_once()  # one iteration must be enough: it sleeps until due
    assert fired and 0 <= fired[0] - due < 0.05


def test_call_soon_threadsafe_wakes_a_blocked_poll() -> None:
    lp = Loop(max_poll=30.0)
    ran = threading.Event()
    try:
        threading.Timer(0.05, lp.call_soon_threadsafe, (ran.set,)).start()
        started = time.monotonic()
        lp.run_once()  # no timers, no sockets: would sleep 30 s unwoken
        assert ran.is_set()
        assert time.monotonic() - started < 1.0
    finally:
        lp.close()


def test_run_and_stop_from_another_thread() -> None:
    lp = Loop(max_poll=30.0)
    worker = threading.Thread(target=lp.run)
    worker.start()
    try:
        time.sleep(0.05)
        lp.stop()
        worker.join(timeout=1.0)
        assert not worker.is_alive()
    finally:
        lp.stop()
        worker.join()
        lp.close()


def test_stop_before_run_and_stop_event() -> None:
    lp = Loop(max_poll=0.01)
    try:
        lp.stop()
        started = time.monotonic()
        lp.run()  # returns at once: the early stop was not lost
        event = threading.Event()
        lp.call_later(0.02, event.set)
        lp.run(stop_event=event)
        assert time.monotonic() - started < 1.0
    finally:
        lp.close()


def test_fd_handler_fires(real_loop: Loop) -> None:
    r, w = os.pipe()
    got: list[bytes] = []
    real_loop.add_fd(r, lambda: got.append(os.read(r, 100)))
    try:
        real_loop.run_once(max_wait=0)
        assert got == []
        os.write(w, b"done")
        real_loop.run_once(max_wait=1.0)
        assert got == [b"done"]
        real_loop.remove_fd(r)
        os.write(w, b"more")
        real_loop.run_once(max_wait=0)
        assert got == [b"done"]
    finally:
        os.close(r)
        os.close(w)


@pytest.fixture
def sockets() -> Iterator[tuple[Router, Dealer, Dealer]]:
    ctx = zmq.Context()
    router = Router(ctx, "127.0.0.1", 0)
    a = Dealer(ctx, router.endpoint, identity=b"a")
    b = Dealer(ctx, router.endpoint, identity=b"b")
    yield router, a, b
    for s in (a, b, router):
        s.close()
    ctx.term()


def test_socket_drain_is_bounded_per_iteration(sockets: tuple[Router, Dealer, Dealer]) -> None:
    router, a, b = sockets
    lp = Loop(max_batch=10)
    got: list[tuple[bytes, p.Message]] = []
    lp.add_socket(router, lambda: got.append(router.recv()))
    try:
        for i in range(25):
            a.send(p.Ping(seq=i, sent_at=0.0))
        deadline = time.monotonic() + 5
        while router.socket.poll(0) == 0 and time.monotonic() < deadline:
            time.sleep(0.001)
        time.sleep(0.05)  # let all 25 reach the router's queue
        lp.run_once(max_wait=1.0)
        assert len(got) == 10  # bounded: the rest wait for the next turn
        for _ in range(5):
            lp.run_once(max_wait=0.1)
        assert [m.seq for _, m in got] == list(range(25))
    finally:
        lp.close()


def test_garbage_on_socket_does_not_stop_dispatch(sockets: tuple[Router, Dealer, Dealer]) -> None:
    router, a, b = sockets
    lp = Loop()
    got: list[object] = []
    lp.add_socket(router, lambda: got.append(router.recv()))
    try:
        a.socket.send_multipart([b"garbage"])
        b.send(p.Abort(rid="x"))
        deadline = time.monotonic() + 5
        while len([g for g in got if g]) < 1 and time.monotonic() < deadline:
            lp.run_once(max_wait=0.1)
        assert (b"b", p.Abort(rid="x")) in got
        lp.remove_socket(router)
        b.send(p.Abort(rid="y"))
        time.sleep(0.05)
        before = len(got)
        lp.run_once(max_wait=0.05)
        assert len(got) == before
    finally:
        lp.close()


def test_max_late_is_the_worst_lateness_of_any_timer(loop: Loop, clock: FakeClock) -> None:
    loop.call_later(1.0, lambda: None)
    loop.call_later(2.0, lambda: None)
    clock.now += 1.25                      # the first fires 0.25 s late
    loop.run_once(max_wait=0)
    assert loop.max_late == pytest.approx(0.25)
    clock.now += 0.80                      # the second, 0.05 s late: the maximum stays
    loop.run_once(max_wait=0)
    assert loop.max_late == pytest.approx(0.25)


def test_busy_poll_spins_only_within_its_window_after_activity(clock: FakeClock) -> None:
    """After a message the loop polls without sleeping for `busy_poll` s (of its clock);
    then it sleeps again until something happens. Idle from the start, it sleeps."""
    lp = Loop(clock=clock, busy_poll=0.01)
    r, w = os.pipe()
    lp.add_fd(r, lambda: os.read(r, 100))

    def wall(max_wait: float) -> float:
        started = time.monotonic()
        lp.run_once(max_wait=max_wait)
        return time.monotonic() - started
    try:
        assert wall(0.2) >= 0.19                     # idle: sleeps the whole wait
        os.write(w, b"x")
        lp.run_once(max_wait=1.0)                    # activity at clock 1000.0
        clock.now += 0.005
        assert wall(5.0) < 1.0                       # within the window: no sleep
        clock.now += 0.006
        assert wall(0.2) >= 0.19                     # window over: sleeps again
    finally:
        lp.close()
        os.close(r)
        os.close(w)
