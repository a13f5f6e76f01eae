"""The decode worker's scheduler: reserve pages, ask prefill for the KV, then generate.

Loop body: poll sockets and fire deadlines, admit requests waiting for pages, one
decode step for the running batch, emit tokens. Pages a prefill write may still reach
are fenced (zpd/worker/fences.py says until when).
"""
from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass

import zmq

from engines.allocator import PoolFull
from engines.sampler import SamplingParams
from engines.batch import DecodeBatch
from zpd.worker.fences import Fences
from zpd.worker.links import LinkState, PrefillLink, PrefillLinks
from zpd.wire.deadline import Deadline
from zpd.wire.protocol import (Abort, Admin, Generate, Hello, KvDest, KvDone, KvFailed, Message,
                          Recompute, TokenPart, Tokens)
from engines.request import (ABORTED, BAD_REQUEST, CONFLICT, DEADLINE, INTERNAL, UNAVAILABLE, Phase,
                         Request, RequestError, response, validate)
from zpd.worker.core import AdminError, Respond, WorkerCore, pause_mode

log = logging.getLogger("zpd.worker.decode")


@dataclass(eq=False)
class Entry:
    room: int
    epoch: int
    req: Request
    prefill: str
    client: bytes            # the router's identity on our socket
    stream: bool
    sent: int = 0            # output tokens already sent to the client
    deadline: Deadline | None = None   # set when the entry is made
    asked: int = -1          # the epoch whose kv_dest went out: its pages may be written


