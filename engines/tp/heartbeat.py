"""A rank that stops (SIGSTOP, a debugger, a wedged driver) noticed in seconds, not after
the group's collective timeout (engines/tp/group.py COLLECTIVE_TIMEOUT_S, minutes).

Every rank other than 0 writes the time into its slot of an array of shared memory its
leader made (`beat`, a thread of its own, so a long forward or load does not delay
it). The leader's `Watchdog` thread reads the slots: a rank silent for `SILENT_S` is
frozen. The leader then marks the group broken, naming the rank, and kills that rank's
process: a stopped process cannot answer a collective, and its death is what ends the
leader's wait at once (its sockets close), as for any rank that dies. The worker then
stops, so its router sees it gone and ends its requests (503) instead of routing more.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Sequence

log = logging.getLogger(__name__)

BEAT_S = 0.25          # how often a rank writes its slot
SILENT_S = 5.0         # a rank not heard from for this long is frozen


def beat(slots, rank: int) -> threading.Thread:
    """Other ranks: write the time into `slots[rank]` every BEAT_S, for good."""
    def run() -> None:
        while True:
            slots[rank] = time.monotonic()       # CLOCK_MONOTONIC: the same in every process
            time.sleep(BEAT_S)
    thread = threading.Thread(target=run, name=f"zpd-tp-beat{rank}", daemon=True)
    thread.start()
    return thread


class Watchdog:
    """Leader: watches the slots of ranks 1.. (their processes in `procs`, rank order)
    and breaks `tp` (and kills the rank) when one is silent for `silent_s`."""

    def __init__(self, tp, procs: Sequence, slots, silent_s: float = SILENT_S) -> None:
        self.tp, self.procs, self.slots, self.silent_s = tp, list(procs), slots, silent_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="zpd-tp-watchdog", daemon=True)
        self._thread.start()

    def silent(self, now: float) -> tuple[int, float] | None:
        """The first rank silent for `silent_s` at `now`, and for how long; or None."""
        for rank in range(1, len(self.procs) + 1):
            quiet = now - self.slots[rank]
            if quiet > self.silent_s:
                return rank, quiet
        return None

    def check(self, now: float) -> None:
        got = self.silent(now)
        if got is None or self.tp.stopped or self.tp.broken is not None:
            return
        rank, quiet = got
        proc = self.procs[rank - 1]
        self.tp.broken = (f"tensor-parallel rank {rank} (pid {proc.pid}) has not been heard from "
                          f"for {quiet:.1f} s (stopped or frozen): killed, the worker stops")
        log.error("%s", self.tp.broken)
        try:
            os.kill(proc.pid, signal.SIGKILL)    # ends the leader's wait in a collective
        except ProcessLookupError:
            pass

    def _run(self) -> None:
        while not self._stop.wait(BEAT_S):
            self.check(time.monotonic())

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
