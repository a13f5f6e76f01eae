"""FaultyBackend: a wrapper that breaks chosen writes of a real backend.

It is how end-to-end tests make a transfer fail, stall, hang or vanish
without touching the network. Which writes and how is a FaultPlan
(fault_plan.py documents the modes, selectors and the text form); `set_fault` swaps the plan while the backend runs.

Injected outcomes come from the wrapper's own completion queue, real ones
from the inner backend; `fileno()` is an epoll fd over both, so one fd still
wakes the scheduler's poller (epoll fds are pollable: zmq.Poller accepts them).
"""

from __future__ import annotations

import select
import threading
import time
import weakref
from typing import Sequence

from .base import Backend, Completion, Run, TransportError, check_runs
from .completions import CompletionQueue
from .fault_plan import FaultRule, PlanLike, as_plan


class _Held:
    """A write the wrapper holds back (hang, or delay before release)."""

    def __init__(self, peer: str, runs: list[Run], started: float,
                 timer: threading.Timer | None = None) -> None:
        self.peer, self.runs, self.started, self.timer = peer, runs, started, timer
        self.nbytes = sum(r[2] for r in runs)


class FaultyBackend(Backend):
    """Wraps `inner`; writes selected by the fault plan fail, stall, hang or drop."""

    def __init__(self, inner: Backend, plan: PlanLike = None) -> None:
        self.inner = inner
        self._plan = as_plan(plan)
        self._lock = threading.Lock()
        self._held: dict[int, _Held] = {}
        self._injected = CompletionQueue()
        self._epoll = select.epoll()
        self._epoll.register(inner.fileno(), select.EPOLLIN)
        self._epoll.register(self._injected.fileno(), select.EPOLLIN)
        weakref.finalize(self, self._epoll.close)
        self._closed = False

    def set_fault(self, plan: PlanLike) -> None:
        """Replace the fault plan (None: no more faults); held writes stay held."""
        new_plan = as_plan(plan)
        with self._lock:
            self._plan = new_plan

    @property
    def session_id(self) -> str:
        return self.inner.session_id

    def register(self, addr: int, length: int) -> None:
        self.inner.register(addr, length)

    def unregister(self, addr: int) -> None:
        self.inner.unregister(addr)

    def fileno(self) -> int:
        return self._epoll.fileno()

    def poll_completions(self) -> list[Completion]:
        return self._injected.drain() + self.inner.poll_completions()

    def write(self, transfer_id: int, peer: str, runs: Sequence[Run]) -> None:
        runs = check_runs(runs)
        now = time.monotonic()
        with self._lock:
            if transfer_id in self._held:
                raise TransportError(f"transfer {transfer_id} is already in flight")
            rule = None if self._closed else self._plan.choose(transfer_id)
            if rule is not None and rule.mode in ("hang", "delay"):
                self._held[transfer_id] = self._hold(transfer_id, peer, runs, now, rule)
                return
        if rule is None:
            self.inner.write(transfer_id, peer, runs)
        else:  # fail or drop: nothing reaches the fabric
            self._inject(transfer_id, _Held(peer, runs, now), rule.mode == "drop", rule.reason)

    def connect(self, peer: str) -> None:
        self.inner.connect(peer)

    def cancel(self, transfer_id: int) -> None:
        with self._lock:
            held = self._held.pop(transfer_id, None)
        if held is None:
            self.inner.cancel(transfer_id)
            return
        if held.timer is not None:
            held.timer.cancel()
        self._inject(transfer_id, held, False, "cancelled")

    def close(self) -> None:
        with self._lock:
            self._closed = True
            held, self._held = self._held, {}
        for transfer_id, h in held.items():
            if h.timer is not None:
                h.timer.cancel()
            self._inject(transfer_id, h, False, "closed")
        self.inner.close()

    def _hold(self, transfer_id: int, peer: str, runs: list[Run], now: float,
              rule: FaultRule) -> _Held:
        if rule.mode == "hang":
            return _Held(peer, runs, now)
        timer = threading.Timer(rule.seconds, self._release, (transfer_id,))
        timer.daemon = True
        held = _Held(peer, runs, now, timer)
        timer.start()  # _release takes the lock, so it runs after we store `held`
        return held

    def _release(self, transfer_id: int) -> None:
        """The delay is over: give the write to the real backend."""
        with self._lock:
            held = self._held.pop(transfer_id, None)
        if held is not None:  # else cancelled or closed meanwhile
            self.inner.write(transfer_id, held.peer, held.runs)

    def _inject(self, transfer_id: int, held: _Held, ok: bool, reason: str) -> None:
        self._injected.put(Completion(transfer_id, ok, "" if ok else reason, held.nbytes,
                                      time.monotonic() - held.started))
