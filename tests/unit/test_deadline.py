"""Deadline: one phase at a time; a pause stops the clock, continue restarts the phase."""
from __future__ import annotations

from zpd.wire.deadline import Deadline
from zpd.wire.loop import Loop


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _run(loop: Loop, clock: Clock, until: float) -> None:
    while clock.now < until:
        clock.now = round(clock.now + 0.5, 6)
        loop.run_once(max_wait=0)


def test_expires_once_with_its_phase() -> None:
    clock, fired = Clock(), []
    loop = Loop(clock)
    d = Deadline(loop, fired.append)
    d.start(2.0, "waiting for pages")
    d.start(3.0, "waiting for kv_done")          # a new phase replaces the old one
    _run(loop, clock, 2.5)
    assert fired == []
    _run(loop, clock, 10.0)
    assert fired == ["waiting for kv_done"]


def test_pause_stops_the_clock_and_continue_restarts_the_phase() -> None:
    clock, fired = Clock(), []
    loop = Loop(clock)
    d = Deadline(loop, fired.append)
    d.start(2.0, "waiting for pages")
    _run(loop, clock, 1.5)
    d.suspend()
    _run(loop, clock, 100.0)                       # a long pause
    assert fired == []
    d.resume()
    _run(loop, clock, 101.5)
    assert fired == []
    _run(loop, clock, 102.5)
    assert fired == ["waiting for pages"]


def test_started_while_paused_waits_for_continue_and_cancel_forgets() -> None:
    clock, fired = Clock(), []
    loop = Loop(clock)
    d = Deadline(loop, fired.append)
    d.start(1.0, "stash", paused=True)
    _run(loop, clock, 50.0)
    assert fired == []
    d.resume()
    _run(loop, clock, 52.0)
    assert fired == ["stash"]
    d.start(1.0, "again")
    d.suspend()
    d.cancel()                                    # ended while paused
    d.resume()                                    # continue must not bring it back
    _run(loop, clock, 60.0)
    assert fired == ["stash"]
