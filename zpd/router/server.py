"""The router: picks a prefill and a decode for each request, relays tokens back,
fans admin commands out to every worker."""
from __future__ import annotations

import itertools
import logging
import os
import random
import signal
import threading
import uuid
from dataclasses import dataclass, field
from typing import Callable

import orjson
import zmq

from zpd.config import RouterConfig
from zpd.wire.liveness import PeerClock
from zpd.wire.loop import Loop, Timer
from zpd.wire.net import Dealer, Router
from zpd.wire.security import ROUTER_POLICY, Security
from zpd.wire.protocol import Abort, Admin, AdminReply, Generate, Ping, Pong, Token, Tokens, new_room

log = logging.getLogger("zpd.router.server")


@dataclass(eq=False)
class Worker:
    role: str
    endpoint: str
    dealer: Dealer
    clock: PeerClock
    load: int = 0
    alive: bool = True


@dataclass(eq=False)
class InFlight:
    rid: str
    client: bytes
    prefill: Worker
    decode: Worker
    sent: int = 0                        # output tokens passed on to the client
    from_decode: int = 0                 # output tokens the decode has sent
    early: tuple[int, str] | None = None  # the first token, straight from the prefill


@dataclass(eq=False)
class Fanout:
    """One admin command sent to many workers, done once all reply or time runs out."""
    on_done: Callable[[list[dict]], None]
    waiting: set[str]
    replies: list[dict] = field(default_factory=list)
    timer: Timer | None = None


