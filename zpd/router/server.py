"""The router: picks a prefill and a decode for each request, relays tokens back;
its admin commands (fanned out to every worker) are in zpd.router.admin."""
from __future__ import annotations

import itertools
import logging
import os
import random
import threading
import uuid

import zmq

from zpd.config import RouterConfig
from zpd.router.admin import RouterAdmin
from zpd.router.admission import QUEUE_TIMEOUT, Admission, Waiting, ended
from zpd.router.affinity import PrefixAffinity, least_loaded
from zpd.router.flights import InFlight, Worker
from zpd.router.hooks import Alone, Coordinator, Peers, Restart
from zpd.router.memory import ReleasedMemory, timeout_message
from zpd.router.relay import Relay
from zpd.router.shares import ClientShares, request_tokens
from zpd.router.tally import Tally
from zpd.wire.first_token import FirstToken
from zpd.wire.step import is_step
from zpd.wire.liveness import PeerClock
from zpd.wire.loop import Loop
from zpd.wire.readiness import readable
from zpd.wire.net import Dealer, Router
from zpd.wire.admin_fields import PauseMode
from zpd.wire.router_proof import load_router_secret, router_identity
from zpd.wire.security import ROUTER_POLICY, Security
from zpd.wire.messages import user_problem
from zpd.wire.protocol import (Abort, Accepted, Admin, AdminReply, Adopted, Generate, Ping, Pong,
                               Resume, Rows, TokenPart, Tokens, encode, new_room)

log = logging.getLogger("zpd.router.server")

MAX_REASON = 200       # characters of a client's abort reason passed on
# --max-concurrent-requests 0: this many per decode, the decodes' default --max-batch,
# so a decode's own queue stays short (docs/operating.md, "Limits")
CONCURRENT_PER_DECODE = 64


