"""A decode's side of a router restart: the requests of a router that fell silent go
on running for --router-grace seconds, their pages held, and a router restarted on
the same endpoint adopts them; what nobody adopts by then ends with 503.

A router's identity on our socket is `router@{endpoint}/{boot}` (zpd/router/server.py).
Only the process bound to that endpoint now can be its successor, and only once its
predecessor is gone from our socket or silent: a live router, say another host's that
prints the same endpoint, keeps its requests. Adopting rebinds each job to the new
router and answers `Adopted` (for each rid: its client, prefill, share and tokens so
far), then sends each streamed job's tokens from the first (the router keeps them until
the client says how many it has). A request that finished while its router was
silent was answered to no one and is forgotten: its client's resume gets 503. The
prefill needs no part in this: it answers its decode, never the router, except a
streamed request's early first token (the decode sends that token again) and a
scoring request's answer (ended when its router falls silent; the client gets 503).
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from zpd.wire.loop import Timer
from zpd.wire.protocol import Adopt, Adopted, Ping
from zpd.wire.status import UNAVAILABLE
from zpd.worker.jobs import DecodeJob
from zpd.worker.parts import token_part

if TYPE_CHECKING:
    from zpd.worker.decode import DecodeScheduler

log = logging.getLogger("zpd.worker.adoption")

ROUTER_PREFIX = b"router@"


def router_endpoint(identity: bytes) -> bytes | None:
    """The endpoint of a router's identity `router@{endpoint}/{boot}` (None: not one)."""
    if not identity.startswith(ROUTER_PREFIX):
        return None
    endpoint, sep, boot = identity[len(ROUTER_PREFIX):].rpartition(b"/")
    return endpoint if sep and endpoint and boot else None


class RouterOrphans:
    """The decode's requests whose router fell silent, until adopted or ended."""

    def __init__(self, sched: DecodeScheduler) -> None:
        self.sched, self.core = sched, sched.core
        self.grace = self.core.cfg.deadlines.router_grace
        self.timers: dict[bytes, Timer] = {}      # silent router -> when its requests end

    def of(self, identity: bytes) -> list[DecodeJob]:
        return [j for j in self.sched.jobs.values() if j.client == identity]

    def on_silent(self, identity: bytes) -> None:
        """A router stopped pinging: prompts still being tokenized for it end now (no job
        holds them yet), its jobs after the grace unless a restarted router adopts them."""
        tokenizing = self.core.tokenizing
        for rid in [r for r, (client, _) in tokenizing.pending.items() if client == identity]:
            self.sched.refuse(*tokenizing.cancel(rid), UNAVAILABLE, "router unavailable")
        jobs = self.of(identity)
        if not jobs or self.grace <= 0:
            self.end(identity)
            return
        log.warning("router %r silent: its %d requests run on for %g s for a router "
                    "restarted on its endpoint to adopt", identity[:64], len(jobs), self.grace)
        old = self.timers.pop(identity, None)
        if old is not None:
            old.cancel()
        self.timers[identity] = self.core.loop.call_later(self.grace, self.end, identity)

    def end(self, identity: bytes) -> None:
        self.timers.pop(identity, None)
        orphans = self.of(identity)
        if orphans:
            log.error("router %r silent: ending its %d requests", identity[:64], len(orphans))
        for job in orphans:
            self.sched.finish(job, UNAVAILABLE, "router unavailable", tell_prefill=True)

    def on_adopt(self, identity: bytes, msg: Adopt) -> None:
        """Hand the requests of `identity`'s gone predecessors over to it."""
        endpoint = router_endpoint(identity)
        if endpoint is None:
            log.warning("adopt from %r dropped: not a router", identity[:64])
            return
        gone = {j.client for j in self.sched.jobs.values() if j.client != identity
                and router_endpoint(j.client) == endpoint and self._gone(j.client)}
        jobs = [j for j in self.sched.jobs.values() if j.client in gone]
        for old in gone:
            timer = self.timers.pop(old, None)
            if timer is not None:
                timer.cancel()
        for job in jobs:
            job.client = identity
        self.core.send(identity, Adopted({j.req.rid: entry(j) for j in jobs}))
        for job in jobs:            # after Adopted: the router knows the rids by then
            if job.stream:
                if job.req.output:
                    self.core.queue_token(identity, token_part(job.req, 0))
                job.sent = len(job.req.output)
        if jobs:
            log.warning("router %r adopted %d requests of %d earlier router(s)", identity[:64],
                        len(jobs), len(gone))

    def _gone(self, identity: bytes) -> bool:
        """Silent (we stopped expecting its pings) or no longer connected to us."""
        if identity not in self.core.pinged_at:
            return True
        sock = self.core.sock
        return not sock.send(identity, Ping(0, self.core.loop.time(), self.core.endpoint)) \
            and sock.last_send_unreachable


def entry(job: DecodeJob) -> dict:
    """What the adopting router needs of one request (Adopted's fields)."""
    req = job.req
    return {"owner": job.owner, "prefill": job.prefill, "stream": job.stream,
            "tokens": len(req.prompt) + req.params.max_new_tokens, "output": len(req.output)}
