"""The router's admin commands: each arrives as its record (zpd/wire/admin.py, checked
there), is fanned out to the workers and answered once all reply or its timeout
passes; pause, continue and abort also change the router's own state (its pause
mode, the requests queued while paused). Multi-round commands run `in_order`: each
round is one fan-out, given the replies of the rounds before it."""
from __future__ import annotations

import dataclasses
import itertools
import logging
from typing import Callable, Collection, Protocol

from zpd.config import RouterConfig
from zpd.router.flights import Fanout, InFlight, Worker
from zpd.router.hooks import HOLD_SHARE, Coordinator, Peers
from zpd.router.memory import ReleasedMemory
from zpd.router.tally import Tally
from zpd.wire.admin import (COMMANDS, AbortAll, AbortRequest, AdminCommand, Continue, Pause, ReleaseMemory, ResumeMemory, Status, UpdateWeights, parse, split_timeout)
from zpd.wire.admin_fields import PauseMode
from zpd.wire.admin_reply import AdminResult, WorkerReply, to_wire
from zpd.wire.loop import Loop
from zpd.wire.protocol import Abort, Admin, AdminReply, Message
from zpd.wire.status import StatusError

log = logging.getLogger("zpd.router.admin")

Reply = Callable[[bool, dict], None]
Replies = Callable[[list[WorkerReply]], None]
Command = AdminCommand | Callable[[Worker], AdminCommand]     # one for all, or one per worker
# One round of a multi-round command: from the replies so far, what to send to whom and
# for how long (None: no further round).
Round = Callable[[list[WorkerReply]], "tuple[Command, list[Worker], float]"]

# The router's own handlers (method names: a test may replace one on the instance).
OWN = {Pause: "pause", Continue: "continue_", AbortRequest: "abort", AbortAll: "abort_all"}
# Refused while requests run unpaused: every worker must see the same weights and memory.
NEED_QUIET = (UpdateWeights, ReleaseMemory)
# Their replies say what memory each worker has released (zpd/router/memory.py).
MEMORY = (ReleaseMemory, ResumeMemory, Status)
# Refused while a weight-sync step runs (with the sync's own commands): they would
# change weights or let requests run.
BLOCKED = (Continue, UpdateWeights)


class Front(Protocol):
    """The router's client socket."""

    def send(self, identity: bytes, msg: Message) -> bool: ...


class Sync(Protocol):
    """Trainer weight sync (zpd/router/weights/sync.py): the commands it runs, and the
    join or push under way (`step`, None: none; `what`: it in words)."""
    COMMANDS: tuple[type[AdminCommand], ...]
    step: object | None
    what: str

    @property
    def pushing(self) -> bool: ...

    def run(self, cmd: AdminCommand, timeout: float, reply: Reply) -> None: ...


class Router(Protocol):
    """What the admin commands read and change on their router (RouterServer is one)."""
    cfg: RouterConfig
    endpoint: str
    front: Front
    loop: Loop
    tally: Tally
    workers: list[Worker]
    inflight: dict[str, InFlight]
    paused: PauseMode | None
    released: ReleasedMemory
    followers: Peers
    coordinator: Coordinator | None

    @property
    def queued(self) -> Collection[str]: ...

    def running(self) -> int: ...

    def hold(self, mode: PauseMode) -> None: ...

    def unpause(self) -> None: ...

    def dispatch(self) -> None: ...

    def end_queued(self, rid: str, status: int, reason: str) -> None: ...

    def on_abort(self, msg: Abort) -> None: ...


