"""In-process fakes for deterministic tests: no Mooncake, no sockets.

`FakeFabric` is the shared "network": the registered regions of every fake
endpoint in one process. `FakeBackend` copies bytes with ctypes.memmove
between regions registered on its fabric and rejects any run whose source or
destination is not inside a registered region, as Mooncake does (the valid
runs of such a transfer are still copied, the transfer reports ok=False).

Timing is counted in `poll_completions()` calls, not seconds: with
`complete_after_polls=N` a transfer's bytes land and its completion is
returned by the (N+1)-th poll after its write (FakeBackend has no thread). While any transfer is
outstanding the fd stays readable, so a poller loop keeps polling.

`FabricDriver` plugs the same fabric into `ThreadedBackend`, to test the helper
thread (batching, cancel, close, thread death) without Mooncake.
"""

from __future__ import annotations

import ctypes
import threading
import time
from dataclasses import dataclass
from typing import Sequence

from .base import Backend, Completion, Run, TransportError, check_runs
from .completions import CompletionQueue
from .threaded import DONE, FAILED, PENDING


class FakeFabric:
    """The registered memory of all fake endpoints sharing one fabric."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._regions: dict[str, dict[int, int]] = {}  # session -> {addr: length}
        self._sessions = 0

    def new_session(self) -> str:
        with self._lock:
            self._sessions += 1
            session = f"fake:{self._sessions}"
            self._regions[session] = {}
            return session

    def drop_session(self, session: str) -> None:
        with self._lock:
            self._regions.pop(session, None)

    def register(self, session: str, addr: int, length: int) -> None:
        if addr <= 0 or length <= 0:
            raise TransportError(f"cannot register {length} bytes at {addr:#x}")
        with self._lock:
            self._session(session)[addr] = length

    def unregister(self, session: str, addr: int) -> None:
        with self._lock:
            if self._session(session).pop(addr, None) is None:
                raise TransportError(f"{session}: no region registered at {addr:#x}")

    def copy(self, src_session: str, peer: str, runs: Sequence[Run]) -> str:
        """Copy every valid run; return "" or why some run was rejected."""
        reason = ""
        for src, dst, nbytes in runs:
            with self._lock:
                bad = self._reject(src_session, src, nbytes, "source") or \
                    self._reject(peer, dst, nbytes, "destination")
            if bad:
                reason = reason or bad
                continue
            ctypes.memmove(dst, src, nbytes)
        return reason

    def _session(self, session: str) -> dict[int, int]:
        regions = self._regions.get(session)
        if regions is None:
            raise TransportError(f"unknown fake session {session!r}")
        return regions

    def _reject(self, session: str, addr: int, nbytes: int, what: str) -> str:
        regions = self._regions.get(session)
        if regions is None:
            return f"{what} session {session!r} is not reachable"
        for base, length in regions.items():
            if base <= addr and addr + nbytes <= base + length:
                return ""
        return f"{what} [{addr:#x}, +{nbytes}) is outside every region of {session}"


@dataclass
class _Outstanding:
    peer: str
    runs: list[Run]
    nbytes: int
    polls_left: int
    started: float
    cancelled: bool = False


class FakeBackend(Backend):
    """A deterministic backend on a FakeFabric; completes after N polls."""

    def __init__(self, fabric: FakeFabric, complete_after_polls: int = 0) -> None:
        if complete_after_polls < 0:
            raise TransportError(f"complete_after_polls must be >= 0, got {complete_after_polls}")
        self._fabric = fabric
        self._after = complete_after_polls
        self._session = fabric.new_session()
        self._lock = threading.Lock()  # FaultyBackend may write from a timer thread
        self._outstanding: dict[int, _Outstanding] = {}
        self._done = CompletionQueue()
        self._closed = False

    @property
    def session_id(self) -> str:
        return self._session

    def register(self, addr: int, length: int) -> None:
        self._fabric.register(self._session, addr, length)

    def unregister(self, addr: int) -> None:
        self._fabric.unregister(self._session, addr)

    def fileno(self) -> int:
        return self._done.fileno()

    def write(self, transfer_id: int, peer: str, runs: Sequence[Run]) -> None:
        runs = check_runs(runs)
        nbytes = sum(r[2] for r in runs)
        with self._lock:
            if transfer_id in self._outstanding:
                raise TransportError(f"transfer {transfer_id} is already in flight")
            if self._closed:
                self._done.put(Completion(transfer_id, False, "closed", nbytes, 0.0))
                return
            self._outstanding[transfer_id] = _Outstanding(peer, runs, nbytes, self._after, time.monotonic())
        self._done.nudge()

    def cancel(self, transfer_id: int) -> None:
        with self._lock:
            t = self._outstanding.get(transfer_id)
            if t is not None:
                t.cancelled = True

    def poll_completions(self) -> list[Completion]:
        with self._lock:
            for tid, t in list(self._outstanding.items()):
                if t.cancelled or t.polls_left == 0:
                    del self._outstanding[tid]
                    self._done.put(self._complete(tid, t))
                else:
                    t.polls_left -= 1
            remaining = bool(self._outstanding)
        done = self._done.drain()
        if remaining:
            self._done.nudge()
        return done

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for tid, t in self._outstanding.items():
                self._done.put(Completion(tid, False, "closed", t.nbytes, _since(t.started)))
            self._outstanding.clear()
        self._fabric.drop_session(self._session)

    def _complete(self, tid: int, t: _Outstanding) -> Completion:
        if t.cancelled:
            return Completion(tid, False, "cancelled", t.nbytes, _since(t.started))
        reason = self._fabric.copy(self._session, t.peer, t.runs)
        return Completion(tid, not reason, reason, t.nbytes, _since(t.started))


def _since(started: float) -> float:
    return time.monotonic() - started


class _Handle:
    __slots__ = ("peer", "run")

    def __init__(self, peer: str, run: Run) -> None:
        self.peer, self.run = peer, run


class FabricDriver:
    """A ThreadedBackend driver on a FakeFabric, with a gate to hold runs in flight.

    While `gate` is clear every submitted run stays PENDING; once set, a run's
    bytes are copied when it is checked. `max_in_flight` records the most
    runs ever in flight at once (per driver), to test batching.
    """

    def __init__(self, fabric: FakeFabric) -> None:
        self.fabric = fabric
        self.session_id = fabric.new_session()
        self.gate = threading.Event()
        self.gate.set()
        self.submitted = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.closed_with_outstanding: int | None = None
        self.opened: list[str] = []

    def register(self, addr: int, length: int) -> None:
        self.fabric.register(self.session_id, addr, length)

    def unregister(self, addr: int) -> None:
        self.fabric.unregister(self.session_id, addr)

    def open(self, peer: str) -> None:
        self.fabric._session(peer)        # raises for an unknown session, as a handshake would
        self.opened.append(peer)

    def probe(self, peer: str, timeout_s: float) -> None:
        self.fabric._session(peer)        # an unknown session answers no handshake

    def submit(self, peer: str, run: Run) -> object | None:
        self.submitted += 1
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        return _Handle(peer, run)

    def check(self, handle: object) -> int:
        if not isinstance(handle, _Handle):
            raise TypeError(f"not a FabricDriver handle: {handle!r}")
        if not self.gate.is_set():
            return PENDING
        self.in_flight -= 1
        return FAILED if self.fabric.copy(self.session_id, handle.peer, [handle.run]) else DONE

    def close(self, outstanding: int) -> None:
        self.closed_with_outstanding = outstanding
        self.fabric.drop_session(self.session_id)
