"""The decode worker's scheduler: reserve pages, ask prefill for the KV, then generate.

Loop body: poll sockets and fire deadlines, admit requests waiting for pages, one
decode step for the running batch, emit tokens.
"""
from __future__ import annotations

import itertools
import logging
import threading
from collections import deque
from dataclasses import dataclass

import zmq

from engines.allocator import PoolFull
from engines.sampler import SamplingParams
from zpd.decode_batch import DecodeBatch
from zpd.links import LinkState, PrefillLink, PrefillLinks
from zpd.loop import Timer
from zpd.protocol import Abort, Admin, Generate, Hello, KvDest, KvDone, KvFailed, Message, Token
from zpd.request import (ABORTED, BAD_REQUEST, DEADLINE, INTERNAL, Phase, Request, RequestError,
                         response, validate)
from zpd.worker import WorkerCore

log = logging.getLogger("zpd.decode")


@dataclass(eq=False)
class Entry:
    room: int
    epoch: int
    req: Request
    prefill: str
    client: bytes            # the router's identity on our socket
    stream: bool
    sent: int = 0            # output tokens already sent to the client
    timer: Timer | None = None


class DecodeScheduler:
    def __init__(self, core: WorkerCore, ctx: zmq.Context) -> None:
        self.core, self.pool, self.loop = core, core.pool, core.loop
        self.deadlines = core.cfg.deadlines
        self.entries: dict[int, Entry] = {}
        self.by_rid: dict[str, Entry] = {}
        self.waiting: deque[Entry] = deque()           # no pages yet
        self.fenced: dict[int, list[int]] = {}         # fence id -> pages a write may still reach
        self.fence_ids = itertools.count()
        self.batch = DecodeBatch(core.compute, core.cfg.max_batch)
        hello = Hello(core.endpoint, core.layout.to_dict(), core.compat_hash,
                      core.backend.session_id, self.pool.data_ptr, self.pool.num_pages,
                      core.model.version)
        self.links = PrefillLinks(ctx, self.loop, hello, self.on_prefill_message, self.on_refused)
        core.handlers |= {Generate: self.on_generate, Abort: self.on_abort, Admin: core.on_admin}
        core.admin_commands["status"] = self.status

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            busy = len(self.batch) > 0 or self._admissible()
            self.loop.run_once(max_wait=0 if busy else None)
            self.admit()
            for req in self.batch.step():
                self.emit(self.by_rid[req.rid])

    # --- admission -------------------------------------------------------------

    def on_generate(self, identity: bytes, msg: Generate) -> None:
        if msg.room in self.entries or msg.rid in self.by_rid:
            log.warning("duplicate generate rid=%s room=%d dropped", msg.rid, msg.room)
            return
        prompt, params, error = [], SamplingParams(), None
        try:
            params = SamplingParams.from_dict(msg.sampling)
            prompt = self.core.prompt_ids(msg)
        except RequestError as e:
            error = e
        except ValueError as e:
            error = RequestError(BAD_REQUEST, str(e))
        entry = Entry(msg.room, msg.epoch, Request(msg.rid, prompt, params), msg.prefill, identity,
                      msg.stream)
        self.entries[msg.room], self.by_rid[msg.rid] = entry, entry
        log.info("rid=%s room=%d epoch=%d generate via prefill %s", msg.rid, msg.room, msg.epoch,
                 msg.prefill)
        try:
            if error:
                raise error
            validate(entry.req.prompt, params, self.core.model.cfg, self.pool.layout.page_size,
                     self.pool.num_pages)
        except RequestError as e:
            self.finish(entry, e.status, str(e), tell_prefill=True)
            return
        self.waiting.append(entry)
        self._deadline(entry, self.deadlines.wait_pages, "waiting for KV pages")

    def _admissible(self) -> bool:
        while self.waiting and self.entries.get(self.waiting[0].room) is not self.waiting[0]:
            self.waiting.popleft()
        return bool(self.waiting) and self.batch.has_room and self.pool.allocator.can_alloc(
            self.pool.pages_for(self.waiting[0].req.max_context))

    def admit(self) -> None:
        """FIFO: reserve pages for prompt + max_new_tokens, then ask for the KV."""
        while self._admissible():
            entry = self.waiting.popleft()
            try:
                entry.req.pages = self.pool.allocator.alloc(self.pool.pages_for(entry.req.max_context))
            except PoolFull:
                self.waiting.appendleft(entry)
                return
            link = self.links.get(entry.prefill)
            if link.state is LinkState.REFUSED:
                self.finish(entry, INTERNAL, link.reason, tell_prefill=True)
                continue
            entry.req.phase = Phase.TRANSFERRING
            self._deadline(entry, self.deadlines.wait_kv_done, "waiting for the KV (kv_done)")
            link.when_ready(lambda e=entry, l=link: self._send_kv_dest(e, l))

    def _send_kv_dest(self, entry: Entry, link: PrefillLink) -> None:
        if self.entries.get(entry.room) is entry:
            prompt_pages = self.pool.pages_for(len(entry.req.prompt) + len(entry.req.output) - 1
                                               if entry.req.output else len(entry.req.prompt))
            link.dealer.send(KvDest(entry.room, entry.epoch, entry.req.rid,
                                    entry.req.pages[:prompt_pages]))

    # --- from prefill ---------------------------------------------------------------

    def on_prefill_message(self, link: PrefillLink, msg: Message) -> None:
        entry = self.entries.get(getattr(msg, "room", -1))
        if entry is None or entry.epoch != getattr(msg, "epoch", -1):
            log.debug("dropping %s for unknown or old room from %s", msg.TYPE, link.endpoint)
            return
        if isinstance(msg, KvDone):
            self.on_kv_done(entry, msg)
        elif isinstance(msg, KvFailed):
            entry.req.phase = Phase.FINISHED   # the prefill will not write any more
            self.finish(entry, msg.status, f"prefill {link.endpoint}: {msg.reason}")
        else:
            log.warning("unexpected %s from prefill %s", msg.TYPE, link.endpoint)

    def on_kv_done(self, entry: Entry, msg: KvDone) -> None:
        req = entry.req
        if not req.output:
            req.emit(msg.first_token, msg.weight_version)
            req.finish = self.core.compute.stop(req)
        if entry.timer is not None:
            entry.timer.cancel()
        if req.finished:
            req.phase = Phase.FINISHED
            self.emit(entry)
        else:
            self.batch.add(req)
            if entry.stream:
                self.emit(entry)

    def on_refused(self, link: PrefillLink) -> None:
        for entry in [e for e in self.entries.values() if e.prefill == link.endpoint
                      and e.req.phase is Phase.TRANSFERRING]:
            entry.req.phase = Phase.FINISHED          # it never got our pages: no fence
            self.finish(entry, INTERNAL, link.reason, tell_prefill=True)

    # --- output and endings ---------------------------------------------------------

    def emit(self, entry: Entry) -> None:
        req = entry.req
        if not req.finished and not entry.stream:
            return
        new, versions = req.output[entry.sent:], req.weight_versions[entry.sent:]
        entry.sent = len(req.output)
        meta = {}
        if req.finished:
            final = response(req, self.core.model.tokenizer)
            meta = final["meta"] | {"text": final["text"]}
        self.core.router.send(entry.client, Token(req.rid, new, versions, req.finished, req.finish, meta))
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
        if tell_prefill:
            self.links.get(entry.prefill).dealer.send(KvFailed(entry.room, entry.epoch, status, reason))
        if entry.req.phase is Phase.TRANSFERRING:
            self._fence(entry.req)
        self.batch.remove(entry.req.rid)
        entry.req.abort(status, reason)
        self.emit(entry)

    def _forget(self, entry: Entry) -> None:
        self.entries.pop(entry.room, None)
        self.by_rid.pop(entry.req.rid, None)
        if entry.timer is not None:
            entry.timer.cancel()
        if entry.req.pages:
            self.pool.allocator.free_pages(entry.req.pages)
            entry.req.pages = []

    def _fence(self, req: Request) -> None:
        """Pages a prefill write may still reach are kept out of use until a fence
        longer than the transfer deadline has passed."""
        if not req.pages:
            return
        fence_id = next(self.fence_ids)
        self.fenced[fence_id] = req.pages
        req.pages = []
        self.loop.call_later(self.deadlines.transfer + 5.0, self._unfence, fence_id)

    def _unfence(self, fence_id: int) -> None:
        self.pool.allocator.free_pages(self.fenced.pop(fence_id))

    def _deadline(self, entry: Entry, seconds: float, what: str) -> None:
        if entry.timer is not None:
            entry.timer.cancel()
        entry.timer = self.loop.call_later(seconds, self._expire, entry, what)

    def _expire(self, entry: Entry, what: str) -> None:
        entry.timer = None
        if self.entries.get(entry.room) is entry:
            self.finish(entry, DEADLINE, f"deadline expired {what}", tell_prefill=True)

    def status(self, args: dict) -> dict:
        fenced = sum(map(len, self.fenced.values()))
        return {"weight_version": self.core.model.version, "paused": None,
                "kv_pages": self.core.kv_pages(fenced),
                "queues": {"waiting_pages": len(self.waiting),
                           "waiting_kv": sum(1 for e in self.entries.values()
                                             if e.req.phase is Phase.TRANSFERRING),
                           "running": len(self.batch)},
                "peers": self.links.status()}
