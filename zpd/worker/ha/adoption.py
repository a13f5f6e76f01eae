"""A decode's side of a router restart: the requests of a router that fell silent go on
running for --router-grace seconds, their pages held, and a router restarted on the
same endpoint adopts them; what nobody adopts by then ends with 503.

A router's identity on our socket is `router@{endpoint}/{boot}.{tag}`
(zpd/wire/router_proof.py). Only a proven router (a cluster key, or without keys the
tag of the cluster's router secret: an `adopt` from anyone else is refused) that
names the same endpoint can be its successor, and only once its predecessor is gone from our socket or silent: a live
router, say another host's that prints the same endpoint, keeps its requests. Adopting
rebinds each job to the new router and answers `Adopted` (for each rid: its client,
prefill, share and tokens so far), then sends each streamed job's tokens from the
first (the router keeps them until the client says how many it has). A request that
ends once its router is known to be disconnected (a send of our tokens to it failed:
`core.unreachable`) is kept, its whole answer, for as long and handed over the same
way; one that ended before that, in the moment between the router's death and our
first failed send, was answered to no one and is forgotten: its client's resume gets
503. The prefill needs no part in this: it answers its decode, never the router,
except a streamed request's early first token (the decode sends that token again) and
a scoring request's answer (ended when its router falls silent; the client gets 503).
"""
from __future__ import annotations

import logging
from typing import Protocol

from zpd.limits import Deadlines
from zpd.wire.admin_fields import PauseMode
from zpd.wire.loop import Loop, Timer
from zpd.wire.net import Router
from zpd.wire.payloads import AdoptedRequest
from zpd.wire.protocol import Adopt, Adopted, Message, Ping, Rows, TokenPart
from zpd.wire.router_proof import router_endpoint
from zpd.wire.security import Security
from zpd.worker.jobs import DecodeJob
from zpd.worker.parts import token_part

log = logging.getLogger("zpd.worker.adoption")


class OrphanJobs(Protocol):
    """What the decode scheduler lends: its jobs (read, and rebound to a new router)
    and the two ways its requests of a gone router end."""

    jobs: dict[int, DecodeJob]                 # room -> job
    by_rid: dict[str, DecodeJob]

    def refuse_tokenizing(self, identity: bytes) -> None:
        """End the router's prompts still being tokenized (no job holds them yet)."""

    def end_router(self, identity: bytes) -> None:
        """End every request of the router with 503."""


class RouterSocket(Protocol):
    """What the worker core lends: its socket, loop and who pinged it when."""

    loop: Loop
    sock: Router
    endpoint: str
    security: Security
    paused: PauseMode | None
    pinged_at: dict[bytes, float]
    unreachable: set[bytes]

    def send(self, identity: bytes, msg: Message) -> None: ...

    def queue_token(self, identity: bytes, part: TokenPart, owner: str = "") -> None: ...


class RouterOrphans:
    """The decode's requests whose router fell silent, until adopted or ended. The
    assembly (zpd/ops/serve.py) plugs it into the decode (`DecodeScheduler.plug`)."""

    def __init__(self, sched: OrphanJobs, core: RouterSocket, deadlines: Deadlines) -> None:
        self.sched, self.core = sched, core
        self.grace, self.peer_timeout = deadlines.router_grace, deadlines.peer_timeout
        self.timers: dict[bytes, Timer] = {}      # silent router -> when its requests end
        # gone router -> rid -> (Adopted entry, whole answer) of requests ended since
        self.kept: dict[bytes, dict[str, tuple[AdoptedRequest, TokenPart, Rows | None]]] = {}

    def of(self, identity: bytes) -> list[DecodeJob]:
        return [j for j in self.sched.jobs.values() if j.client == identity]

    def on_silent(self, identity: bytes) -> None:
        """A router stopped pinging: prompts still being tokenized for it end now (no job
        holds them yet), its jobs after the grace unless a restarted router adopts them."""
        self.sched.refuse_tokenizing(identity)
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

    def on_back(self, identity: bytes) -> None:
        """The silent router pings again, the same process: its requests are its own
        still, and go on (rather than end when the grace runs out)."""
        timer = self.timers.pop(identity, None)
        if timer is not None:
            timer.cancel()
            log.warning("router %r back within the grace: its %d requests go on",
                        identity[:64], len(self.of(identity)))

    def end(self, identity: bytes) -> None:
        self.timers.pop(identity, None)
        self.sched.end_router(identity)

    def ended(self, job: DecodeJob, meta: dict, rows: Rows | None) -> None:
        """`job` ended just now (its answer is queued): keep the answer if its router is
        gone (with its routed experts' `rows`), until a successor adopts it or the grace after the peer timeout passes."""
        if job.client not in self.core.unreachable:
            return
        if job.client not in self.kept:
            self.core.loop.call_later(self.peer_timeout + self.grace, self.kept.pop,
                                      job.client, None)
        answer = token_part(job.req, 0, meta)
        self.kept.setdefault(job.client, {})[job.req.rid] = (entry(job), answer, rows)

    def on_adopt(self, identity: bytes, msg: Adopt) -> None:
        """Hand the requests of `identity`'s gone predecessors over to it."""
        endpoint = router_endpoint(identity)
        if endpoint is None or not self.core.security.proven_router(identity):
            # The socket's guard refuses it already (zpd/wire/security.py WORKER_POLICY):
            # whoever it hands over to gets every token of those requests.
            log.warning("adopt from %r dropped: not a proven router", identity[:64])
            return
        routers = {j.client for j in self.sched.jobs.values()} | set(self.kept)
        gone = {r for r in routers if r != identity and router_endpoint(r) == endpoint
                and self._gone(r)}
        jobs = [j for j in self.sched.jobs.values() if j.client in gone]
        ended = [kept for old in gone for kept in self.kept.pop(old, {}).values()
                 if kept[1].rid not in self.sched.by_rid]     # not a rid that runs again
        for old in gone:
            timer = self.timers.pop(old, None)
            if timer is not None:
                timer.cancel()
        for job in jobs:
            job.client = identity
        handed = {part.rid: info for info, part, _ in ended} | {j.req.rid: entry(j) for j in jobs}
        paused = self.core.paused
        self.core.send(identity, Adopted(handed, paused.value if paused is not None else ""))
        for info, part, rows in ended:  # after Adopted: the router knows the rids by then
            if rows is not None:
                self.core.send(identity, rows)
            self.core.queue_token(identity, part, info.owner)
        for job in jobs:
            if job.stream:
                if job.req.output:
                    self.core.queue_token(identity, token_part(job.req, 0), job.owner)
                job.sent = len(job.req.output)
        if handed:
            log.warning("router %r adopted %d requests (%d ended) of %d earlier router(s)",
                        identity[:64], len(handed), len(ended), len(gone))

    def _gone(self, identity: bytes) -> bool:
        """Silent (we stopped expecting its pings) or no longer connected to us."""
        if identity not in self.core.pinged_at:
            return True
        sock = self.core.sock
        return not sock.send(identity, Ping(0, self.core.loop.time(), self.core.endpoint)) \
            and sock.last_send_unreachable


def entry(job: DecodeJob) -> AdoptedRequest:
    """What the adopting router needs of one request."""
    req = job.req
    return AdoptedRequest(job.owner, job.prefill, job.stream,
                          len(req.prompt) + req.params.max_new_tokens, len(req.output),
                          req.params.routing is not None)
