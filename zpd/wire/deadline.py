"""A request's deadline on a worker: one phase at a time, stopped while paused.

A pause(in_place) holds requests on purpose, for as long as the operator needs
(an update of something else, a drained network link). Their phase deadlines
(waiting for pages, for kv_dest, for kv_done) must not expire meanwhile, so a
pause suspends each one and continue starts the phase's full time again. A
KV write's deadline is not suspended: the write goes on during a pause.
"""
from __future__ import annotations

from typing import Callable

from zpd.wire.loop import Loop, Timer


class Deadline:
    __slots__ = ("_loop", "_on_expire", "_timer", "_spec", "_held")

    def __init__(self, loop: Loop, on_expire: Callable[[str], None]) -> None:
        self._loop, self._on_expire = loop, on_expire
        self._timer: Timer | None = None
        self._spec: tuple[float, str] | None = None   # the current phase: seconds, what
        self._held = False                            # suspended by a pause

    def start(self, seconds: float, what: str, paused: bool = False) -> None:
        """A new phase with `seconds` to finish; while `paused` its clock waits."""
        self.cancel()
        self._spec = (seconds, what)
        if paused:
            self._held = True
        else:
            self._arm()

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._spec, self._held = None, None, False

    def suspend(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer, self._held = None, True

    def resume(self) -> None:
        if self._held:
            self._held = False
            self._arm()

    def _arm(self) -> None:
        seconds, what = self._spec
        self._timer = self._loop.call_later(seconds, self._fire, what)

    def _fire(self, what: str) -> None:
        self._timer, self._spec = None, None
        self._on_expire(what)
