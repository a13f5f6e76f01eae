"""A tensor-parallel rank that is stopped (SIGSTOP: a real process, frozen) is noticed
in seconds: the leader's watchdog misses its heartbeat, names it, kills it, and the
forward waiting for it fails at once, so the worker stops (its router then ends its
requests with 503) instead of waiting out the 120 s collective timeout while still
answering pings as healthy."""
from __future__ import annotations

import os
import signal
import time

from engines.tp.heartbeat import SILENT_S
from tests.unit.inproc import InprocCluster


def test_a_stopped_rank_fails_its_worker_within_seconds():
    c = InprocCluster(tp=(1, 2))
    (rank1,) = c.decode.tp_procs
    try:
        rid = c.submit([5, 17, 99, 3, 42], 200)
        c.until(lambda: rid in c.answers and len(c.answers[rid].token_ids) >= 2)
        os.kill(rank1.pid, signal.SIGSTOP)
        began = time.monotonic()
        while c.decode.failure() is None and time.monotonic() - began < 30:
            c.pump(1)                      # the decode's next forward waits for rank 1
        took = time.monotonic() - began
        failure = c.decode.failure()
        assert failure is not None and "has not been heard from" in failure, failure
        assert took < SILENT_S + 5, f"noticed after {took:.1f} s"
        rank1.join(5)
        assert rank1.exitcode == -signal.SIGKILL       # the frozen rank is gone
    finally:
        if rank1.is_alive():
            os.kill(rank1.pid, signal.SIGCONT)
        c.close()