class RouterServer:
    def __init__(self, cfg: RouterConfig, ctx: zmq.Context) -> None:
        self.cfg, self.loop = cfg, Loop()
        self.security = Security(cfg.curve_keys, ctx)
        self.front = Router(ctx, cfg.host, cfg.port, self.security.server_options(ROUTER_POLICY))
        self.endpoint = self.front.endpoint
        # The pid tells workers that a router restarted on the same port is another
        # process: the old one's requests are orphans they must end.
        identity = f"router@{self.endpoint}/{os.getpid()}".encode()
        self.workers = [Worker(role, ep, Dealer(ctx, ep, identity=identity,
                                                opts=self.security.client_options()),
                               PeerClock(self.loop.time()))
                        for role, eps in (("prefill", cfg.prefill), ("decode", cfg.decode))
                        for ep in eps]
        self.inflight: dict[str, InFlight] = {}
        self.fanouts: dict[str, Fanout] = {}
        self.paused: str | None = None
        self.queued: dict[str, tuple[bytes, Generate]] = {}     # arrived while paused
        self.req_ids = itertools.count(1)
        self.loop.add_socket(self.front, self.on_client)
        for w in self.workers:
            self.loop.add_socket(w.dealer, lambda w=w: self.on_worker(w))
        self.pings = itertools.count()
        self.loop.every(cfg.heartbeat, self.heartbeat)

    def pick(self, role: str) -> Worker | None:
        candidates = [w for w in self.workers if w.role == role and w.alive]
        if not candidates:
            return None
        least = min(w.load for w in candidates)
        return random.choice([w for w in candidates if w.load == least])

    # --- liveness ----------------------------------------------------------------

    def heartbeat(self) -> None:
        now, seq = self.loop.time(), next(self.pings)
        for w in self.workers:
            if w.alive and w.clock.silent(now, self.cfg.peer_timeout):
                self.mark_dead(w)
            w.dealer.send(Ping(seq, now, self.endpoint))
            w.clock.pinged(now)
        self.probe_clients(Ping(seq, now, self.endpoint))

    def probe_clients(self, ping: Ping) -> None:
        """A client that hung up (crashed, closed its socket) can take no tokens: end its
        requests now instead of generating to max_new_tokens for no one. A ping it
        ignores is the probe: ZeroMQ refuses it at once once the client is gone."""
        clients = {f.client for f in self.inflight.values()} | {c for c, _ in self.queued.values()}
        for client in clients:
            self.to_client(client, ping)

    def to_client(self, client: bytes, msg) -> None:
        if not self.front.send(client, msg) and self.front.last_send_unreachable:
            self.client_gone(client)

    def client_gone(self, client: bytes) -> None:
        queued = [rid for rid, (c, _) in self.queued.items() if c == client]
        running = [rid for rid, f in self.inflight.items() if f.client == client]
        if not queued and not running:
            return
        log.warning("client %r disconnected: ending its %d requests", client[:32],
                    len(queued) + len(running))
        for rid in queued:
            del self.queued[rid]
        for rid in running:
            self.on_abort(Abort(rid, 499, "client disconnected"))

    def mark_dead(self, worker: Worker) -> None:
        """Fail its requests now (503) and route around it until it answers again."""
        worker.alive = False
        # A decode fails its own requests when their prefill dies (it may have moved a
        # retracted request to another prefill), so only a dead decode loses requests here.
        lost = [f for f in self.inflight.values() if worker is f.decode]
        log.error("%s %s silent for %.1f s: marked dead, failing %d requests", worker.role,
                  worker.endpoint, worker.clock.silence(self.loop.time()), len(lost))
        for flight in lost:
            reason = f"decode {worker.endpoint} is unavailable"
            flight.prefill.dealer.send(Abort(flight.rid, 503, reason))
            # A frozen decode reads this when it wakes and frees the request's pages
            # instead of generating for a client that already has its 503.
            worker.dealer.send(Abort(flight.rid, 503, reason))
            self.on_token(Token(flight.rid, [], [], True, {"type": "abort", "status_code": 503,
                                                          "message": reason}))

    # --- clients ---------------------------------------------------------------

    def on_client(self) -> None:
        got = self.front.recv()
        if got is None:
            return
        identity, msg = got
        if isinstance(msg, Generate):
            self.on_generate(identity, msg)
        elif isinstance(msg, Abort):
            self.on_abort(msg)
        elif isinstance(msg, Admin):
            self.on_admin(identity, msg)
        else:
            log.warning("dropping unexpected %s from client %r", msg.TYPE, identity[:32])

    def on_generate(self, client: bytes, msg: Generate) -> None:
        rid = msg.rid or uuid.uuid4().hex
        if rid in self.inflight or rid in self.queued:
            self.front.send(client, Token(rid, [], [], True, {
                "type": "abort", "status_code": 409, "message": f"rid {rid!r} is already in flight"}))
            return
        if self.paused is not None:
            self.queued[rid] = (client, msg)     # runs after continue
            return
        self.route(client, msg, rid)

    def route(self, client: bytes, msg: Generate, rid: str | None = None) -> None:
        rid = rid or msg.rid
        prefill, decode = self.pick("prefill"), self.pick("decode")
        if prefill is None or decode is None:
            self.front.send(client, Token(rid, [], [], True, {
                "type": "abort", "status_code": 503, "message": "no live prefill and decode worker"}))
            return
        room = new_room()
        self.inflight[rid] = InFlight(rid, client, prefill, decode)
        prefill.load += 1
        decode.load += 1
        routed = Generate(rid, msg.input_ids, msg.sampling, msg.stream, room, 0,
                          prefill.endpoint, decode.endpoint, msg.text)
        log.info("rid=%s room=%d -> prefill %s, decode %s", rid, room, prefill.endpoint, decode.endpoint)
        decode.dealer.send(routed)
        prefill.dealer.send(routed)

    def on_abort(self, msg: Abort) -> None:
        if msg.rid in self.queued:
            self._end_queued(msg.rid, msg.status or 499, msg.reason or "aborted")
        flight = self.inflight.get(msg.rid)
        if flight is None:
            return
        flight.decode.dealer.send(msg)
        flight.prefill.dealer.send(msg)

    def _end_queued(self, rid: str, status: int, reason: str) -> None:
        client, msg = self.queued.pop(rid)
        self.front.send(client, Token(rid, [], [], True, {"type": "abort", "status_code": status,
                                                          "message": reason},
                                      {"prompt_tokens": len(msg.input_ids), "completion_tokens": 0,
                                       "retractions": 0}))

    # --- workers ----------------------------------------------------------------

    def on_worker(self, worker: Worker) -> None:
        msg = worker.dealer.recv()
        if msg is None:
            return
        worker.clock.heard(self.loop.time())
        if not worker.alive:
            worker.alive = True
            log.warning("%s %s answers again: routing to it", worker.role, worker.endpoint)
        if isinstance(msg, Token) and worker.role == "prefill":
            self.on_first_token(msg)
        elif isinstance(msg, Token):
            self.on_token(msg)
        elif isinstance(msg, Tokens):
            self.on_tokens(msg)
        elif isinstance(msg, AdminReply):
            self.on_admin_reply(worker, msg)
        elif not isinstance(msg, Pong):
            log.warning("dropping unexpected %s from %s", msg.TYPE, worker.endpoint)

    def on_first_token(self, msg: Token) -> None:
        """A streamed request's first token from its prefill, ahead of the KV write."""
        flight = self.inflight.get(msg.rid)
        if flight is None or flight.sent or len(msg.token_ids) != 1 or msg.finished:
            return                                # the decode's copy came first
        flight.early, flight.sent = (msg.token_ids[0], msg.weight_versions[0]), 1
        self.to_client(flight.client, msg)

    def on_token(self, msg: Token) -> None:
        flight, part = self._settle(msg)
        if part is not None:
            self.to_client(flight.client, part)

    def on_tokens(self, msg: Tokens) -> None:
        """A decode step's tokens: one message on to each client concerned."""
        by_client: dict[bytes, list[Token]] = {}
        for got in msg.unpack():
            flight, part = self._settle(got)
            if part is not None:
                by_client.setdefault(flight.client, []).append(part)
        for client, parts in by_client.items():
            self.to_client(client, parts[0] if len(parts) == 1 else Tokens.pack(parts))

    def _settle(self, part: Token) -> tuple[InFlight | None, Token | None]:
        """The request's flight and what of the decode's `part` the client has not had
        (None: nothing); the flight is forgotten once it finishes."""
        flight = self.inflight.get(part.rid)
        if flight is None:
            return None, None
        start, n = flight.from_decode, len(part.token_ids)
        flight.from_decode += n
        skip = min(n, max(0, flight.sent - start))    # the prefill's first token went ahead
        flight.sent = max(flight.sent, start + n)
        if skip:
            part = Token(part.rid, part.token_ids[skip:], part.weight_versions[skip:],
                         part.finished, part.finish, part.meta)
        if part.finished:
            del self.inflight[part.rid]
            flight.prefill.load -= 1
            flight.decode.load -= 1
        return flight, (part if part.token_ids or part.finished else None)

    # --- admin ------------------------------------------------------------------

    def on_admin(self, client: bytes, msg: Admin) -> None:
        args = dict(msg.args)
        try:
            timeout = float(args.pop("timeout", self.cfg.admin_timeout_s))
        except (TypeError, ValueError):
            timeout = self.cfg.admin_timeout_s

        def reply(ok: bool, result: dict) -> None:
            self.front.send(client, AdminReply(msg.req_id, ok, {
                "router": self.endpoint, "command": msg.command, "paused": self.paused,
                "queued": len(self.queued), "inflight": len(self.inflight)} | result))

        log.info("admin %s %s", msg.command, args)
        if msg.command == "abort":
            self.admin_abort(args, reply)
        elif msg.command == "pause":
            self.admin_pause(args, timeout, reply)
        elif msg.command == "continue":
            self.admin_continue(args, timeout, reply)
        elif msg.command == "update_weights" and self.paused is None and self.inflight:
            # an idle prefill would take the new weights while its decode keeps the old ones
            reply(False, {"status": 409, "error": "update_weights while requests are in flight: "
                                                  "pause first", "workers": []})
        else:
            self.fan_out(msg.command, args, self.workers, timeout,
                         lambda replies: reply(all(r["ok"] for r in replies), {"workers": replies}))

    def admin_abort(self, args: dict, reply) -> None:
        rid = args.get("rid")
        if rid in self.queued:
            self._end_queued(rid, 499, "aborted by admin")
            reply(True, {"rid": rid, "state": "queued"})
        elif rid in self.inflight:
            self.on_abort(Abort(rid, 499, "aborted by admin"))
            reply(True, {"rid": rid, "state": "inflight"})
        else:
            reply(False, {"rid": rid, "status": 404, "error": f"unknown rid {rid!r}"})

    def admin_pause(self, args: dict, timeout: float, reply) -> None:
        mode = args.get("mode", "retract")
        if self.paused is not None and self.paused != mode:
            reply(False, {"status": 409, "error": f"already paused ({self.paused}); continue first"})
            return
        self.paused = mode                      # new requests queue here from now on
        if mode == "abort":
            for rid in list(self.queued):
                self._end_queued(rid, 499, "aborted by pause(abort)")
        self.fan_out("pause", args, self.workers, timeout,
                     lambda replies: reply(all(r["ok"] for r in replies), {"workers": replies}))

    def admin_continue(self, args: dict, timeout: float, reply) -> None:
        """Prefills first: the ones that answer are live, and decodes send their
        recomputes only to those."""
        prefills = [w for w in self.workers if w.role == "prefill"]
        decodes = [w for w in self.workers if w.role == "decode"]

        def then_decodes(p_replies: list[dict]) -> None:
            live = [r["endpoint"] for r in p_replies if r["ok"]]
            # First tokens the client has from a prefill but no decode confirmed: a
            # decode holding such a request resumes after that token, not before it.
            early = {f.rid: list(f.early) for f in self.inflight.values()
                     if f.early is not None and f.from_decode == 0}
            self.fan_out("continue", args | {"prefills": live, "early": early}, decodes, timeout,
                         lambda d_replies: done(p_replies + d_replies))

        def done(replies: list[dict]) -> None:
            ok = all(r["ok"] for r in replies if r["role"] == "decode") and \
                any(r["ok"] for r in replies if r["role"] == "prefill")
            if ok:
                self.paused = None
                for rid in list(self.queued):
                    client, msg = self.queued.pop(rid)
                    self.route(client, msg)
            reply(ok, {"workers": replies})

        self.fan_out("continue", args, prefills, timeout, then_decodes)

    def fan_out(self, command: str, args: dict, targets: list[Worker], timeout: float,
                on_done: Callable[[list[dict]], None]) -> None:
        key = f"{next(self.req_ids)}"
        live = [w for w in targets if w.alive]
        fan = self.fanouts[key] = Fanout(on_done, {w.endpoint for w in live})
        fan.replies = [{"ok": False, "endpoint": w.endpoint, "role": w.role, "status": 503,
                        "error": "worker unavailable (no heartbeat)"} for w in targets if not w.alive]
        fan.timer = self.loop.call_later(timeout, self._fan_done, key)
        for w in live:
            w.dealer.send(Admin(command, args, key))
        if not live:
            self._fan_done(key)

    def on_admin_reply(self, worker: Worker, msg: AdminReply) -> None:
        fan = self.fanouts.get(msg.req_id)
        if fan is None or worker.endpoint not in fan.waiting:
            return
        fan.waiting.discard(worker.endpoint)
        fan.replies.append({"ok": msg.ok} | msg.result | {"endpoint": worker.endpoint,
                                                           "role": worker.role})
        if not fan.waiting:
            self._fan_done(msg.req_id)

    def _fan_done(self, key: str) -> None:
        fan = self.fanouts.pop(key, None)
        if fan is None:
            return
        if fan.timer is not None:
            fan.timer.cancel()
        roles = {w.endpoint: w.role for w in self.workers}
        fan.on_done(fan.replies + [{"ok": False, "endpoint": ep, "role": roles[ep], "status": 504,
                                    "error": "no answer before the timeout"}
                                   for ep in sorted(fan.waiting)])

    # --- process ----------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        self.loop.run(stop)

    def close(self) -> None:
        for w in self.workers:
            w.dealer.close()
        self.front.close()
        self.loop.close()
        self.security.close()


def serve_router(cfg: RouterConfig) -> int:
    ctx = zmq.Context()
    server = RouterServer(cfg, ctx)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: (stop.set(), server.loop.stop()))
    if cfg.ready_file:
        with open(cfg.ready_file + ".tmp", "wb") as f:
            f.write(orjson.dumps({"role": "router", "endpoint": server.endpoint, "pid": os.getpid()}))
        os.replace(cfg.ready_file + ".tmp", cfg.ready_file)
    log.warning("router ready on %s: prefill %s, decode %s", server.endpoint,
                ",".join(cfg.prefill), ",".join(cfg.decode))
    try:
        server.run(stop)
    finally:
        server.close()
        ctx.destroy(linger=0)
    return 0
