"""Where a prefill job's KV goes: the decodes' hellos and kv_dests, and the pairing that
lets only the room's own decode say it (the checks themselves are zpd/worker/peers.py).

A kv_dest may come before the room's request (router -> prefill and decode -> prefill
are different sockets): it is kept as an offer on a STASHED job and weighed at `pair`,
once the request has named the room's decode.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

from zpd.wire.status import ABORTED, INTERNAL
from zpd.wire.protocol import Hello, HelloAck, KvDest, KvFailed, Message
from zpd.worker.jobs import JobPhase, PrefillJob
from zpd.worker.peers import DecodePeers, endpoint_key
from zpd.worker.tombstones import Tombstones

log = logging.getLogger("zpd.worker.prefill")       # its lines are the prefill scheduler's


@dataclass(frozen=True)
class DestPort:
    """What the prefill scheduler lends its intake: its jobs, tombstones and decode
    peers are read here, its `new_job`, `move`, `end` and write start called; a job's
    phase is never set here. `compat_hash`, `serves` (what we serve, for a refusal),
    `connect` (a decode's transport session) and `hello_ack(ok, reason)` are the
    worker core's side of a hello."""

    jobs: dict[int, PrefillJob]
    tombstones: Tombstones
    peers: DecodePeers
    send: Callable[[bytes, Message], None]
    dropping: Callable[[], bool]
    pages_for: Callable[[int], int]
    new_job: Callable[[int, int], PrefillJob]
    move: Callable[[PrefillJob, JobPhase], None]
    end: Callable[[PrefillJob, int | None, str], None]
    start_write: Callable[[PrefillJob], None]
    compat_hash: str
    serves: str
    connect: Callable[[str], None]
    hello_ack: Callable[[bool, str], HelloAck]


class KvDests:
    """The prefill's intake of hellos and kv_dests, over its `DestPort`."""

    def __init__(self, port: DestPort) -> None:
        self.sched = port

    def on_hello(self, identity: bytes, msg: Hello) -> None:
        """A decode's pool, where its kv_dests may point (zpd/worker/peers.py): refused
        when incompatible or impossible, and then none of its kv_dests counts."""
        s, peers = self.sched, self.sched.peers
        reason = peers.hello(identity, msg) if msg.compat_hash == s.compat_hash else (
            f"incompatible peers: prefill {s.serves} "
            f"({peers.layout.to_dict()}), decode {msg.decode} has layout {msg.layout.to_dict()} "
            f"(hash {msg.compat_hash} != {s.compat_hash})")
        if reason:
            peers.forget(identity)
            log.error("hello from %r refused: %s", msg.decode[:200], reason)
        else:
            s.connect(msg.session_id)     # handshake now, not at its first write
        s.send(identity, s.hello_ack(not reason, reason))

    def on_kv_dest(self, identity: bytes, msg: KvDest) -> None:
        s = self.sched
        if identity not in s.peers:
            s.send(identity, KvFailed(msg.room, msg.epoch, INTERNAL, "kv_dest before hello"))
            return
        job = s.jobs.get(msg.room)
        ended = (msg.room, msg.epoch) in s.tombstones or s.dropping()
        if job is None and ended:
            # nothing of ours will ever write there: the decode may reuse the pages
            s.send(identity, KvFailed(msg.room, msg.epoch, ABORTED, "ended at prefill"))
            return
        if job is None:
            job = s.new_job(msg.room, msg.epoch)
            s.move(job, JobPhase.STASHED)
        if job.epoch != msg.epoch:
            log.warning("stale kv_dest for room %d epoch %d dropped", msg.room, msg.epoch)
        elif job.paired is not None and not s.peers.may_send(identity, job.paired, job.decode):
            s.peers.refuse(identity, job.room, job.epoch, job.paired)
        elif job.dest is not None or identity in job.offers:
            log.warning("duplicate kv_dest for room %d epoch %d dropped", msg.room, msg.epoch)
        elif job.paired is None:                 # before its request: who may send it is unknown
            job.offers[identity] = msg
            job.decode = job.decode or identity  # told if the room expires unpaired
        else:
            self.accept(job, identity, msg)

    def pair(self, job: PrefillJob, endpoint: str, sender: bytes | None = None) -> None:
        """The request came: only the decode at `endpoint` (the router's choice, or the
        recompute's `sender`) may now say where its KV goes. Offers that came first are
        accepted or refused now."""
        job.paired, job.decode = endpoint_key(endpoint), sender
        chosen = self.sched.peers.settle(job.room, job.epoch, job.offers, job.paired, sender)
        job.offers = {}
        if chosen is not None:
            self.accept(job, *chosen)

    def accept(self, job: PrefillJob, identity: bytes, dest: KvDest) -> None:
        job.decode, job.dest = identity, dest
        if job.phase is JobPhase.REJECTED:
            self.sched.end(job, *job.failure)
            return
        problem = self.problem(job)
        if problem:
            self.sched.end(job, INTERNAL, problem)     # fail fast; writes.start checks again
        elif job.phase is JobPhase.COMPUTED:
            self.sched.start_write(job)

    def problem(self, job: PrefillJob) -> str:
        """Why the job's kv_dest is no place for its KV (checked against the pool its
        decode announced last), or ""."""
        need = self.sched.pages_for(len(job.req.prompt))
        return self.sched.peers.dest_problem(job.decode, job.dest, need)