class RouterAdmin:
    """Admin commands on one router, whose state (workers, pause mode, queued and
    in-flight requests) it reads and changes through `server`; `sync`: trainer weight
    sync, once the assembly plugs it in (zpd/ops/router.py)."""

    def __init__(self, server: Router) -> None:
        self.server = server
        self.fanouts: dict[str, Fanout[WorkerReply]] = {}
        self.results: dict[str, type[AdminResult]] = {}    # what each fan-out's replies hold
        self.req_ids = itertools.count(1)
        self.sync: Sync | None = None

    @property
    def pushing(self) -> bool:
        """A weight push is under way: new requests queue until its commit is out."""
        return self.sync is not None and self.sync.pushing

    def on_admin(self, client: bytes, msg: Admin,
                 answer: Callable[[AdminReply], object] | None = None) -> None:
        """Parse the command (its record checks it), then run it: bad input is answered
        400 and changes nothing; a command that fails here is answered 500, never raised.
        A follower passes most commands on to its coordinator (zpd/router/ha/peers.py);
        `answer`: where the reply goes instead of `client` (a command the coordinator
        sent this follower, which runs here)."""
        reply = self._replier(client, msg, answer)
        log.info("admin %r %.400r", msg.command, msg.args)   # bounded: a tensor payload is MiBs
        try:
            args, timeout = split_timeout(msg.args, self.server.cfg.admin_timeout_s)
            if msg.command not in COMMANDS:
                raise StatusError(400, f"unknown command {msg.command!r}; known: "
                                       f"{', '.join(sorted(COMMANDS))}")
            cmd = parse(msg.command, args, client=True)
            link = self.server.coordinator
            if answer is None and link is not None and link.passes(cmd.COMMAND, args):
                link.pass_on(client, msg, timeout)
            else:
                self._run(cmd, timeout, reply)
        except StatusError as e:
            reply(False, {"status": e.status, "error": str(e)})
        except Exception as e:  # an admin command must answer, whatever happened
            log.exception("admin %r failed", msg.command)
            reply(False, {"status": 500, "error": f"{type(e).__name__}: {e}"})

    def _replier(self, client: bytes, msg: Admin,
                 answer: Callable[[AdminReply], object] | None = None) -> Reply:
        server = self.server
        send = answer or (lambda m: server.front.send(client, m))

        def reply(ok: bool, result: dict) -> None:
            send(AdminReply(msg.req_id, ok, {
                "router": server.endpoint, "command": msg.command, "paused": server.paused,
                "memory_released": server.released.fields(),
                "queued": len(server.queued), "inflight": len(server.inflight)} | result
                | (self.status_fields() if msg.command == "status" else {})))
        return reply

    def status_fields(self) -> dict:
        server = self.server
        peers = {"coordinator": server.coordinator.fields()} if server.coordinator else \
            {"followers": server.followers.fields()}
        return {"counters": server.tally.fields()} | peers

    def _run(self, cmd: AdminCommand, timeout: float, reply: Reply) -> None:
        server, sync = self.server, self.sync
        if sync is not None and sync.step is not None and \
                isinstance(cmd, (*BLOCKED, *sync.COMMANDS)):
            reply(False, {"status": 409, "error": f"{cmd.COMMAND} while {sync.what}: wait "
                                                  "for it", "workers": []})
        elif sync is not None and isinstance(cmd, sync.COMMANDS):
            sync.run(cmd, timeout, reply)
        elif type(cmd) in OWN:
            getattr(self, OWN[type(cmd)])(cmd, timeout, reply)
        elif isinstance(cmd, NEED_QUIET) and server.paused is None and server.running():
            # an idle prefill would take the new weights (or drop its memory) while its
            # decode, still running, refuses: all workers must see the same state
            reply(False, {"status": 409, "error": f"{cmd.COMMAND} while requests are in "
                                                  "flight: pause first", "workers": []})
        elif isinstance(cmd, MEMORY):
            answer = answer_all(reply)

            def memory(replies: list[WorkerReply]) -> None:
                self.memory_changed(replies)
                answer(replies)
            self.fan_out(cmd, server.workers, timeout, memory)
        else:
            self.fan_out(cmd, server.workers, timeout, answer_all(reply))

    def memory_changed(self, replies: list[WorkerReply]) -> None:
        """After release_memory, resume_memory or status: what is released now (new
        requests wait while anything is), told to the followers where it changed;
        what waits runs once nothing is."""
        server = self.server
        if server.released.note(replies):
            server.followers.tell(lambda _: None, server.cfg.peer_timeout)
            server.dispatch()

    def abort(self, cmd: AbortRequest, timeout: float, reply: Reply) -> None:
        """End the rid, queued or in flight here, else at a router following this one.
        A rid not here by that name also ends the requests an HTTP front named
        "<caller's space>:rid" (zpd/http/guard/callers.py): with several fronts, the front
        asked may not be the one that serves it, and its table does not have it."""
        server, rid = self.server, cmd.rid
        here = rid in server.queued or rid in server.inflight
        rids = [rid] if here else [r for r in (*server.queued, *server.inflight)
                                   if r.endswith(f":{rid}")]
        if rids:
            states = [self._abort(r) for r in rids]
            reply(True, {"rid": rid, "state": states[0]} | ({} if here else {"rids": rids}))
            return

        def found(acks: list[dict]) -> None:
            ok = [a for a in acks if a["ok"]]
            reply(bool(ok), ok[0] if ok else {"rid": rid, "status": 404,
                                              "error": f"unknown rid {rid!r}"})
        server.followers.ask(cmd.COMMAND, cmd.args(), found, timeout)

    def _abort(self, rid: str) -> str:
        """End `rid` (queued or in flight here) with 499; where it was."""
        if rid in self.server.queued:
            self.server.end_queued(rid, 499, "aborted by admin")
            return "queued"
        self.server.on_abort(Abort(rid, 499, "aborted by admin"))
        return "inflight"

    def abort_all(self, cmd: AbortAll, timeout: float, reply: Reply) -> None:
        """End every request queued or in flight here, whoever sent it, with 499, and
        at every router following this one."""
        server = self.server
        queued, running = list(server.queued), list(server.inflight)
        for rid in queued:
            server.end_queued(rid, 499, "aborted by admin (abort_all)")
        for rid in running:
            server.on_abort(Abort(rid, 499, "aborted by admin (abort_all)"))
        here = len(queued) + len(running)

        def counted(acks: list[dict]) -> None:
            there = sum(a["aborted"] for a in acks if a["ok"] and type(a.get("aborted")) is int)
            reply(all(a["ok"] for a in acks), {"aborted": here + there, "followers": acks})
        server.followers.ask(cmd.COMMAND, {}, counted, timeout)

    def pause(self, cmd: Pause, timeout: float, reply: Reply) -> None:
        """1. queue new requests here (abort: end the queued ones), and at every router
        that follows this one; 2. pause the decodes; 3. pause the prefills. Decodes
        first: a prefill that paused first would drop requests mid-write and tell their
        decodes (kv_failed) before those knew of a pause, failing (499) what a retract
        must hold. Once the decodes have paused, the prefills have nothing in flight
        that a decode still waits for."""
        server = self.server
        if server.paused not in (None, cmd.mode):
            reply(False, {"status": 409, "error": f"already paused ({server.paused}); continue first"})
            return
        server.hold(cmd.mode)
        until = server.loop.time() + timeout       # every round together, as the caller asked

        def workers(followers: list[dict]) -> None:
            left = until - server.loop.time()
            self.in_order(answer_all(reply, followers),
                          lambda _: (cmd, self.of_role("decode"), left * 0.75),
                          lambda _: (cmd, self.of_role("prefill"), until - server.loop.time()))
        server.followers.tell(workers, timeout * HOLD_SHARE)

    def continue_(self, cmd: Continue, timeout: float, reply: Reply) -> None:
        """1. collect the first tokens the followers' clients have; 2. continue the
        prefills; 3. continue the decodes, naming the prefills that answered (decodes
        send their recomputes only to those) and the first tokens clients have; 4.
        unpause here, and at the followers, once every decode and some prefill continued."""
        server = self.server
        early: dict = {}

        def decodes(got: list[WorkerReply]) -> tuple[Continue, list[Worker], float]:
            live = [r.endpoint for r in got if r.ok]
            return (dataclasses.replace(cmd, prefills=live, early=early | self.early_tokens()),
                    self.of_role("decode"), timeout)

        def done(replies: list[WorkerReply]) -> None:
            ok = all(r.ok for r in replies if r.role == "decode") and \
                any(r.ok for r in replies if r.role == "prefill")
            if ok:
                server.unpause()
            reply(ok, {"workers": to_wire(replies)})

        def workers(followers: list[dict]) -> None:
            for ack in followers:
                if ack["ok"] and isinstance(ack.get("early"), dict):
                    early.update(ack["early"])
            self.in_order(done, lambda _: (cmd, self.of_role("prefill"), timeout), decodes)
        server.followers.tell(workers, timeout * HOLD_SHARE, early=True)

    def early_tokens(self) -> dict:
        """First tokens the client has from a prefill but no decode confirmed: a decode
        holding such a request resumes after that token, not before it."""
        return {f.rid: f.early.to_wire() for f in self.server.inflight.values()
                if f.early is not None and f.from_decode == 0}

    def of_role(self, role: str) -> list[Worker]:
        return [w for w in self.server.workers if w.role == role]

    # --- fan-out ------------------------------------------------------------------

    def in_order(self, done: Replies, *rounds: Round) -> None:
        """Run `rounds` one after the other, each given the replies so far; then `done`
        with every reply, in the order of the router's workers."""
        order = {w.endpoint: i for i, w in enumerate(self.server.workers)}

        def after(replies: list[WorkerReply], left: tuple[Round, ...]) -> None:
            if not left:
                done(sorted(replies, key=lambda r: order.get(r.endpoint, len(order))))
                return
            cmd, targets, timeout = left[0](replies)
            self.fan_out(cmd, targets, timeout, lambda got: after(replies + got, left[1:]))

        after([], rounds)

    def fan_out(self, cmd: Command, targets: list[Worker], timeout: float, on_done: Replies,
                each: Callable[[WorkerReply, set], None] | None = None) -> None:
        """Send `cmd` (or `cmd(worker)`) to `targets`; call `on_done` with one reply per
        target once all answered or `timeout` passed (and `each` with each reply as it
        comes, and the endpoints still waiting then)."""
        key = f"{next(self.req_ids)}"
        live = [w for w in targets if w.alive]
        fan = self.fanouts[key] = Fanout(on_done, {w.endpoint for w in live}, each=each)
        fan.replies = [WorkerReply.failed(w.endpoint, w.role, 503, "worker unavailable (no heartbeat)")
                       for w in targets if not w.alive]
        fan.timer = self.server.loop.call_later(timeout, self._done, key)
        for w in live:
            sent = cmd(w) if callable(cmd) else cmd
            self.results[key] = sent.RESULT
            w.dealer.send(sent.envelope(key))
        if not live:
            self._done(key)

    def on_reply(self, worker: Worker, msg: AdminReply) -> None:
        """Parsed here, once, as the result of the command it answers."""
        kind = self.results.get(msg.req_id)
        if kind is not None:
            self._record(msg.req_id, WorkerReply.from_wire(msg.ok, msg.result, worker.endpoint,
                                                           worker.role, kind))

    def on_dead(self, worker: Worker) -> None:
        """A worker marked dead answers no fan-out now: each waiting on it takes a 503 for
        it at once, not a 504 at its timeout (a weight push's: every queued request
        would wait that long)."""
        for key, fan in list(self.fanouts.items()):
            if worker.endpoint in fan.waiting:
                self._record(key, WorkerReply.failed(
                    worker.endpoint, worker.role, 503,
                    "worker unavailable (no heartbeat): marked dead"))

    def _record(self, key: str, reply: WorkerReply) -> None:
        fan = self.fanouts.get(key)
        if fan is None or reply.endpoint not in fan.waiting:
            return
        fan.waiting.discard(reply.endpoint)
        fan.replies.append(reply)
        if fan.each is not None:
            fan.each(reply, set(fan.waiting))
        if not fan.waiting:
            self._done(key)

    def _done(self, key: str) -> None:
        fan = self.fanouts.pop(key, None)
        self.results.pop(key, None)
        if fan is None:
            return
        if fan.timer is not None:
            fan.timer.cancel()
        roles = {w.endpoint: w.role for w in self.server.workers}
        fan.on_done(fan.replies + [WorkerReply.failed(ep, roles[ep], 504,
                                                      "no answer before the timeout")
                                   for ep in sorted(fan.waiting)])


def answer_all(reply: Reply, followers: list[dict] | None = None) -> Replies:
    """Answer with every worker's reply: ok when all are (and the followers' acks,
    which do not decide it: a router that did not confirm is named there)."""
    more = {} if followers is None else {"followers": followers}
    return lambda replies: reply(all(r.ok for r in replies), {"workers": to_wire(replies)} | more)
