"""The prefill's KV writes into decode memory: started once a job's KV is computed and
its kv_dest accepted, finished by the transport's completions.

A write reads the job's pages, so they stay held (zpd/worker/pages.py) until its
completion comes, even for a job that ended meanwhile (`PrefillScheduler.end` cancels
the write; its completion then finishes the job): no page is reused while the
transport may still read it, and no kv_done or kv_failed goes out while it may land.
"""
from __future__ import annotations

import itertools
import logging
import select
import time
from dataclasses import dataclass
from typing import Callable

import transport
from engines.tp.transfer import LocalPool, PoolWrite, TransferPlanner
from zpd.wire.payloads import KvTimings
from zpd.wire.protocol import KvDone, Message
from zpd.wire.status import INTERNAL
from zpd.worker.jobs import JobPhase, PrefillJob
from engines.routed import piece_fields
from zpd.worker.parts import first_logprob_fields, prompt_logprob_fields
from zpd.worker.peers import DecodePeers

log = logging.getLogger("zpd.worker.prefill")       # its lines are the prefill scheduler's

WRITE_SETTLE_S = 0.02     # writes' wait before a forward (loopback TCP: ~1 ms, ~10 ms for 12 MB)


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


def prefill_timings(marks: dict) -> dict:
    """Milliseconds a job waited for its forward and spent in it (Request.timings)."""
    return {"prefill_queue": _ms(marks["forward"] - marks["queued"]),
            "prefill_forward": _ms(marks["computed"] - marks["forward"])}


def transfer_runs(writes: list[PoolWrite], ours: list[int], theirs: list[int]) -> list[transport.Run]:
    """The transport's runs of a transfer's pool writes: one per stretch of pages that
    advance together on both sides, per destination pool."""
    return [run for w in writes
            for run in transport.coalesce_runs(w.src_base, ours, w.dst_base, theirs, w.page_bytes)]


def _timings(marks: dict, transfer_s: float) -> KvTimings:
    """Milliseconds spent in each step of a written job."""
    return KvTimings(**prefill_timings(marks), kv_dest_wait=_ms(max(0.0, marks["write"] - marks["computed"])),
                     kv_transfer=_ms(transfer_s))


@dataclass(frozen=True)
class WritePort:
    """What the prefill scheduler lends its writes: the transport, our ranks' pools
    (`rank_pools()`: their address changes when memory is resumed), the decode peers,
    `dest_problem` (KvDests.problem), the weight `version()` a kv_done names; its
    `move`, `end` and `finish_ended` are called here, a job's phase never set."""

    backend: transport.Backend
    rank_pools: Callable[[], list[LocalPool]]
    peers: DecodePeers
    page_size: int
    send: Callable[[bytes, Message], None]
    version: Callable[[], str]
    dest_problem: Callable[[PrefillJob], str]
    move: Callable[[PrefillJob, JobPhase], None]
    end: Callable[[PrefillJob, int | None, str], None]
    finish_ended: Callable[[PrefillJob], None]


class KvWrites:
    """The prefill's writes in flight, over its `WritePort`."""

    def __init__(self, port: WritePort) -> None:
        self.sched = port
        self.by_transfer: dict[int, PrefillJob] = {}          # in flight, ended jobs' too
        self.ids = itertools.count(1)
        # our ranks' pools -> the decode's, through staging where their heads differ
        self.planner = TransferPlanner(port.backend.register)
        # cumulative, reported in status for /metrics
        self.counters = {"kv_bytes_written": 0, "kv_transfer_seconds": 0.0,
                         "kv_transfer_failures": 0}

    def __len__(self) -> int:
        return len(self.by_transfer)

    def writing(self, room: int, epoch: int) -> PrefillJob | None:
        """The job whose write for `room` (this epoch or an older one) is in flight."""
        return next((j for j in self.by_transfer.values() if j.room == room and j.epoch <= epoch),
                    None)

    def settle(self) -> None:
        """Give the writes in flight up to WRITE_SETTLE_S to land before a forward
        blocks this loop: their kv_done, which lets the decode start (and a stream whose
        first token is out go on), would otherwise wait out the whole forward."""
        end, fd = time.monotonic() + WRITE_SETTLE_S, self.sched.backend.fileno()
        while self.by_transfer:
            left = end - time.monotonic()
            if left <= 0:
                return
            if select.select([fd], [], [], left)[0]:
                self.on_completions()

    def start(self, job: PrefillJob) -> None:
        """Write the KV where the decode said, checked against the pool it announced
        (its hello may have changed since the kv_dest): a bad page id fails this
        request, never the loop."""
        s = self.sched
        problem = s.dest_problem(job)
        if problem:
            s.end(job, INTERNAL, problem)
            return
        peer, tid, dest = s.peers.get(job.decode), next(self.ids), job.dest
        # the prefix's first `cached_pages` pages the decode holds already: not written
        ours = job.req.pages[dest.cached_pages:dest.cached_pages + len(dest.page_ids)]
        try:
            writes = self.planner.plan(s.rank_pools(), peer.pools, ours, dest.page_ids)
            s.backend.write(tid, peer.session, transfer_runs(writes, ours, dest.page_ids))
        except (transport.TransportError, ValueError) as e:
            s.end(job, INTERNAL, f"KV transfer refused: {e}")
            return
        job.transfer_id = tid
        job.marks["write"] = time.monotonic()
        self.by_transfer[tid] = job
        s.move(job, JobPhase.WRITING)

    def on_completions(self) -> None:
        for c in self.sched.backend.poll_completions():
            job = self.by_transfer.pop(c.transfer_id, None)
            if job is None:
                continue
            job.transfer_id = None
            if job.phase is JobPhase.ENDED:
                self.sched.finish_ended(job)          # ended while writing
            elif not c.ok:
                self.counters["kv_transfer_failures"] += 1
                self.sched.end(job, INTERNAL, f"KV transfer failed: {c.reason}")
            else:
                self.counters["kv_bytes_written"] += c.nbytes
                self.counters["kv_transfer_seconds"] += c.seconds
                self._done(job, c.nbytes, c.seconds)

    def _done(self, job: PrefillJob, nbytes: int, seconds: float) -> None:
        """The write landed: the decode may start; the job is over here."""
        s = self.sched
        log.info("rid=%r room=%d epoch=%d kv written (%d bytes, %.1f ms)", job.req.rid,
                 job.room, job.epoch, nbytes, seconds * 1e3)
        first = job.req.output[-1] if job.req.output else -1
        s.send(job.decode, KvDone(job.room, job.epoch, first, s.version(),
                                  _timings(job.marks, seconds), **first_logprob_fields(job.req),
                                  **prompt_logprob_fields(job.req), **piece_fields(job.req.routed),
                                  cached_tokens=job.skip * s.page_size))
        s.end(job, None, "")
