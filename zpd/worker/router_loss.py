"""What becomes of a decode's requests when their router goes silent: the protocol
the decode calls, and the plain answer (end them at once). The restart wing
(zpd/worker/ha/adoption.py `RouterOrphans`) is the other answer, plugged in by the
assembly."""
from __future__ import annotations

from typing import Callable, Protocol

from zpd.wire.protocol import Rows
from zpd.worker.jobs import DecodeJob


class RouterLoss(Protocol):
    """What becomes of a silent router's requests."""

    def on_silent(self, identity: bytes) -> None:
        """The router stopped pinging us."""

    def on_back(self, identity: bytes) -> None:
        """The same router pings again (it was frozen or cut off, not restarted)."""

    def ended(self, job: DecodeJob, meta: dict, rows: Rows | None) -> None:
        """`job` of some router ended just now, its answer queued (`meta` its final meta,
        `rows` its routed experts, sent ahead)."""


class EndAtOnce:
    """A silent router's requests end at once (503): the decode without the restart
    wing (zpd/worker/ha/adoption.py), which the assembly plugs in."""

    def __init__(self, end_router: Callable[[bytes], None]) -> None:
        self.on_silent = end_router      # the decode's: its requests end with 503

    def on_back(self, identity: bytes) -> None:
        """Its requests ended already."""

    def ended(self, job: DecodeJob, meta: dict, rows: Rows | None) -> None:
        """No successor will ask for the answer."""