class DecodeScheduler:
    def __init__(self, core: WorkerCore, ctx: zmq.Context) -> None:
        self.core, self.pool, self.loop = core, core.pool, core.loop
        self.deadlines = core.cfg.deadlines
        self.entries: dict[int, Entry] = {}
        self.by_rid: dict[str, Entry] = {}
        self.waiting: deque[Entry] = deque()                   # no pages yet
        self.fences = Fences(self.loop, self.pool.allocator, self.deadlines.transfer + 5.0,
                             self.deadlines.dead_fence, self._prefill_dead)
        self.batch = DecodeBatch(core.compute, core.cfg.max_batch)
        self.live_prefills: list[str] | None = None            # from the router's continue
        self.pause_waiters: list[Respond] = []
        self.links = PrefillLinks(ctx, self.loop, self._hello(), self.on_prefill_message,
                                  self.on_refused, self.on_prefill_restarted,
                                  core.security.client_options(), self.deadlines.heartbeat,
                                  self.deadlines.peer_timeout, core.drops)
        self.loop.every(self.deadlines.heartbeat, self.end_orphans)
        core.on_memory_resumed = lambda: self.links.rehello(self._hello())
        core.handlers |= {Generate: self.on_generate, Abort: self.on_abort, Admin: core.on_admin}
        core.admin_commands |= {"status": self.status, "pause": self.pause, "continue": self.resume}
        core.busy = lambda: bool(self.entries or self.fences)

    def _hello(self) -> Hello:
        core = self.core
        return Hello(core.endpoint, core.layout.to_dict(), core.compat_hash, core.backend.session_id,
                     core.pool_addr, self.pool.num_pages, core.model.version)

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            running = self.core.paused is None and (len(self.batch) > 0 or self._admissible())
            self.loop.run_once(max_wait=0 if running else None)
            self.core.flush_tokens()        # e.g. first tokens from kv_done: before the step
            if self.core.paused is None:
                self.admit()
                with self.core.long_call():
                    stepped = self.batch.step()
                for req in stepped:
                    self.emit(self.by_rid[req.rid])
            self._answer_pause_waiters()
            self.core.flush_tokens()

    # --- admission -------------------------------------------------------------

    def on_generate(self, identity: bytes, msg: Generate) -> None:
        if msg.room in self.entries:
            log.warning("duplicate generate rid=%s room=%d dropped", msg.rid, msg.room)
            return
        if msg.rid in self.by_rid:
            self.refuse_duplicate(identity, msg)
            return
        prompt, params, error = [], SamplingParams(), None
        try:
            params = SamplingParams.from_dict(msg.sampling)
            prompt = self.core.prompt_ids(msg)
            validate(prompt, params, self.core.model.cfg, self.pool.layout.page_size, self.pool.num_pages)
        except RequestError as e:
            error = e
        except ValueError as e:
            error = RequestError(BAD_REQUEST, str(e))
        entry = Entry(msg.room, msg.epoch, Request(msg.rid, prompt, params), msg.prefill, identity,
                      msg.stream)
        entry.deadline = Deadline(self.loop, lambda what, e=entry: self._expire(e, what))
        self.entries[msg.room], self.by_rid[msg.rid] = entry, entry
        log.info("rid=%s room=%d epoch=%d generate via prefill %s", msg.rid, msg.room, msg.epoch,
                 msg.prefill)
        if error is not None:
            self.finish(entry, error.status, str(error), tell_prefill=True)
        elif self.core.paused in ("retract", "abort"):
            entry.req.phase = Phase.HELD          # the prefill drops it; recomputed after continue
        else:
            self._enqueue(entry)

    def refuse_duplicate(self, identity: bytes, msg: Generate) -> None:
        """A rid still running here (e.g. an orphan of a router that was restarted and
        got the same rid again): answer 409 and free its prefill, so nothing waits."""
        reason = f"rid {msg.rid!r} is already in flight on decode {self.core.endpoint}"
        log.warning("rid=%s room=%d refused: %s", msg.rid, msg.room, reason)
        if msg.prefill:
            self.links.get(msg.prefill).send(KvFailed(msg.room, msg.epoch, CONFLICT, reason))
        self.core.send(identity, Tokens.abort(msg.rid, CONFLICT, reason))

    def _enqueue(self, entry: Entry) -> None:
        entry.req.phase = Phase.WAITING
        self.waiting.append(entry)
        self._deadline(entry, self.deadlines.wait_pages, "waiting for KV pages")

    def _admissible(self) -> bool:
        while self.waiting and (self.entries.get(self.waiting[0].room) is not self.waiting[0]
                                or self.waiting[0].req.phase is not Phase.WAITING):
            self.waiting.popleft()
        return bool(self.waiting) and self.batch.has_room and not self.core.memory_released \
            and self.pool.allocator.can_alloc(self.pool.pages_for(self.waiting[0].req.max_context))

    def admit(self) -> None:
        """FIFO: reserve pages for prompt + max_new_tokens, then ask for the KV."""
        while self._admissible():
            entry = self.waiting.popleft()
            try:
                entry.req.pages = self.pool.allocator.alloc(self.pool.pages_for(entry.req.max_context))
            except PoolFull:
                self.waiting.appendleft(entry)
                return
            link = self.links.get(self._prefill_for(entry))
            if link.state in (LinkState.REFUSED, LinkState.DEAD):
                status = UNAVAILABLE if link.state is LinkState.DEAD else INTERNAL
                self.finish(entry, status, link.reason, tell_prefill=True)
                continue
            entry.prefill = link.endpoint
            entry.req.phase = Phase.TRANSFERRING
            self._deadline(entry, self.deadlines.wait_kv_done, "waiting for the KV (kv_done)")
            link.when_ready(lambda e=entry, l=link, epoch=entry.epoch: self._request_kv(e, l, epoch))

    def _prefill_for(self, entry: Entry) -> str:
        """The request's own prefill, unless the router said it is gone after a pause."""
        live = self.live_prefills
        if entry.epoch == 0 or not live or entry.prefill in live:
            return entry.prefill
        return live[entry.room % len(live)]

    def _request_kv(self, entry: Entry, link: PrefillLink, epoch: int) -> None:
        if self.entries.get(entry.room) is not entry or entry.epoch != epoch or \
                entry.req.phase is not Phase.TRANSFERRING:      # ended or retracted meanwhile
            return
        req = entry.req
        prefix = req.prompt + req.output[:-1]
        if epoch > 0:      # the prefill forgot this request when it was retracted
            link.send(Recompute(req.rid, entry.room, epoch, prefix, req.params.to_dict()))
        link.send(KvDest(entry.room, epoch, req.rid, req.pages[:self.pool.pages_for(len(prefix))]))
        entry.asked = epoch

    # --- from prefill ---------------------------------------------------------------

    def on_prefill_message(self, link: PrefillLink, msg: Message) -> None:
        key = (getattr(msg, "room", -1), getattr(msg, "epoch", -1))
        if isinstance(msg, (KvDone, KvFailed)) and self.fences.answered(key, link.endpoint):
            return                               # the prefill answered: nothing more will land
        entry = self.entries.get(key[0])
        if entry is None or entry.epoch != key[1] or entry.req.phase is not Phase.TRANSFERRING:
            log.debug("dropping %s for unknown or old room from %s", msg.TYPE, link.endpoint)
            return
        if isinstance(msg, KvDone):
            self.on_kv_done(entry, msg)
        elif isinstance(msg, KvFailed):
            entry.req.phase = Phase.FINISHED     # the prefill will not write any more
            self.finish(entry, msg.status, f"prefill {link.endpoint}: {msg.reason}")
        else:
            log.warning("unexpected %s from prefill %s", msg.TYPE, link.endpoint)

    def on_kv_done(self, entry: Entry, msg: KvDone) -> None:
        req = entry.req
        req.timings = {k: v for k, v in msg.timings.items() if isinstance(v, (int, float))}
        entry.deadline.cancel()
        if not req.output:
            req.emit(msg.first_token, msg.weight_version)
            req.finish = self.core.compute.stop(req)
        log.info("rid=%s room=%d epoch=%d kv received", req.rid, entry.room, entry.epoch)
        if req.finished:
            req.phase = Phase.FINISHED
            self.emit(entry)
        else:
            self.batch.add(req)
            self.emit(entry)

    def on_refused(self, link: PrefillLink) -> None:
        """The prefill refused our hello (500) or stopped answering (503): fail its
        requests now, also those still waiting for pages, which would only fail later."""
        dead = link.state is LinkState.DEAD
        for entry in [e for e in self.entries.values() if self._uses(e, link)]:
            if not dead and entry.req.phase is Phase.TRANSFERRING:
                entry.req.phase = Phase.FINISHED     # it never got our pages: no fence
            # a dead (perhaps only frozen) prefill may still write: its pages stay fenced
            self.finish(entry, UNAVAILABLE if dead else INTERNAL, link.reason, tell_prefill=True)

    def _uses(self, entry: Entry, link: PrefillLink) -> bool:
        phase = entry.req.phase
        if phase is Phase.TRANSFERRING:
            return entry.prefill == link.endpoint
        return phase is Phase.WAITING and self._prefill_for(entry) == link.endpoint

    def on_prefill_restarted(self, link: PrefillLink) -> None:
        """The prefill answered our hello from a new transport session: the process
        that might have written into fenced pages is gone, so they are free."""
        released = self.fences.release_prefill(link.endpoint)
        if released:
            log.warning("prefill %s restarted: released %d fences", link.endpoint, released)

    def _prefill_dead(self, endpoint: str) -> bool:
        link = self.links.links.get(endpoint)
        return link is not None and link.state is LinkState.DEAD

    def end_orphans(self) -> None:
        """A router that stopped pinging is gone: end its requests and free their pages."""
        for router in self.core.silent_peers():
            orphans = [e for e in self.entries.values() if e.client == router]
            if orphans:
                log.error("router %r silent: ending its %d requests", router[:40], len(orphans))
            for entry in orphans:
                self.finish(entry, UNAVAILABLE, "router unavailable", tell_prefill=True)
            del self.core.pinged_at[router]

    # --- output and endings ---------------------------------------------------------

    def emit(self, entry: Entry) -> None:
        req = entry.req
        if not req.finished and not entry.stream:
            return
        new, versions = req.output[entry.sent:], req.weight_versions[entry.sent:]
        if not new and not req.finished:
            return
        entry.sent = len(req.output)
        meta = {}
        if req.finished:
            final = response(req, self.core.model.tokenizer)
            meta = final["meta"] | {"text": final["text"]}
            log.info("rid=%s room=%d epoch=%d finished: %s after %d tokens", req.rid, entry.room,
                     entry.epoch, req.finish.get("type"), len(req.output))
        self.core.queue_token(entry.client, TokenPart(req.rid, new, versions, req.finish, meta))
        if req.finished:
            self._forget(entry)

    def on_abort(self, identity: bytes, msg: Abort) -> None:
        entry = self.by_rid.get(msg.rid)
        if entry is not None:
            self.finish(entry, msg.status or ABORTED, msg.reason or "aborted", tell_prefill=True)

    def finish(self, entry: Entry, status: int, reason: str, tell_prefill: bool = False) -> None:
        """End the request with an error status and tell the client."""
        log.info("rid=%s room=%d epoch=%d ends: %d %s", entry.req.rid, entry.room, entry.epoch,
                 status, reason)
        if tell_prefill and entry.req.phase is not Phase.HELD:
            self.links.get(entry.prefill).send(KvFailed(entry.room, entry.epoch, status, reason))
        self._release(entry)
        entry.req.abort(status, reason)
        self.emit(entry)

    def _release(self, entry: Entry) -> None:
        """Give back the request's pages; fence them if a prefill write may still land."""
        req = entry.req
        self.batch.remove(req.rid)
        if req.pages and req.phase is Phase.TRANSFERRING and entry.asked == entry.epoch:
            self.fences.add((entry.room, entry.epoch), req.pages, entry.prefill)
        elif req.pages:
            self.pool.allocator.free_pages(req.pages)
        req.pages = []

    def _forget(self, entry: Entry) -> None:
        self.entries.pop(entry.room, None)
        self.by_rid.pop(entry.req.rid, None)
        entry.deadline.cancel()
        self._release(entry)

    def _deadline(self, entry: Entry, seconds: float, what: str) -> None:
        entry.deadline.start(seconds, what, paused=self.core.paused is not None)

    def _expire(self, entry: Entry, what: str) -> None:
        if self.entries.get(entry.room) is entry:
            self.finish(entry, DEADLINE, f"deadline expired {what}", tell_prefill=True)

    # --- pause, continue ------------------------------------------------------------

    def pause(self, args: dict, respond: Respond) -> None:
        mode = pause_mode(args)
        if self.core.paused is not None and self.core.paused != mode:
            raise AdminError(409, f"already paused ({self.core.paused}); continue first")
        self.core.paused = mode
        for entry in list(self.entries.values()):
            entry.deadline.suspend()             # a held request waits as long as the pause
            if mode == "abort":
                self.finish(entry, ABORTED, "aborted by pause(abort)", tell_prefill=True)
            elif mode == "retract" and entry.req.phase is not Phase.HELD:
                self.retract(entry)
        self.pause_waiters.append(respond)
        self._answer_pause_waiters()

    def retract(self, entry: Entry) -> None:
        """Drop the request's KV and hold it; its last token is fed again after continue."""
        req = entry.req
        entry.deadline.cancel()
        if req.phase is Phase.TRANSFERRING:
            self.links.get(entry.prefill).send(KvFailed(entry.room, entry.epoch, ABORTED, "retracted"))
        self._release(entry)
        req.retractions += 1
        req.phase = Phase.HELD
        log.info("rid=%s room=%d epoch=%d retracted after %d tokens", req.rid, entry.room,
                 entry.epoch, len(req.output))

    def _answer_pause_waiters(self) -> None:
        """pause(retract|abort) is answered once no page is fenced: then no worker
        holds KV for any request and memory can be flushed."""
        if self.pause_waiters and not (self.fences and self.core.paused in ("retract", "abort")):
            waiters, self.pause_waiters = self.pause_waiters, []
            for respond in waiters:
                respond(True, self._status())

    def resume(self, args: dict, respond: Respond) -> None:
        """Re-admit held requests as a new epoch; they are recomputed by a live prefill."""
        was, self.core.paused = self.core.paused, None
        prefills = args.get("prefills")
        if isinstance(prefills, list) and all(isinstance(p, str) for p in prefills) and prefills:
            self.live_prefills = prefills
        held = sorted((e for e in self.entries.values() if e.req.phase is Phase.HELD),
                      key=lambda e: e.req.arrived)
        early = args.get("early") if isinstance(args.get("early"), dict) else {}
        for entry in held:
            self._take_early_token(entry, early.get(entry.req.rid))
        for entry in self.entries.values():
            entry.deadline.resume()
        for entry in held:
            entry.epoch += 1
            self._enqueue(entry)
        respond(True, self._status() | {"was_paused": was, "resumed": len(held)})

    def _take_early_token(self, entry: Entry, got) -> None:
        """The client already has this request's first token (its prefill sent it to the
        router before the KV arrived here): resume after it, as after any token."""
        req = entry.req
        if req.output or not (isinstance(got, list) and len(got) == 2 and isinstance(got[0], int)
                              and isinstance(got[1], str)):
            return
        if not 0 <= got[0] < self.core.model.cfg.vocab_size:
            log.warning("rid=%s: early token %r out of range; ignored", req.rid, got[0])
            return
        req.emit(got[0], got[1])     # sent again with the next ones: the router passes it once
        log.info("rid=%s room=%d resumes after its first token %d (%s), which its prefill sent "
                 "ahead", req.rid, entry.room, got[0], got[1])

    def status(self, args: dict, respond: Respond) -> None:
        respond(True, self._status())

    def _status(self) -> dict:
        fenced = self.fences.pages
        held = sum(len(e.req.pages) for e in self.entries.values())
        phases = [e.req.phase for e in self.entries.values()]
        return {"weight_version": self.core.model.version, "paused": self.core.paused,
                "memory": self.core.memory_state(),
                "kv_pages": self.core.kv_pages(held, fenced),
                "queues": {"waiting_pages": phases.count(Phase.WAITING),
                           "waiting_kv": phases.count(Phase.TRANSFERRING),
                           "running": len(self.batch), "held": phases.count(Phase.HELD)},
                "held": [e.req.rid for e in self.entries.values() if e.req.phase is Phase.HELD],
                "peers": self.links.status()}