class RouterServer:
    """One router process's state and its loop: routes each request to a prefill and
    a decode, relays their tokens to the client, fails requests of dead workers.
    Its optional parts (zpd/router/hooks.py) are plugged in by zpd/ops/router.py:
    `followers`, `coordinator`, `adoption` and `admin.sync`."""

    def __init__(self, cfg: RouterConfig, ctx: zmq.Context, loop: Loop | None = None) -> None:
        self.cfg, self.loop = cfg, loop or Loop(busy_poll=cfg.busy_poll_us / 1e6)
        self.shares = ClientShares(cfg.max_client_requests, cfg.max_client_tokens)  # checks them
        self.admission = Admission(cfg.queue_size, cfg.queue_timeout)   # what waits, fairly
        if cfg.max_concurrent_requests < 0:
            raise ValueError("--max-concurrent-requests must be at least 0 (0: 64 per decode)")
        self.max_concurrent = cfg.max_concurrent_requests or CONCURRENT_PER_DECODE * len(cfg.decode)
        self.tally = Tally()                             # what clients got, for /metrics
        self.security = Security(cfg.curve_keys, ctx,
                                 router_secret=load_router_secret(cfg.router_secret_file))
        self.front = Router(ctx, cfg.host, cfg.port, self.security.server_options(ROUTER_POLICY))
        # Requests belong to their client's identity, which the client names itself:
        # handing an identity over to its newest connection would let any peer that
        # names a client's identity take its route, its tokens and its requests.
        self.front.socket.setsockopt(zmq.ROUTER_HANDOVER, 0)
        self.endpoint = self.front.endpoint
        # The boot id (pid and a random part) tells workers that a router restarted on
        # the same port is another process, which adopts the old one's requests
        # (zpd/router/ha/adoption.py); clients see it change and resume theirs. Our
        # identity adds a tag no client sees, so none can claim it (router_proof.py).
        self.boot = f"{os.getpid()}.{uuid.uuid4().hex[:8]}"
        self.identity = router_identity(self.endpoint, self.boot, self.security.router_secret)
        self.workers = [Worker(role, ep, self.dealer(ctx, ep), PeerClock(self.loop.time()))
                        for role, eps in (("prefill", cfg.prefill), ("decode", cfg.decode))
                        for ep in eps]
        self.inflight: dict[str, InFlight] = {}
        self.accepts: dict[bytes, list[str]] = {}     # client -> rids to acknowledge
        self.paused: PauseMode | None = None
        self.released = ReleasedMemory()       # the workers' memory that is released
        self.affinity = PrefixAffinity()
        self.admin = RouterAdmin(self)
        self.relayer = Relay(self)             # a worker's steps, on to the clients
        self.followers: Peers = Alone()        # routers that follow this one
        self.coordinator: Coordinator | None = None    # the router this one follows
        self.adoption: Restart | None = None   # the requests of this endpoint's last router
        self.loop.add_socket(self.front, self.on_client)
        for w in self.workers:
            self.loop.add_socket(w.dealer, lambda w=w: self.on_worker(w))
        self.pings = itertools.count()
        self.loop.every(cfg.heartbeat, self.heartbeat)

    def dealer(self, ctx: zmq.Context, endpoint: str) -> Dealer:
        """A link to a worker or a router, under this router's identity."""
        return Dealer(ctx, endpoint, identity=self.identity, opts=self.security.client_options())

    def pick(self, role: str) -> Worker | None:
        """The least loaded live worker of `role`, ties at random."""
        live = [w for w in self.workers if w.role == role and w.alive]
        return random.choice(least_loaded(live)[1]) if live else None

    def pick_prefill(self, msg: Generate) -> Worker | None:
        """A prefill whose prefix cache likely has the prompt's beginning, unless it is
        much busier than the least loaded one (zpd/router/affinity.py)."""
        candidates = [w for w in self.workers if w.role == "prefill" and w.alive]
        return self.affinity.pick(msg, candidates) if candidates else None

    # --- liveness ----------------------------------------------------------------

    def heartbeat(self) -> None:
        now, seq = self.loop.time(), next(self.pings)
        for w in self.workers:
            if w.alive and w.clock.silent(now, self.cfg.peer_timeout):
                self.mark_dead(w)
            w.dealer.send(Ping(seq, now, self.endpoint, self.boot))
            w.clock.pinged(now)
        self.probe_clients(Ping(seq, now, self.endpoint, self.boot))
        self.expire_waiting(now)
        self.followers.expire(now)
        if self.coordinator is not None:
            self.coordinator.heartbeat()

    def probe_clients(self, ping: Ping) -> None:
        """A client that hung up (crashed, closed its socket) can take no tokens: end its
        requests now instead of generating to max_new_tokens for no one. A ping it
        ignores is the probe: ZeroMQ refuses it at once once the client is gone. The
        clients with requests routed are those charged a share (every flight is, from
        its routing to its end): a tick costs O(clients), not a pass over every flight."""
        clients = self.shares.held.keys() | self.admission.clients()
        for client in clients:
            self.to_client(client, ping)

    def to_client(self, client: bytes, msg) -> None:
        self.tally.count(msg)
        if not self.front.send(client, msg) and self.front.last_send_unreachable:
            self.client_gone(client)

    def client_gone(self, client: bytes) -> None:
        queued = self.admission.of_client(client)
        running = [rid for rid, f in self.inflight.items()       # an adopted one's client
                   if f.client == client and not self.unclaimed(rid)]         # comes back
        if not queued and not running:
            return
        log.warning("client %r disconnected: ending its %d requests", client[:32],
                    len(queued) + len(running))
        for rid in queued:
            self.admission.remove(rid)          # never charged: nothing else to give back
        for rid in running:
            self.on_abort(Abort(rid, 499, "client disconnected"))

    def mark_dead(self, worker: Worker) -> None:
        """Fail its requests now (503) and route around it until it answers again."""
        worker.alive = False
        # A decode fails its own requests when their prefill dies (it may have moved a
        # retracted request to another prefill), so only a dead decode loses requests
        # here, and a dead prefill those it scores alone.
        lost = [f for f in self.inflight.values()
                if worker is (f.prefill if f.decode is None else f.decode)]
        log.error("%s %s silent for %.1f s: marked dead, failing %d requests", worker.role,
                  worker.endpoint, worker.clock.silence(self.loop.time()), len(lost))
        for flight in lost:
            reason = f"{worker.role} {worker.endpoint} is unavailable"
            # A frozen worker reads this when it wakes and frees the request's pages
            # instead of computing for a client that already has its 503.
            for w in {flight.prefill, worker}:
                w.dealer.send(Abort(flight.rid, 503, reason))
            self.relay([TokenPart.abort(flight.rid, 503, reason)])
        self.admin.on_dead(worker)

    # --- clients ---------------------------------------------------------------

    def on_client(self) -> None:
        self.read_client()
        # One accepted per client for every generate read in one go: sent once no
        # more messages wait (they would wake this again), ahead of anything else.
        if self.accepts and not readable(self.front.socket):
            accepts, self.accepts = self.accepts, {}
            for client, rids in accepts.items():
                self.front.send(client, Accepted(rids[0], self.boot, rids[1:] or None))

    def read_client(self) -> None:
        got = self.front.recv()
        if got is None:
            return
        identity, msg = got
        if isinstance(msg, Generate):
            self.on_generate(identity, msg)
        elif isinstance(msg, Abort):
            self.on_client_abort(identity, msg)
        elif isinstance(msg, Admin):
            if not self.followers.on_admin(identity, msg):     # one router to another
                self.admin.on_admin(identity, msg)
        elif isinstance(msg, Resume) and self.adoption is not None:
            self.adoption.on_resume(identity, msg)
        elif isinstance(msg, Ping):        # a client that heard nothing for a while
            self.front.send(identity, Pong(msg.seq, msg.sent_at, self.endpoint, self.boot))
        elif not (isinstance(msg, AdminReply) and self.followers.on_reply(identity, msg)):
            log.warning("dropping unexpected %s from client %r", msg.TYPE, identity[:32])

    def unclaimed(self, rid: str) -> bool:
        """An adopted request whose client has not resumed it yet."""
        return self.adoption is not None and rid in self.adoption.unclaimed

    @property
    def pushing(self) -> bool:
        """A weight push is under way here."""
        return self.admin.pushing

    @property
    def queued(self) -> Admission:
        """The requests waiting here, as admin commands read them (len, in, by rid)."""
        return self.admission

    def on_generate(self, client: bytes, msg: Generate) -> None:
        rid = msg.rid or uuid.uuid4().hex
        # Whatever comes next, so a client learns at once that a router listens here.
        self.accepts.setdefault(client, []).append(rid)
        if rid in self.inflight or rid in self.admission:
            self.to_client(client, Tokens.abort(rid, 409, f"rid {rid!r} is already in flight"))
            return
        tokens = request_tokens(msg)
        refused = self.refusal(msg, tokens)
        if refused is not None:
            log.info("rid=%s from client %r refused: %d %s", rid, client[:32], *refused)
            self.to_client(client, ended(rid, *refused, msg))
            return
        self.admission.add(Waiting(rid, client, msg.user, msg, tokens,
                                   self.admission.clock(self.loop.time()), msg.call))
        self.dispatch()
        self.refuse_overflow()

    def refuse_overflow(self) -> None:
        """The room is over --queue-size: the newest request of whoever holds most
        there (zpd/router/admission.py) ends 429, the newcomer's or another's."""
        over = self.admission.overflow()
        if over is not None:
            entry, status, why = over
            log.info("rid=%s from client %r refused: %d %s", entry.rid, entry.client[:32],
                     status, why)
            self.to_client(entry.client, ended(entry.rid, status, why, entry.msg))

    def refusal(self, msg: Generate, tokens: int) -> tuple[int, str] | None:
        """Why the request may never run (400, message), or None."""
        problem = msg.refused or self.cfg.prompt_limits.refusal(msg.input_ids, msg.text, msg.chat) or \
            user_problem(msg.user, msg.call)
        return (400, problem) if problem is not None else self.shares.too_big(tokens)

    def dispatch(self) -> None:
        """Route waiting requests, in the fair order of zpd/router/admission.py, while
        the router runs and fewer than --max-concurrent-requests are routed; each is
        charged to its client's share (zpd/router/shares.py) until its end."""
        while self.admission and not self.holding and len(self.inflight) < self.max_concurrent:
            entry = self.admission.next(self.shares)
            if entry is None:
                return
            self.shares.take(entry.client, entry.rid, entry.tokens, entry.user, entry.call)
            self.route(entry.client, entry.msg, entry.rid)

    def expire_waiting(self, now: float) -> None:
        queue = self.admission
        queue.hold(self.frozen, now)
        for entry in queue.expired(now):
            log.info("rid=%s from client %r: queue timeout", entry.rid, entry.client[:32])
            why = timeout_message(queue.clock(now) - entry.since, queue.queue_timeout) \
                if self.memory_released else queue.timeout_message(entry, now)
            self.to_client(entry.client, ended(entry.rid, QUEUE_TIMEOUT, why, entry.msg))

    def route(self, client: bytes, msg: Generate, rid: str) -> None:
        """To a prefill and a decode; a scoring request (max_new_tokens 0) to a prefill
        alone: it computes the prompt and answers, no KV moves."""
        scoring = msg.scores_only
        prefill, decode = self.pick_prefill(msg), None if scoring else self.pick("decode")
        if prefill is None or (decode is None and not scoring):
            self.shares.release(rid)
            self.to_client(client, Tokens.abort(rid, 503, "no live prefill and decode worker"))
            return
        room = new_room()
        self.inflight[rid] = InFlight(rid, client, prefill, decode,
                                      routed=msg.sampling.routing is not None)
        routed = Generate(rid, msg.input_ids, msg.sampling, msg.stream, room, 0,
                          prefill.endpoint, decode.endpoint if decode else "", msg.text, msg.chat,
                          owner=client.hex(), user=msg.user)
        log.info("rid=%r room=%d -> prefill %s, %s", rid, room, prefill.endpoint,
                 f"decode {decode.endpoint}" if decode else "scored there")
        frames = encode(routed)                 # once for both
        for w in (decode, prefill) if decode else (prefill,):
            w.load += 1
            w.dealer.send_frames(frames)

    def owner(self, rid: str) -> bytes | None:
        """The identity of the client that submitted `rid` (None: no such request here)."""
        if rid in self.admission:
            return self.admission.owner(rid)
        flight = self.inflight.get(rid)
        return None if flight is None else flight.client

    def on_client_abort(self, client: bytes, msg: Abort) -> None:
        """A client ends only its own requests, and always with 499: the status is what
        every component logs and counts, so a client must not choose it. Another
        client's abort is dropped without an answer (an answer would tell it the rid
        exists); the admin `abort` ends any request."""
        owner = self.owner(msg.rid)
        if owner is None:
            return
        if owner != client:
            log.warning("abort of rid=%r from client %r dropped: it does not own it",
                        msg.rid, client[:32])
            return
        self.on_abort(Abort(msg.rid, 499, client_reason(msg.reason)))

    def on_abort(self, msg: Abort) -> None:
        """End `msg.rid` with the status given (callers are the router's own: a client's
        abort comes through `on_client_abort`)."""
        if msg.rid in self.admission:
            self.end_queued(msg.rid, msg.status or 499, msg.reason or "aborted")
        flight = self.inflight.get(msg.rid)
        if flight is None:
            return
        if flight.decode is not None:
            flight.decode.dealer.send(msg)
        flight.prefill.dealer.send(msg)

    def end_queued(self, rid: str, status: int, reason: str) -> None:
        entry = self.admission.remove(rid)
        self.to_client(entry.client, ended(rid, status, reason, entry.msg))

    @property
    def holding(self) -> bool:
        """New requests wait here: `frozen`, or memory released (zpd/router/memory.py)."""
        return self.frozen or self.memory_released

    @property
    def frozen(self) -> bool:
        """Holding with the queue's clock stopped: paused, or a weight push under way
        (here, or at the coordinator this router follows)."""
        return self.paused is not None or self.pushing or \
            (self.coordinator is not None and self.coordinator.pushing)

    @property
    def memory_released(self) -> bool:
        coordinator = self.coordinator
        return bool(self.released) or (coordinator is not None and coordinator.memory_released)

    def running(self) -> int:
        """Requests routed to the workers, here and by the routers following this one."""
        return len(self.inflight) + self.followers.inflight()

    def hold(self, mode: PauseMode) -> None:
        """Paused: new requests wait; pause(abort) ends those waiting already."""
        self.paused = mode
        if mode is PauseMode.ABORT:
            for rid in list(self.queued):
                self.end_queued(rid, 499, "aborted by pause(abort)")

    def unpause(self) -> None:
        """After a successful continue (or the end of a weight push): route what waits,
        and so do the routers that follow this one."""
        self.paused = None
        self.followers.tell(lambda _: None, self.cfg.peer_timeout)
        self.dispatch()

    # --- workers ----------------------------------------------------------------

    def on_worker(self, worker: Worker) -> None:
        frames = worker.dealer.recv_frames()
        if frames is None:
            return
        worker.clock.heard(self.loop.time())
        if not worker.alive:
            worker.alive = True
            log.warning("%s %s answers again: routing to it", worker.role, worker.endpoint)
        if is_step(frames[0]):                   # a decode step's tokens: passed on unread
            self.relayer.step(worker, frames)
            return
        msg = worker.dealer.read([f.bytes for f in frames])
        if msg is None:
            return
        if isinstance(msg, Tokens) and msg.first:
            self.on_first_tokens(worker, msg)
        elif isinstance(msg, Tokens):
            self.relay(msg.unpack(), worker)
        elif isinstance(msg, Rows):
            self.relayer.rows(msg, worker)
        elif isinstance(msg, AdminReply):
            self.admin.on_reply(worker, msg)
        elif isinstance(msg, Adopted) and self.adoption is not None:
            self.adoption.on_adopted(worker, msg)
        elif not isinstance(msg, Pong):
            log.warning("dropping unexpected %s from %s", msg.TYPE, worker.endpoint)

    def on_first_tokens(self, worker: Worker, msg: Tokens) -> None:
        """Streamed requests' first tokens from their prefill, ahead of the KV write."""
        if worker.role != "prefill":
            log.warning("dropping first tokens from %s %s: only a prefill sends those",
                        worker.role, worker.endpoint)
            return
        for part in msg.unpack():
            flight = self.inflight.get(part.rid)
            if flight is None or flight.sent or len(part.token_ids) != 1 or part.finished:
                continue                          # the decode's copy came first
            flight.early, flight.sent = FirstToken.of(part), 1
            self.to_client(flight.client, Tokens.pack([part]))

    def relay(self, parts: list[TokenPart], sender: Worker | None = None) -> None:
        """Decode tokens settled part by part (zpd/router/relay.py `Relay.parts`)."""
        self.relayer.parts(parts, sender)

    # --- process ----------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        self.loop.run(stop)

    def close(self) -> None:
        if self.coordinator is not None:
            self.coordinator.close()
        for w in self.workers:
            w.dealer.close()
        self.front.close()
        self.loop.close()
        self.security.close()


def client_reason(reason: str) -> str:
    """A client's abort reason as it may travel on: short, printable, one line."""
    text = "".join(c if c.isprintable() else " " for c in reason[:MAX_REASON]).strip()
    return text or "aborted by client"

