"""The router's admin commands: each is fanned out to the workers and answered once
all reply or its timeout passes; pause, continue and abort also change the router's
own state (its pause mode, the requests queued while paused)."""
from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from zpd.router.admin_args import BadArgs, admin_timeout, check_args
from zpd.router.weight_sync import BLOCKED, COMMANDS as SYNC_COMMANDS, RouterWeightSync
from zpd.wire.loop import Timer
from zpd.wire.protocol import Abort, Admin, AdminReply

if TYPE_CHECKING:
    from zpd.router.server import RouterServer, Worker

log = logging.getLogger("zpd.router.admin")

Reply = Callable[[bool, dict], None]


@dataclass(eq=False)
class Fanout:
    """One admin command sent to many workers, done once all reply or time runs out."""
    on_done: Callable[[list[dict]], None]
    waiting: set[str]
    replies: list[dict] = field(default_factory=list)
    timer: Timer | None = None


class RouterAdmin:
    """Admin commands on one router; owned by its RouterServer, whose state
    (workers, pause mode, queued and in-flight requests) it reads and changes."""

    def __init__(self, server: RouterServer) -> None:
        self.server = server
        self.fanouts: dict[str, Fanout] = {}
        self.req_ids = itertools.count(1)
        self.sync = RouterWeightSync(self)

    def on_admin(self, client: bytes, msg: Admin) -> None:
        """Check the arguments, then run the command: bad input is answered 400 and
        changes nothing; a command that fails here is answered 500, never raised."""
        reply, args = self._replier(client, msg), dict(msg.args)
        log.info("admin %r %.400r", msg.command, args)     # bounded: a tensor payload is MiBs
        try:
            timeout = admin_timeout(args.pop("timeout", None), self.server.cfg.admin_timeout_s)
            check_args(msg.command, args)
            self._run(msg.command, args, timeout, reply)
        except BadArgs as e:
            reply(False, {"status": 400, "error": str(e)})
        except Exception as e:  # an admin command must answer, whatever happened
            log.exception("admin %r failed", msg.command)
            reply(False, {"status": 500, "error": f"{type(e).__name__}: {e}"})

    def _replier(self, client: bytes, msg: Admin) -> Reply:
        server = self.server

        def reply(ok: bool, result: dict) -> None:
            server.front.send(client, AdminReply(msg.req_id, ok, {
                "router": server.endpoint, "command": msg.command, "paused": server.paused,
                "queued": len(server.queued), "inflight": len(server.inflight)} | result
                | ({"counters": server.tally.fields()} if msg.command == "status" else {})))
        return reply

    def _run(self, command: str, args: dict, timeout: float, reply: Reply) -> None:
        server = self.server
        if command in BLOCKED and self.sync.active is not None:
            reply(False, {"status": 409, "error": f"{command} while {self.sync.active}: wait "
                                                  "for it", "workers": []})
        elif command in SYNC_COMMANDS:
            self.sync.run(command, args, timeout, reply)
        elif command == "abort":
            self.abort(args, reply)
        elif command == "abort_all":
            self.abort_all(reply)
        elif command == "pause":
            self.pause(args, timeout, reply)
        elif command == "continue":
            self.continue_(args, timeout, reply)
        elif command in ("update_weights", "release_memory") and server.paused is None \
                and server.inflight:
            # an idle prefill would take the new weights (or drop its memory) while its
            # decode, still running, refuses: all workers must see the same state
            reply(False, {"status": 409, "error": f"{command} while requests are in flight: "
                                                  "pause first", "workers": []})
        else:
            self.fan_out(command, args, server.workers, timeout,
                         lambda replies: reply(all(r["ok"] for r in replies), {"workers": replies}))

    def abort(self, args: dict, reply: Reply) -> None:
        server, rid = self.server, args.get("rid")
        if rid in server.queued:
            server.end_queued(rid, 499, "aborted by admin")
            reply(True, {"rid": rid, "state": "queued"})
        elif rid in server.inflight:
            server.on_abort(Abort(rid, 499, "aborted by admin"))
            reply(True, {"rid": rid, "state": "inflight"})
        else:
            reply(False, {"rid": rid, "status": 404, "error": f"unknown rid {rid!r}"})

    def abort_all(self, reply: Reply) -> None:
        """End every request queued or in flight here, whoever sent it, with 499."""
        server = self.server
        queued, running = list(server.queued), list(server.inflight)
        for rid in queued:
            server.end_queued(rid, 499, "aborted by admin (abort_all)")
        for rid in running:
            server.on_abort(Abort(rid, 499, "aborted by admin (abort_all)"))
        reply(True, {"aborted": len(queued) + len(running)})

    def pause(self, args: dict, timeout: float, reply: Reply) -> None:
        server, mode = self.server, args.get("mode", "retract")
        if server.paused is not None and server.paused != mode:
            reply(False, {"status": 409, "error": f"already paused ({server.paused}); continue first"})
            return
        server.paused = mode                      # new requests queue here from now on
        if mode == "abort":
            for rid in list(server.queued):
                server.end_queued(rid, 499, "aborted by pause(abort)")
        # Decodes first: a prefill that paused first would drop requests mid-write and
        # tell their decodes (kv_failed) before those knew of a pause, failing (499)
        # what a retract must hold. Once the decodes have paused, the prefills have
        # nothing in flight that a decode still waits for.
        prefills = [w for w in server.workers if w.role == "prefill"]
        decodes = [w for w in server.workers if w.role == "decode"]
        until = server.loop.time() + timeout       # both rounds together, as the caller asked

        def then_prefills(d_replies: list[dict]) -> None:
            left = until - server.loop.time()
            self.fan_out("pause", args, prefills, left, lambda p_replies: reply(
                all(r["ok"] for r in p_replies + d_replies), {"workers": p_replies + d_replies}))

        self.fan_out("pause", args, decodes, timeout * 0.75, then_prefills)

    def continue_(self, args: dict, timeout: float, reply: Reply) -> None:
        """`continue`. Prefills first: the ones that answer are live, and decodes send
        their recomputes only to those."""
        server = self.server
        prefills = [w for w in server.workers if w.role == "prefill"]
        decodes = [w for w in server.workers if w.role == "decode"]

        def then_decodes(p_replies: list[dict]) -> None:
            live = [r["endpoint"] for r in p_replies if r["ok"]]
            # First tokens the client has from a prefill but no decode confirmed: a
            # decode holding such a request resumes after that token, not before it.
            early = {f.rid: f.early for f in server.inflight.values()
                     if f.early is not None and f.from_decode == 0}
            self.fan_out("continue", args | {"prefills": live, "early": early}, decodes, timeout,
                         lambda d_replies: done(p_replies + d_replies))

        def done(replies: list[dict]) -> None:
            ok = all(r["ok"] for r in replies if r["role"] == "decode") and \
                any(r["ok"] for r in replies if r["role"] == "prefill")
            if ok:
                server.unpause()
            reply(ok, {"workers": replies})

        self.fan_out("continue", args, prefills, timeout, then_decodes)

    # --- fan-out ------------------------------------------------------------------

    def fan_out(self, command: str, args: dict | Callable[[Worker], dict], targets: list[Worker],
                timeout: float, on_done: Callable[[list[dict]], None]) -> None:
        """Send `command` to `targets` (`args` may be a function of the worker); call
        `on_done` with one reply per target once all answered or `timeout` passed."""
        key = f"{next(self.req_ids)}"
        live = [w for w in targets if w.alive]
        fan = self.fanouts[key] = Fanout(on_done, {w.endpoint for w in live})
        fan.replies = [{"ok": False, "endpoint": w.endpoint, "role": w.role, "status": 503,
                        "error": "worker unavailable (no heartbeat)"} for w in targets if not w.alive]
        fan.timer = self.server.loop.call_later(timeout, self._done, key)
        for w in live:
            w.dealer.send(Admin(command, args(w) if callable(args) else args, key))
        if not live:
            self._done(key)

    def on_reply(self, worker: Worker, msg: AdminReply) -> None:
        fan = self.fanouts.get(msg.req_id)
        if fan is None or worker.endpoint not in fan.waiting:
            return
        fan.waiting.discard(worker.endpoint)
        fan.replies.append({"ok": msg.ok} | msg.result | {"endpoint": worker.endpoint,
                                                           "role": worker.role})
        if not fan.waiting:
            self._done(msg.req_id)

    def _done(self, key: str) -> None:
        fan = self.fanouts.pop(key, None)
        if fan is None:
            return
        if fan.timer is not None:
            fan.timer.cancel()
        roles = {w.endpoint: w.role for w in self.server.workers}
        fan.on_done(fan.replies + [{"ok": False, "endpoint": ep, "role": roles[ep], "status": 504,
                                    "error": "no answer before the timeout"}
                                   for ep in sorted(fan.waiting)])
