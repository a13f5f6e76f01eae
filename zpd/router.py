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

import orjson
import zmq

from zpd.config import RouterConfig
from zpd.loop import Loop, Timer
from zpd.net import Dealer, Router
from zpd.protocol import Abort, Admin, AdminReply, Generate, Message, Pong, Token

log = logging.getLogger("zpd.router")


@dataclass(eq=False)
class Worker:
    role: str
    endpoint: str
    dealer: Dealer
    load: int = 0


@dataclass(eq=False)
class InFlight:
    rid: str
    client: bytes
    prefill: Worker
    decode: Worker


@dataclass(eq=False)
class Fanout:
    """One admin command sent to many workers, answered once all reply or time runs out."""
    client: bytes
    req_id: str
    command: str
    waiting: set[str]
    replies: list[dict] = field(default_factory=list)
    timer: Timer | None = None


class RouterServer:
    def __init__(self, cfg: RouterConfig, ctx: zmq.Context) -> None:
        self.cfg, self.loop = cfg, Loop()
        self.front = Router(ctx, cfg.host, cfg.port)
        self.endpoint = self.front.endpoint
        self.workers = [Worker(role, ep, Dealer(ctx, ep, identity=f"router@{self.endpoint}".encode()))
                        for role, eps in (("prefill", cfg.prefill), ("decode", cfg.decode))
                        for ep in eps]
        self.inflight: dict[str, InFlight] = {}
        self.fanouts: dict[str, Fanout] = {}
        self.req_ids = itertools.count(1)
        self.loop.add_socket(self.front, self.on_client)
        for w in self.workers:
            self.loop.add_socket(w.dealer, lambda w=w: self.on_worker(w))

    def pick(self, role: str) -> Worker:
        candidates = [w for w in self.workers if w.role == role]
        least = min(w.load for w in candidates)
        return random.choice([w for w in candidates if w.load == least])

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
        if rid in self.inflight:
            self.front.send(client, Token(rid, [], [], True, {
                "type": "abort", "status_code": 409, "message": f"rid {rid!r} is already in flight"}))
            return
        prefill, decode = self.pick("prefill"), self.pick("decode")
        room = random.getrandbits(63)
        self.inflight[rid] = InFlight(rid, client, prefill, decode)
        prefill.load += 1
        decode.load += 1
        routed = Generate(rid, msg.input_ids, msg.sampling, msg.stream, room, 0,
                          prefill.endpoint, decode.endpoint, msg.text)
        log.info("rid=%s room=%d -> prefill %s, decode %s", rid, room, prefill.endpoint, decode.endpoint)
        decode.dealer.send(routed)
        prefill.dealer.send(routed)

    def on_abort(self, msg: Abort) -> None:
        flight = self.inflight.get(msg.rid)
        if flight is None:
            return
        flight.decode.dealer.send(msg)
        flight.prefill.dealer.send(msg)

    # --- workers ----------------------------------------------------------------

    def on_worker(self, worker: Worker) -> None:
        msg = worker.dealer.recv()
        if isinstance(msg, Token):
            self.on_token(msg)
        elif isinstance(msg, AdminReply):
            self.on_admin_reply(worker, msg)
        elif msg is not None and not isinstance(msg, Pong):
            log.warning("dropping unexpected %s from %s", msg.TYPE, worker.endpoint)

    def on_token(self, msg: Token) -> None:
        flight = self.inflight.get(msg.rid)
        if flight is None:
            return
        self.front.send(flight.client, msg)
        if msg.finished:
            del self.inflight[msg.rid]
            flight.prefill.load -= 1
            flight.decode.load -= 1

    # --- admin ------------------------------------------------------------------

    def on_admin(self, client: bytes, msg: Admin) -> None:
        args = dict(msg.args)
        try:
            timeout = float(args.pop("timeout", self.cfg.admin_timeout_s))
        except (TypeError, ValueError):
            timeout = self.cfg.admin_timeout_s
        key = f"{next(self.req_ids)}"
        fan = self.fanouts[key] = Fanout(client, msg.req_id, msg.command,
                                         {w.endpoint for w in self.workers})
        fan.timer = self.loop.call_later(timeout, self._admin_done, key)
        for w in self.workers:
            w.dealer.send(Admin(msg.command, args, key))

    def on_admin_reply(self, worker: Worker, msg: AdminReply) -> None:
        fan = self.fanouts.get(msg.req_id)
        if fan is None or worker.endpoint not in fan.waiting:
            return
        fan.waiting.discard(worker.endpoint)
        fan.replies.append({"ok": msg.ok} | msg.result | {"endpoint": worker.endpoint,
                                                           "role": worker.role})
        if not fan.waiting:
            self._admin_done(msg.req_id)

    def _admin_done(self, key: str) -> None:
        fan = self.fanouts.pop(key, None)
        if fan is None:
            return
        if fan.timer is not None:
            fan.timer.cancel()
        replies = fan.replies + [{"ok": False, "endpoint": ep, "error": "no answer before the timeout",
                                  "status": 504} for ep in sorted(fan.waiting)]
        result = {"router": self.endpoint, "command": fan.command, "workers": replies,
                  "inflight": len(self.inflight)}
        self.front.send(fan.client, AdminReply(fan.req_id, all(r["ok"] for r in replies), result))

    # --- process ----------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        self.loop.run(stop)

    def close(self) -> None:
        for w in self.workers:
            w.dealer.close()
        self.front.close()
        self.loop.close()


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
